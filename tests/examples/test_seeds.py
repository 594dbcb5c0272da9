"""compare's view over seeds: groups, means, standard errors, A/B rows."""

import dataclasses
import math

import pytest

from examples.finetune import compare
from examples.finetune import results as results_lib
from examples.finetune import seeds


def _run(optimizer, seed, accuracy, lr=1e-3, steps=40, **config):
  config = dict(optimizer=optimizer, seed=seed, lr=None, steps=steps,
                task='text', output_dir=f'runs/{optimizer}-{seed}', **config)
  return (f'runs/{optimizer}-{seed}', results_lib.RunResults(
      optimizer=optimizer, learning_rate=lr, learning_rate_source='--lr',
      warmup_steps=0, model='m', family='llama', task='text',
      metric='accuracy', before={'accuracy': 0.5},
      after={'accuracy': accuracy}, evals=[], losses=[1.0] * steps,
      optimizer_state_bytes=0, parameter_bytes=0, config=config))


def test_summary_is_the_mean_and_its_standard_error():
  s = seeds.summary([0.87, 0.875, 0.86])
  assert s.count == 3
  assert s.mean == pytest.approx(0.868333, abs=1e-6)
  # sample standard deviation 0.0076376 over sqrt(3)
  assert s.error == pytest.approx(0.0076376 / math.sqrt(3), rel=1e-4)
  assert seeds.summary([0.5]).error is None


def test_groups_are_settings_but_the_seed():
  runs = [_run('taco', 0, 0.87), _run('adamw', 0, 0.90, lr=2e-5),
          _run('taco', 1, 0.875), _run('adamw', 1, 0.915, lr=2e-5),
          _run('taco', 2, 0.86, steps=160)]
  grouped = seeds.groups(runs)
  assert [[d for d, _ in g] for g in grouped] == [
      ['runs/taco-0', 'runs/taco-1'], ['runs/adamw-0', 'runs/adamw-1'],
      ['runs/taco-2']]


def test_table_has_the_means_and_the_difference():
  runs = [_run(o, s, a, lr=lr) for o, lr, accs in (
      ('taco', 1e-3, (0.87, 0.875, 0.86)),
      ('adamw', 2e-5, (0.90, 0.915, 0.905))) for s, a in enumerate(accs)]
  lines = seeds.table(runs).splitlines()
  assert lines[1].split()[:5] == ['taco', '0.001', '40', 'text', '0,1,2']
  assert lines[1].split()[-3:] == ['86.8', '±', '0.4']
  assert lines[2].split()[-3:] == ['90.7', '±', '0.4']
  # 86.83 - 90.67 = -3.83; error sqrt(0.441^2 + 0.441^2) = 0.62
  assert lines[3].split()[:3] == ['taco', '−', 'adamw']
  assert lines[3].split()[-3:] == ['-3.8', '±', '0.6']


def test_no_table_without_repeated_settings():
  assert seeds.table([_run('taco', 0, 0.8), _run('adamw', 0, 0.8)]) is None


def test_other_settings_get_no_difference_row():
  runs = [_run('taco', s, 0.8 + s / 100, steps=40) for s in range(2)]
  runs += [_run('adamw', s, 0.8, steps=160) for s in range(2)]
  assert len(seeds.table(runs).splitlines()) == 3  # header and two groups


def test_compare_prints_the_view_over_seeds(tmp_path, capsys, monkeypatch):
  import json  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(sys.modules, 'matplotlib', None)
  directories = []
  for directory, results in [_run('taco', s, 0.8 + s / 100) for s in
                             range(2)]:
    results = dataclasses.replace(
        results, optimizer_state_bytes=1, peak_memory_bytes=1,
        tokens_per_second=1.0, wall_seconds=1.0, parameter_bytes=1)
    path = tmp_path / directory
    path.mkdir(parents=True)
    (path / 'results.json').write_text(json.dumps(results.to_json()))
    directories.append(str(path))
  assert compare.main(directories) == 0
  out = capsys.readouterr().out
  assert '\nover seeds\n' in out and '80.5 ± 0.5' in out


def test_the_loss_curve_is_smoothed_by_a_running_mean():
  assert compare.running_mean([4.0, 2.0, 0.0, 6.0, 1.0], 3) == [
      4.0, 3.0, 2.0, 8 / 3, 7 / 3]
  assert compare.running_mean([1.0, 5.0], 1) == [1.0, 5.0]
  assert compare.running_mean([], 4) == []


def test_the_curves_name_the_set_the_runs_scored():
  held_out = _run('taco', 0, 0.8)
  validation = (held_out[0] + '-v', dataclasses.replace(
      held_out[1], eval_split='validation'))
  assert compare.metric_title([held_out]) == 'held-out accuracy'
  assert compare.metric_title([validation]) == 'validation accuracy'
  assert compare.metric_title([held_out, validation]) == (
      'held-out / validation accuracy')
