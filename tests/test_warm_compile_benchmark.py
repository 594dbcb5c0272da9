"""benchmarks/warm_compile.py's table from two runs' results.json."""

import json

from benchmarks import warm_compile
from tests.support.run_results import run_results


def _result(step, compile_s, wall_s):
  return run_results(compilation_cache={'train_step': step},
                     compile_seconds=compile_s, wall_seconds=wall_s)


def test_table_reads_each_runs_cache_and_compile_seconds():
  text = warm_compile.table({'cold': _result('miss', 20.0, 90.0),
                             'warm': _result('hit', 5.0, 70.0)})
  lines = text.splitlines()
  assert lines[1].split() == ['cold', 'miss', '20.0', '90.0']
  assert lines[2].split() == ['warm', 'hit', '5.0', '70.0']
  assert lines[-1] == ('cold_compile_s=20.0 warm_compile_s=5.0 '
                       'warm_over_cold=0.250')


def test_the_runs_share_one_cache_folder_and_write_their_own_results(
    monkeypatch, tmp_path):
  commands = []

  def fake_run(command, check, stdout):
    del check, stdout
    commands.append(command)
    output = command[command.index('--output-dir') + 1]
    (tmp_path / output).mkdir(parents=True)
    (tmp_path / output / 'results.json').write_text(
        json.dumps(run_results(compile_seconds=1.0).to_json()))

  monkeypatch.setattr(warm_compile.subprocess, 'run', fake_run)
  monkeypatch.chdir(tmp_path)
  for name in ('a', 'b'):
    assert warm_compile.run_example(('--steps', '3'), 'cache', name) == (
        run_results(compile_seconds=1.0))
  assert [c[c.index('--compilation-cache-dir') + 1] for c in commands] == [
      'cache', 'cache']
  assert commands[0][1:5] == ['-m', 'examples.finetune', '--steps', '3']
