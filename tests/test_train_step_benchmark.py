"""benchmarks/train_step.py runs and ends with one ratio key per optimizer."""

import re

from benchmarks import train_step


def test_last_line_has_one_ratio_per_optimizer(capsys):
  train_step.main(['--layers', '1', '--dtypes', 'float32', '--batches', '1',
                   '--seq', '8', '--warmup', '0', '--steps', '1',
                   '--optimizers', 'taco_layerwise,taco_optax,adamw'])
  last = capsys.readouterr().out.strip().splitlines()[-1]
  ratios = dict(re.findall(r'(\w+)=([\d.]+)', last))
  assert set(ratios) == {
      'taco_layerwise_over_adamw', 'taco_optax_over_adamw',
      'taco_layerwise_compile_over_adamw', 'taco_optax_compile_over_adamw'}
  assert last.startswith('taco_layerwise_over_adamw=')
  assert all(float(v) > 0 for v in ratios.values())
