"""What the CLI shows and keeps: phase lines when piped, one directory per run,
``examples.finetune.compare``, results.json's permissions, tokens/s."""

import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys

import pytest

from examples.finetune import __main__ as cli
from examples.finetune import compare
from examples.finetune import flags
from examples.finetune import report
from examples.finetune import run_dirs
from tests.support import tiny_llama

_REPO_ROOT = tiny_llama.REPO_ROOT


def _cli(args, cwd):
  """Runs the CLI with stdout and stderr piped (not terminals)."""
  return subprocess.run(
      [sys.executable, '-m', 'examples.finetune', *args], cwd=cwd,
      capture_output=True, text=True, timeout=600,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': _REPO_ROOT})


@pytest.mark.long
def test_piped_run_says_what_each_phase_does(workspace):
  output_dir = workspace['root'] / 'run-phases'
  # With progress on: piped, there must be no bar and still every phase line.
  args = tiny_llama.text_args(workspace, output_dir)
  args.remove('--no-progress')
  process = _cli(args, _REPO_ROOT)
  assert process.returncode == 0, process.stderr
  out = process.stdout
  phases = [f'loading the model {workspace["model"]}',
            'tokenising 24 training and 6 held-out examples',
            'setting up taco',
            'evaluating 6 held-out examples',
            'compiling the train step']
  position = 0
  for phase in phases:
    start = out.index(f'{phase} ...\n', position)
    match = re.compile(re.escape(phase) + r': \d+\.\d s\n').search(out, start)
    assert match, (phase, out)
    position = match.end()
  # The routing report, printed before training: which leaves TACO updates.
  report = re.search(r'TACO routing: (\d+) of (\d+) leaves to TACO .*'
                     r'optimizer state [\d,]+ B vs AdamW [\d,]+ B', out)
  assert report and 0 < int(report[1]) < int(report[2]), out
  assert out.index('TACO routing:') < out.index('compiling the train step')
  assert re.search(r'\nlayers/\*/attn/q/kernel \(x\d+\) .* taco ', out), out
  assert re.search(r'\nembed/embedding .* taco .* s=1 ', out), out
  assert 'the default routes rank-2 leaves only' not in out
  # The evaluation after training has its own pair of lines.
  assert len(re.findall(r'evaluating 6 held-out examples: \d+\.\d s\n',
                        out)) == 2, out
  # Mid-run evaluations and checkpoint saves go beside the step lines.
  err = process.stderr
  assert 'evaluating 6 held-out examples ...' in err, err
  assert 'step 3: saving a checkpoint ...' in err, err
  assert re.search(r'step 3: checkpoint saved to \S+ \(\d+\.\d s\)', err), err
  assert '\x1b[' not in out + err, 'no terminal control codes in a pipe'


def test_runs_get_their_own_directories_and_compare(workspace, monkeypatch,
                                                    tmp_path, capsys):
  monkeypatch.chdir(tmp_path)
  for optimizer in ('taco', 'adamw'):
    args = tiny_llama.text_args(workspace, 'unused', '--optimizer', optimizer)
    del args[args.index('--output-dir'):args.index('--output-dir') + 2]
    assert cli.main(args) == 0
  runs = sorted(os.listdir(tmp_path / 'runs' / 'finetune'))
  assert len(runs) == 2, runs
  assert re.fullmatch(r'adamw-text-\d{8}-\d{6}', runs[0]), runs
  assert re.fullmatch(r'taco-text-\d{8}-\d{6}', runs[1]), runs
  umask = os.umask(0)
  os.umask(umask)
  for run in runs:
    results = tmp_path / 'runs' / 'finetune' / run / 'results.json'
    assert os.stat(results).st_mode & 0o777 == 0o666 & ~umask
  process = subprocess.run(
      [sys.executable, '-m', 'examples.finetune.compare',
       *[os.path.join('runs', 'finetune', run) for run in runs]],
      cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env={**os.environ, 'PYTHONPATH': _REPO_ROOT})
  assert process.returncode == 0, process.stderr
  lines = process.stdout.splitlines()
  assert lines[0].split()[:5] == ['run', 'optimizer', 'lr', 'steps', 'metric']
  for line, run in zip(lines[1:3], runs):
    with open(tmp_path / 'runs' / 'finetune' / run / 'results.json') as f:
      results = json.load(f)
    cells = line.split()
    assert cells[:5] == [run, results['optimizer'],
                         f"{results['learning_rate']:g}", '3', 'accuracy']
    assert cells[5:7] == [f"{results['before']['accuracy']:.4f}",
                          f"{results['after']['accuracy']:.4f}"]
    assert cells[7] == f"{results['optimizer_state_bytes'] / 2**20:.1f}"
    assert cells[8] == f"{results['peak_memory_bytes'] / 2**20:.1f}"
    process_peak = results.get('process_peak_rss_bytes')
    assert cells[9] == ('n/a' if process_peak is None
                        else f'{process_peak / 2**20:.1f}')
    assert cells[12:] == [f"{results['parameter_bytes'] / 2**20:.1f}",
                          results['rounding']]
  png = tmp_path / 'runs' / 'finetune' / 'compare.png'
  curves = os.path.join('runs', 'finetune', 'compare.png')
  assert lines[-1] == f'curves: {curves}'
  with open(png, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  # Without matplotlib: the table, and a line saying what the PNG needs.
  png.unlink()
  monkeypatch.setitem(sys.modules, 'matplotlib', None)
  capsys.readouterr()
  assert compare.main([os.path.join('runs', 'finetune', run)
                       for run in runs]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[:3] == lines[:3] and out[-1] == (
      'the PNG of the curves needs matplotlib: pip install -e ".[bench]"')
  assert not png.exists()


def test_resume_without_output_dir_continues_the_newest_run(monkeypatch,
                                                            tmp_path):
  monkeypatch.chdir(tmp_path)
  config = flags.RunConfig(resume=True)
  with pytest.raises(flags.FinetuneError, match=r'--resume: no '):
    run_dirs.with_output_dir(config)
  root = tmp_path / 'runs' / 'finetune'
  for name, mtime in [('taco-tweets-20260101-000000', 2),
                      ('taco-tweets-20260102-000000', 1),
                      ('adamw-tweets-20260103-000000', 3)]:
    (root / name / 'checkpoints').mkdir(parents=True)
    os.utime(root / name / 'checkpoints', (mtime, mtime))
  (root / 'taco-tweets-20260104-000000').mkdir()  # no checkpoints
  resolved = run_dirs.with_output_dir(config)
  assert resolved.output_dir == os.path.join(
      'runs', 'finetune', 'taco-tweets-20260101-000000')
  assert run_dirs.with_output_dir(
      dataclasses.replace(config, output_dir='mine')).output_dir == 'mine'


def test_new_run_dir_never_reuses_a_name(tmp_path):
  now = datetime.datetime(2026, 11, 30, 23, 5, 9)
  first = run_dirs.new_run_dir('taco', 'tweets', str(tmp_path), now)
  assert first == str(tmp_path / 'taco-tweets-20261130-230509')
  os.makedirs(first)
  second = run_dirs.new_run_dir('taco', 'tweets', str(tmp_path), now)
  assert second == first + '-2'
  assert not os.path.exists(second), 'naming creates nothing'


def test_tokens_per_second_leaves_each_processs_first_step_out():
  times = report.StepTimes()
  times.record(tokens=100, seconds=9.0)  # compiles or warms up: left out
  assert times.tokens_per_second == 0.0 and times.train_seconds == 9.0
  times.record(tokens=300, seconds=1.0)
  times.record(tokens=100, seconds=1.0)
  assert times.tokens_per_second == 200.0 and times.train_seconds == 11.0
  # A resumed run counts on from the checkpoint's totals, its own first step
  # left out again.
  resumed = report.StepTimes(json.loads(json.dumps(times.totals())))
  resumed.record(tokens=1000, seconds=1.0)
  resumed.record(tokens=200, seconds=2.0)
  assert resumed.tokens_per_second == 600 / 4
  assert resumed.train_seconds == 14.0
