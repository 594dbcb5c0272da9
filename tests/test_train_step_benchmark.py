"""benchmarks/train_step.py runs and ends with one ratio key per optimizer."""

import re

import pytest

from benchmarks import train_step


# Unrolled, as the CLI runs the layers. --scan-layers only hands the decoder
# scan_layers=True: the example's steps on stacked layers are compiled by
# tests/test_memory_regression.py (all four paths) and trained by
# tests/examples/test_layerwise.py and tests/test_train_step.py.
@pytest.mark.long
def test_last_line_has_one_ratio_per_optimizer(capfd, tmp_path):
  written = tmp_path / 'train_step.md'
  train_step.main(['--layers', '2', '--dtypes', 'float32', '--batches', '1',
                   '--seq', '8', '--warmup', '0', '--steps', '1',
                   '--rounds', '2', '--compiles', '2',
                   '--optimizers',
                   'taco_layerwise,taco_plain_loss,taco_optax,adamw',
                   '--write', str(written)])
  last = capfd.readouterr().out.strip().splitlines()[-1]
  ratios = dict(re.findall(r'(\w+)=([\d.]+)', last))
  assert set(ratios) == {
      'taco_layerwise_over_adamw', 'taco_plain_loss_over_adamw',
      'taco_optax_over_adamw', 'taco_layerwise_compile_over_adamw',
      'taco_plain_loss_compile_over_adamw', 'taco_optax_compile_over_adamw'}
  assert last.startswith('taco_layerwise_over_adamw=')
  assert all(float(v) > 0 for v in ratios.values())
  # The written file carries the command, its provenance and the same table.
  text = written.read_text()
  assert text.startswith('# Whole train steps (written by `python -m '
                         'benchmarks.train_step --layers 2')
  assert 'layers=2 (unrolled, as the CLI)' in text
  assert '\nCommit ' in text and last in text
  assert re.search(r'\ntaco_layerwise +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+\n',
                   text)
  # Where compile time goes: each path's program sizes, positive counts.
  programs = re.findall(
      r'\n(taco_layerwise|taco_plain_loss|taco_optax|adamw) +([\d.]+) '
      r'+([\d,]+) +([\d,]+) +([\d,]+) +([\d.]+)(?=\n)', text)
  assert [p[0] for p in programs] == ['taco_layerwise', 'taco_plain_loss',
                                      'taco_optax', 'adamw']
  for _, _, ops, instructions, computations, _ in programs:
    assert min(int(c.replace(',', '')) for c in
               (ops, instructions, computations)) > 0
  # With --compiles 2 every path is compiled twice (the table's compile s
  # is their median, the mean of two) and each compile is listed.
  compiles = dict(re.findall(r'\n(\w+) +compiles s: ([\d., ]+)(?=\n)',
                             text))
  assert set(compiles) == {p[0] for p in programs}
  table = dict(re.findall(
      r'\n(\w+) +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)(?=\n)', text))
  for path, seconds in compiles.items():
    runs = [float(c) for c in seconds.split(', ')]
    assert len(runs) == 2 and min(runs) > 0
    assert float(table[path]) == pytest.approx(sum(runs) / 2, abs=0.11)
