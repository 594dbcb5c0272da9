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
* head phase: the float32 logits ``B * S * V * 4``, ``S`` the positions
  the loss scores per sequence (every one, ``T``, unless told: one for the
  candidate objective; their exp and their gradient are written in their
  place: ``losses.completion_nll``), plus, in the layer-wise step, the
  transients of the token table's (or untied head's) column blocks, four
  float32 arrays of ``2**20`` elements (the block size of ``taco_optax``'s
  chunked update);
* one layer's backward: its gradients ``P_layer * b`` plus its recomputed
  activations ``B * T * (4 d + 3 ffn) * b + 2 * B * heads * T^2 * 4``, plus,
  with scanned layers, a copy of that layer's weights ``P_layer * b`` (XLA
  materialises the ``dynamic_slice`` of the stacked weights that feeds the
  matmuls; seen in the CPU buffer assignment, in the forward pass too);
* the layerwise step forms the token table's and an untied LM head's
  gradients a block of columns at a time (never dense), keeps the dense
  gradient of a learned position table until the end, and nothing of the
  head's logits past the head; the plain step keeps every gradient;
* the layer-wise step on ``A`` micro-batches of ``B`` sequences
  (``taco_optax``'s accumulation, layer-major) keeps every micro-batch's
  layer inputs, ``A`` times the term above; in both phases the outer leaves'
  mean gradients: a token table's as ``taco_optax.layerwise.table_mean_bytes``
  says the step does, the smaller of its float32 accumulator ``V * d * 4``
  and ``A`` micro-batches' factors (the head's features and logits'
  cotangent, ``B * S * (d * b + V * 4)``; the lookup's ids and rows'
  cotangent, ``B * T * (4 + d * b)``; both, for a tied table), every other
  outer leaf's a float32 accumulator; and two hidden states of the whole
  batch ``2 * A * B * T * d * b`` (a layer's stacked output and input
  cotangents; at the head, the last hidden states and their cotangents);
  in a layer's phase that layer's float32 accumulator ``P_layer * 4``, one
  micro-batch's activations and gradients otherwise.

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
    outer_means: with accumulation, the outer leaves' mean gradients (a
      token table's as its float32 accumulator or its micro-batches'
      factors, whichever is smaller), in both phases; else 0.
    stacked_cotangents: with accumulation, two hidden states of the whole
      batch (a layer's stacked output and input cotangents), in both
      phases; else 0.
    layer_accumulator: with accumulation, one layer's float32 mean
      gradient, in its phase; else 0.
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
  outer_means: int = 0
  stacked_cotangents: int = 0
  layer_accumulator: int = 0

  def layerwise_peak(self, state_bytes: int) -> int:
    return layerwise_peak(self, state_bytes)

  def plain_peak(self, state_bytes: int) -> int:
    return plain_peak(self, state_bytes)


def terms(config: config_lib.ModelConfig, params, *, batch: int, seq: int,
          itemsize: int, scan_layers: bool, remat: bool = True,
          scored_positions: Optional[int] = None) -> Terms:
  """The formula's terms for ``params = (outer, layers)``; the loss scores
  ``scored_positions`` positions per sequence (``None``: all ``seq``)."""
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
      head_phase=batch * (seq if scored_positions is None
                          else scored_positions) * config.vocab_size * 4,
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
  return (t.weights + state_bytes + t.layer_inputs + t.outer_means
          + t.stacked_cotangents
          + max(t.head_phase + t.table_blocks,
                t.layer_phase + t.layer_accumulator + t.embed_matrix_grads))


def accumulated_terms(config: config_lib.ModelConfig, params,
                      plan_terms: Terms, *, batch: int, seq: int,
                      itemsize: int, accumulation_steps: int,
                      scored_positions: Optional[int] = None) -> Terms:
  """``plan_terms`` (of one micro-batch of ``batch`` sequences) for the
  layer-wise step on ``accumulation_steps`` micro-batches."""
  outer, layers = params
  steps = accumulation_steps
  d, vocab = config.hidden_size, config.vocab_size
  rows = batch * (seq if scored_positions is None else scored_positions)
  head_factors = rows * (d * itemsize + vocab * 4)
  lookup_factors = batch * seq * (4 + d * itemsize)
  size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  table = size(outer['embed'])
  if config.tie_word_embeddings:
    tables = taco_optax.layerwise.table_mean_bytes(
        table, head_factors + lookup_factors, steps)
  else:
    tables = (taco_optax.layerwise.table_mean_bytes(
        size(outer['lm_head']), head_factors, steps)
              + taco_optax.layerwise.table_mean_bytes(
                  table, lookup_factors, steps))
  others = {k: v for k, v in outer.items() if k not in ('embed', 'lm_head')}
  return plan_terms._replace(
      layer_inputs=plan_terms.layer_inputs * steps,
      # The position table's mean is an accumulator (in outer_means).
      embed_matrix_grads=0,
      outer_means=tables + 4 * size(others),
      stacked_cotangents=2 * steps * batch * seq * d * itemsize,
      layer_accumulator=4 * size(layers) // config.num_layers)


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
               layerwise: bool, accumulation_steps: int = 1,
               scored_positions: Optional[int] = None) -> int:
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
      layer-wise step keeps every micro-batch's layer inputs, the outer
      leaves' means (a token table's as the smaller of its float32
      accumulator and its micro-batches' factors, as the step chooses),
      the stacked cotangents and one layer's float32 accumulator
      (:func:`accumulated_terms`).
    scored_positions: positions per sequence the loss projects onto the
      vocabulary (1 for the candidate objective); ``None``: every one.

  Returns:
    Predicted peak bytes.
  """
  itemsize = jnp.dtype(model.dtype).itemsize
  plan_terms = terms(model.config, params, batch=batch, seq=seq,
                     itemsize=itemsize, scan_layers=model.scan_layers,
                     remat=model.remat is not None,
                     scored_positions=scored_positions)
  if not layerwise:
    return plain_peak(plan_terms, state_bytes)
  if accumulation_steps > 1:
    plan_terms = accumulated_terms(
        model.config, params, plan_terms, batch=batch, seq=seq,
        itemsize=itemsize, accumulation_steps=accumulation_steps,
        scored_positions=scored_positions)
  return layerwise_peak(plan_terms, state_bytes)

