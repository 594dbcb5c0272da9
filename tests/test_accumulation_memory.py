"""Compiled memory of accumulation: it grows with the micro-batch, not with A.

``benchmarks/accumulation.py`` compiles the example's layer-wise step with
``accumulation_steps`` on SmolLM2-135M's shapes cut to 4 layers (scanned,
float32, micro-batches of 4 x 64) and reads ``memory_analysis()``, which is
deterministic for a jax version. Measured with jax 0.10.2 on CPU: weights
169890048 bytes; peaks 245864304 (A = 1: the one-batch step), 358618024
(A = 4), 401113000 (A = 16); MultiSteps(taco) 582639136 (any A). Before the
embedding's table share was folded in a block of columns at a time: 401049896
and 408155432 (a dense share of the 49152 x 576 table per micro-batch); before
the head's was: 463588136 and 506083112.

Unrolled layers (the CLI's default), micro-batches of 2 x 64, A = 4: 279333584
bytes at 2 layers, 310511664 at 4 (one batch of 8: 284463608 and 321133208);
each layer adds its weights (14155776 bytes) and 1.2 of the whole batch's
hidden states (its saved input). Before each layer's float32 accumulator was
made from its own cotangents, XLA formed all of them at the start of the
step: 11 MB more per layer (433 MB more than one batch of 8 at the CLI's 30
layers); before its stacked input cotangents were too, one hidden state more
per layer: 280330768 and 314148912. Before the token table's mean was kept as
the micro-batches' factors when they are smaller than its float32
accumulator (here 100 MB against 113 MB): 296513232 and 330382192.

The CLI's default shape (unrolled layers, the tweets task: one scored
position per sequence), ``--batch-size 8`` against ``--grad-accum 4``, cut to
2 layers: one batch 236069272 bytes, accumulated 178570224 (179749872 before
the stacked input cotangents were made from each layer's; 291358256 before
the factors, the table's accumulator alive from the head to the end; at the
CLI's 30 layers 709.2 MiB against 730.1, then 623.6, now 591.0 MiB).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from benchmarks import accumulation

# Compiles five accumulated steps (35 s of the fast tier's 12 min): CI's long
# tier guards them; tests/test_train_step.py keeps a peak guard in the fast one.
pytestmark = pytest.mark.long

MICRO, SEQ, LAYERS, WIDTH = 4, 64, 4, 576
MEASURED_A4 = 358618024
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


@functools.lru_cache(maxsize=None)
def _unrolled(num_layers):
  """``(weight bytes, peak)`` of the unrolled step at A = 4 of 2 x 64."""
  weights, _, rows = accumulation.measure(
      dtype=jnp.dtype(jnp.float32), micro_batch=2, seq=SEQ,
      num_layers=num_layers, scan_layers=False, steps=(4,),
      paths=('taco layerwise',))
  (_, _, peak, _), = rows
  return weights, peak


def test_unrolled_layers_each_cost_their_weights_and_hidden_states():
  # Per layer: its float32 weights and a few of the whole batch's (4 x 2
  # sequences) hidden states (measured 1.2: its saved input), never a
  # gradient-sized accumulator more (11 MB more when every layer's was formed
  # up front) nor its stacked input cotangents from the step's start (2.3).
  (weights_2, peak_2), (weights_4, peak_4) = _unrolled(2), _unrolled(4)
  layer_weights = (weights_4 - weights_2) / 2
  growth = (peak_4 - peak_2) / 2
  hidden = 4 * 2 * SEQ * WIDTH * 4
  assert growth <= layer_weights + 2 * hidden, (growth, layer_weights, hidden)


CLI_LAYERS = 2
MEASURED_CLI_A4 = 178570224


@functools.lru_cache(maxsize=None)
def _cli_shaped():
  """``(weight bytes, one batch of 8, 4 micro-batches of 2)`` peaks."""
  weights, _ = _unrolled(CLI_LAYERS)
  whole, split = accumulation.same_batch(
      dtype=jnp.dtype(jnp.float32), batch=8, steps=4, seq=SEQ,
      num_layers=CLI_LAYERS)
  return weights, whole, split


def test_cli_accumulation_never_above_the_whole_batch():
  # --grad-accum 4 must never cost more than --batch-size 8 in one step: the
  # same sequences, a quarter of them at a time.
  _, whole, split = _cli_shaped()
  assert split <= whole, (split, whole)


def test_cli_accumulation_under_measured_bound():
  weights, _, split = _cli_shaped()
  assert split <= MEASURED_CLI_A4 + MARGIN * weights, (
      f'{split} bytes with jax {jax.__version__}')
