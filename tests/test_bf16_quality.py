"""The bf16 quality table: its rows and the target's verdict."""

from benchmarks import bf16_quality
from tests.support.run_results import run_results


def _results(before, after, rounding='stochastic', landed=(0.5, 0.25)):
  return run_results(
      metric='accuracy', before={'accuracy': before},
      after={'accuracy': after}, rounding=rounding,
      parameter_bytes=2**20, optimizer_state_bytes=2**19,
      tokens_per_second=95.4,
      landed_updates={
          'matrices': {'landed': 1, 'moved': 2, 'share': landed[0]},
          'vectors': {'landed': 1, 'moved': 4, 'share': landed[1]}})


def test_every_task_runs_both_optimizers_each_rounding_and_float32():
  points = bf16_quality.points()
  assert len(points) == len(set(points)) == 14
  for task in bf16_quality.TASKS:
    assert {(p.optimizer, p.dtype, p.rounding) for p in points
            if p.task == task} == set(bf16_quality.SETTINGS)
  flags = bf16_quality.Point('tweets', 'adamw', 'bfloat16', 'master').flags()
  assert flags[:6] == ['--optimizer', 'adamw', '--dtype', 'bfloat16',
                       '--rounding', 'master']
  assert '--measure-landed' in flags and '--no-checkpoint' in flags


def test_row_and_verdict():
  point = bf16_quality.Point('bbc', 'taco', 'bfloat16', 'stochastic')
  assert bf16_quality._row(point, _results(0.64, 0.865)) == (  # pylint: disable=protected-access
      '| bbc | taco | bfloat16 | stochastic | 64.0 → 86.5 | 50.0% / 25.0% | '
      '1.5 MiB (1.0 MiB + 512.0 KiB) | 95 |')
  wide = bf16_quality.Point('bbc', 'taco', 'float32', 'auto')
  lines = bf16_quality.target_outcome({point: _results(0.64, 0.865),
                                       wide: _results(0.635, 0.875)})
  assert lines == [
      '- tweets: not run yet.',
      '- bbc: float32 87.5, bfloat16 stochastic 86.5: 1.0 points below '
      'float32; target (within 1.5 points) met.']
  missed = bf16_quality.target_outcome({point: _results(0.64, 0.85),
                                        wide: _results(0.635, 0.875)})
  assert missed[1].endswith('2.5 points below float32; target (within 1.5 '
                            'points) missed.')
