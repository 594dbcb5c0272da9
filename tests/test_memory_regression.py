"""The compiled memory of the example's layer-wise TACO step stays at its floor.

``benchmarks/memory.py`` compiles the example's train steps on abstract shapes
(nothing is allocated) and reads XLA's ``memory_analysis()``. Here it runs on
SmolLM2-135M's shapes cut to 4 layers (scanned and unrolled): the tied
49152 x 576 embedding, its f32 logits and the head's backward weigh as much
against the weights as in the full model's head, so a change that makes the
head or the layer-wise step hold more (as the example's ``log_softmax`` loss
did: +0.29 x weights here, +0.09 in the 30-layer model) fails, while
compiling takes seconds.

For a given jax version the buffer assignment, and so every byte count, is
deterministic; the bound below is the figure measured now plus a small margin.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from benchmarks import memory
from examples.finetune import report
from tests.support import tiers

NUM_LAYERS, BATCH, SEQ = 4, 4, 64

# (peak_train - peak_forward - optimizer state) / weight bytes of the
# layer-wise TACO step, measured with jax 0.10.2 on CPU, float32 (the same
# bytes in separate processes). Scanned layers: peak 236657584, forward
# 220018356, state 1705548, weights 169890048 bytes: 0.0879 (0.1456 while
# the tied table's phase 2 compared each column's history with every batch
# token, 0.3373 while the logits' cotangent lived through the layers, 0.6996
# while the tied table's gradient was formed dense, 0.9913 before the
# completion loss stopped materialising log_softmax). Unrolled layers (the
# CLI's default): peak 241831320, forward 220018188: 0.1184 (0.1727, 0.3480,
# 0.7308).
MEASURED_LAYERWISE = {True: 0.0879, False: 0.1184}
MARGIN = 0.02
# The same step built from the plain loss (its blocks and token tables read
# from the jaxpr: the tied table's lookup and projection become the
# TableLookup and TableProjection a hand-split loss gives). Measured the same
# way: scanned 0.0874, unrolled 0.1184 (0.6945 / 0.7254 while the table's
# two dense gradients lived through the embedding's backward).
MEASURED_PLAIN_LOSS = {True: 0.0874, False: 0.1184}
MEASURED = {'taco layerwise': MEASURED_LAYERWISE,
            'taco plain-loss': MEASURED_PLAIN_LOSS}


@functools.lru_cache(maxsize=None)
def _measured(scan_layers):
  """``{path: (overhead, overhead above state)}`` in weight units."""
  _, weights, rows = memory.measure(
      memory.SMOLLM2_135M, dtype=jnp.dtype(jnp.float32),
      scan_layers=scan_layers,
      batch=BATCH, seq=SEQ, num_layers=NUM_LAYERS)
  forward_peak = rows[0][1]
  return {path: ((peak - forward_peak) / weights,
                 (peak - forward_peak - state) / weights)
          for path, peak, state, _, _ in rows}


def test_backend_is_cpu():
  # The bound holds for XLA:CPU's buffer assignment (what CI runs).
  assert jax.default_backend() == 'cpu'


@pytest.mark.parametrize('path', ['taco layerwise', 'taco plain-loss'])
@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
def test_layerwise_overhead_under_measured_bound(scan_layers, path):
  _, above_state = _measured(scan_layers)[path]
  bound = MEASURED[path][scan_layers]
  assert above_state <= bound + MARGIN, (
      f'{path} holds {above_state:.4f} x weights above the forward pass and '
      f'its state (measured {bound} with jax 0.10.2; now jax '
      f'{jax.__version__})')


@pytest.mark.parametrize('scan_layers', [True, False])
def test_layerwise_far_below_adamw_and_plain_taco(scan_layers):
  overheads = _measured(scan_layers)
  # AdamW: two moments (2 x weights) and every gradient (1 x weights).
  assert overheads['adamw'][0] > 2.5
  assert overheads['taco layerwise'][0] < overheads['adamw'][0] / 4, overheads
  # The plain optax path keeps every gradient alive until the update; the
  # layer-wise step consumes each layer's as it appears.
  plain, layerwise = overheads['taco'][1], overheads['taco layerwise'][1]
  assert plain > 1.0
  assert layerwise < plain - 0.3, overheads
  assert overheads['taco plain-loss'][1] < plain - 0.3, overheads
  # The step read from the plain loss holds what the hand-split one holds.
  assert overheads['taco plain-loss'][1] <= layerwise + MARGIN, overheads



def test_process_memory_for_the_run_summary():
  # The CLI's results.json and summary carry what `top` saw beside the
  # compiled figure; this process has at least imported jax and compiled.
  figures = report.process_memory()
  assert figures['process_peak_rss_bytes'] > 50 * 2**20
  # XLA:CPU keeps no allocator statistics.
  assert figures['device_peak_bytes_in_use'] is None
