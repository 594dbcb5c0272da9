"""The landed-updates benchmark on a tiny Llama: its effect is real."""

import jax.numpy as jnp
import pytest

from benchmarks import landed_updates

_TINY = {'hidden_size': 256, 'intermediate_size': 768, 'vocab_size': 1000,
         'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 64}


def _result(dtype, name, rate):
  params = landed_updates.llama_tree(_TINY, 2, jnp.dtype(dtype))
  return landed_updates.measure(
      params, lambda r: landed_updates.optimizer(name, rate, r), steps=3)


def test_bf16_taco_at_the_papers_rate_lands_only_stochastically():
  result = _result('bfloat16', 'taco', landed_updates.PAPER_RATE)
  # The down projection's step (lr * m/n = 3e-5 / 3) is far below half an
  # ulp of a 0.02 weight: rounding to nearest moves almost nothing.
  landed, moved, non_finite = result['nearest']['down']
  assert moved < 0.3 and non_finite == 0
  # Unbiased: the movement is the intended one, up to the noise of a few
  # hundred coin flips per kind.
  for kind in ('q', 'o', 'gate', 'embedding'):
    landed, moved, non_finite = result['stochastic'][kind]
    assert 0.85 < moved < 1.15, (kind, moved)
    assert non_finite == 0
  assert result['stochastic']['down'][0] > result['nearest']['down'][0]


def test_float32_weights_land_every_update():
  result = _result('float32', 'adamw', 3.2e-5)
  for rounding in ('nearest', 'stochastic'):
    for kind, (landed, moved, non_finite) in result[rounding].items():
      # Only updates below float32's ulp (Adam's when its first moment
      # crosses zero) can be lost.
      assert landed > 0.99 and abs(moved - 1) < 1e-3, (rounding, kind)


@pytest.mark.long
def test_rows_table_and_summary_line():
  rows = landed_updates.run(_TINY, 1, 1, dtypes=('bfloat16',))
  assert len(rows) == 8  # 2 optimizers x 2 rates x 2 roundings
  lines = landed_updates.table(rows)
  assert len(lines) == 2 + len(rows)
  assert landed_updates.summary(rows).startswith('taco_stochastic_landed=')
