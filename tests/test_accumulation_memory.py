"""Compiled memory of accumulation: it grows with the micro-batch, not with A.

``benchmarks/accumulation.py`` compiles the example's layer-wise step with
``accumulation_steps`` on SmolLM2-135M's shapes cut to 4 layers (scanned,
float32, micro-batches of 4 x 64) and reads ``memory_analysis()``, which is
deterministic for a jax version. Measured with jax 0.10.2 on CPU: weights
169890048 bytes; peaks 246454128 (A = 1: the one-batch step), 401049896
(A = 4), 408155432 (A = 16); MultiSteps(taco) 582639136 (any A). Before the
head's table share was accumulated a block of columns at a time: 463588136
and 506083112 (a dense share of the 49152 x 576 table per micro-batch).
"""

import functools

import jax
import jax.numpy as jnp

from benchmarks import accumulation

MICRO, SEQ, LAYERS, WIDTH = 4, 64, 4, 576
MEASURED_A4 = 401049896
MARGIN = 0.02  # of the weights' bytes


@functools.lru_cache(maxsize=None)
def _peaks():
  weights, _, rows = accumulation.measure(
      dtype=jnp.dtype(jnp.float32), micro_batch=MICRO, seq=SEQ,
      num_layers=LAYERS, steps=(4, 16),
      paths=('taco layerwise', 'MultiSteps(taco)'))
  return weights, {(count, path): peak for count, path, peak, _ in rows}


def test_backend_is_cpu():
  assert jax.default_backend() == 'cpu'


def test_peak_at_four_micro_batches_under_measured_bound():
  weights, peaks = _peaks()
  assert peaks[4, 'taco layerwise'] <= MEASURED_A4 + MARGIN * weights, (
      f'{peaks[4, "taco layerwise"]} bytes with jax {jax.__version__}')


def test_twelve_more_micro_batches_cost_only_their_hidden_states():
  _, peaks = _peaks()
  growth = peaks[16, 'taco layerwise'] - peaks[4, 'taco layerwise']
  # Per micro-batch at most its input to each layer and a few more hidden
  # states (the stacked cotangents of the current layer's output), never a
  # gradient (measured: 7105536 bytes for 12 more, 1.0 hidden state each).
  hidden = MICRO * SEQ * WIDTH * 4
  assert growth <= 12 * (LAYERS + 3) * hidden, (growth, hidden)


def test_below_multisteps_taco_at_sixteen():
  _, peaks = _peaks()
  assert peaks[16, 'taco layerwise'] < peaks[16, 'MultiSteps(taco)']
