"""Predicted peak training memory of a ``DecoderLM``, before anything compiles.

Parameter and optimizer-state sizes are exact (shapes of the model's
parameters, and ``jax.eval_shape`` of an optimizer's ``init``); the rest is a
formula whose terms were checked against XLA's compiled memory analysis of
the same step on small models (``python -m benchmarks.planner --validate``).

Formula (bytes; b = parameter dtype size, B batch, T sequence, d width,
L layers, V vocabulary):

* weights ``P * b``; optimizer state exact;
* saved for the backward pass: with remat per layer each layer's input
  ``L * B * T * d * b``; without remat every layer's residuals, ``L`` times
  twice one layer's recomputed activations (below), as measured on the
  scanned model (``--validate`` checks both; with unrolled layers XLA frees
  them earlier, so the formula is conservative there);
* head phase: the float32 logits ``B * T * V * 4`` (their exp and their
  gradient are written in their place: ``losses.completion_nll``), plus, in
  the layer-wise step, the transients of the token table's (or untied
  head's) column blocks, four float32 arrays of ``2**20`` elements (the
  block size of ``taco_optax``'s chunked update);
* one layer's backward: its gradients ``P_layer * b`` plus its recomputed
  activations ``B * T * (4 d + 3 ffn) * b + 2 * B * heads * T^2 * 4``, plus,
  with scanned layers, a copy of that layer's weights ``P_layer * b`` (XLA
  materialises the ``dynamic_slice`` of the stacked weights that feeds the
  matmuls; seen in the CPU buffer assignment, in the forward pass too);
* the layerwise step forms the token table's and an untied LM head's
  gradients a block of columns at a time (never dense), keeps the dense
  gradient of a learned position table until the end, and nothing of the
  head's logits past the head; the plain step keeps every gradient.

The layer-wise step always runs each block's backward from its saved input
(its own per-block recomputation), so only the plain step depends on remat.
"""

import math
from typing import Any, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp

from examples.finetune.model import config as config_lib
import taco_optax

# The layer-wise step's column blocks (float32 elements): the trainer passes
# it to taco_optax.layerwise.train_step, and the plan counts it.
COLUMN_BLOCK_ELEMENTS = 2**20

GB = 1e9


def tree_bytes(tree) -> int:
  """Bytes of the arrays (or ``ShapeDtypeStruct``) leaves of ``tree``.

  The one count of a tree's size here: parameters, optimizer state (live or
  from ``jax.eval_shape``). Leaves without a shape and dtype (a Python
  number in a state) hold no device memory and count 0.
  """
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree)
             if hasattr(x, 'shape') and hasattr(x, 'dtype'))


def model_params(model) -> tuple[Any, Any]:
  """``(outer, layers)`` parameter states of a live or abstract model."""
  state = nnx.state(model, nnx.Param)
  outer = {k: v for k, v in state.items() if k != 'layers'}
  return outer, state['layers']


class Terms(NamedTuple):
  """The formula's terms (bytes) for one model, batch and sequence length.

  Attributes:
    weights: every parameter.
    saved_inputs: what the plain step keeps for the backward pass: each
      layer's input (remat), or every layer's residuals (no remat).
    layer_inputs: each layer's input (what the layer-wise step keeps).
    head_phase: the float32 logits (exp and gradient in their place).
    table_blocks: the layer-wise step's column-block transients at the head.
    layer_activations: one layer's recomputed activations.
    slice_copy: one layer's weights copied out of the stack (scanned layers).
    layer_phase: one layer's backward (gradients, activations, slice copy).
    embed_matrix_grads: dense gradients the layer-wise step keeps through
      the layers: a learned position table (the token table's is formed
      a block of columns at a time).
  """
  weights: int
  saved_inputs: int
  layer_inputs: int
  head_phase: int
  table_blocks: int
  layer_activations: int
  slice_copy: int
  layer_phase: int
  embed_matrix_grads: int


def terms(config: config_lib.ModelConfig, params, *, batch: int, seq: int,
          itemsize: int, scan_layers: bool, remat: bool = True) -> Terms:
  """The formula's terms for ``params = (outer, layers)``."""
  outer, layers = params
  d, ffn = config.hidden_size, config.intermediate_size
  layer_bytes = tree_bytes(layers) // config.num_layers
  layer_activations = (batch * seq * (4 * d + 3 * ffn) * itemsize
                       + 2 * batch * config.num_heads * seq * seq * 4)
  slice_copy = layer_bytes if scan_layers else 0
  layer_inputs = config.num_layers * batch * seq * d * itemsize
  return Terms(
      weights=tree_bytes(params),
      saved_inputs=(layer_inputs if remat
                    else 2 * config.num_layers * layer_activations),
      layer_inputs=layer_inputs,
      head_phase=batch * seq * config.vocab_size * 4,
      # A large matrix is updated a block of columns at a time; the column
      # step holds ~4 float32 arrays of a block.
      table_blocks=4 * COLUMN_BLOCK_ELEMENTS * 4,
      layer_activations=layer_activations,
      slice_copy=slice_copy,
      layer_phase=layer_bytes + layer_activations + slice_copy,
      embed_matrix_grads=tree_bytes(outer.get('positions', {})))


def layerwise_peak(plan_terms: Terms, state_bytes: int) -> int:
  """Peak of ``taco_optax.layerwise.train_step``: one block's gradients."""
  t = plan_terms
  return (t.weights + state_bytes + t.layer_inputs
          + max(t.head_phase + t.table_blocks,
                t.layer_phase + t.embed_matrix_grads))


def plain_peak(plan_terms: Terms, state_bytes: int) -> int:
  """Peak of ``value_and_grad -> tx.update``: every gradient at once."""
  t = plan_terms
  return (t.weights + state_bytes + t.saved_inputs + t.weights
          + max(t.head_phase, t.layer_activations + t.slice_copy))


def device_memory_limit() -> Optional[int]:
  """The default device's memory limit in bytes; ``None`` where the backend
  reports none (CPU)."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # Backends without memory stats raise or return None.
    return None
  limit = (stats or {}).get('bytes_limit')
  return int(limit) if limit else None


def model_peak(model, params, state_bytes: int, *, batch: int, seq: int,
               layerwise: bool, accumulation_steps: int = 1) -> int:
  """Predicted peak bytes of a train step of a live ``DecoderLM``.

  Args:
    model: the model (its config, compute dtype and layer layout are read).
    params: its ``(outer, layers)`` parameters (:func:`model_params`).
    state_bytes: the optimizer state's bytes.
    batch: sequences per step.
    seq: tokens per sequence.
    layerwise: the layer-wise TACO step, else the plain optax step.
    accumulation_steps: micro-batches per step; ``batch`` is then one
      micro-batch's sequences. The plain step runs one micro-batch per call
      (``optax.MultiSteps``: its accumulator is in ``state_bytes``); the
      layer-wise step keeps every micro-batch's layer inputs and a float32
      accumulator of every outer parameter (``taco_optax``'s accumulation
      keeps the token table's mean gradient dense).

  Returns:
    Predicted peak bytes.
  """
  plan_terms = terms(model.config, params, batch=batch, seq=seq,
                     itemsize=jnp.dtype(model.dtype).itemsize,
                     scan_layers=model.scan_layers,
                     remat=model.remat is not None)
  if not layerwise:
    return plain_peak(plan_terms, state_bytes)
  if accumulation_steps > 1:
    outer_elements = sum(x.size for x in jax.tree.leaves(params[0]))
    plan_terms = plan_terms._replace(
        layer_inputs=plan_terms.layer_inputs * accumulation_steps,
        embed_matrix_grads=plan_terms.embed_matrix_grads + 4 * outer_elements,
        table_blocks=plan_terms.table_blocks + 4 * outer_elements)
  return layerwise_peak(plan_terms, state_bytes)
