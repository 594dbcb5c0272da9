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

On a device mesh (:func:`mesh_terms`) every term is one device's: its shards
of the weights (the example's shardings, ``model/sharding.py``), the blocks
it gathers, its split of the batch and of the vocabulary; checked against the
compiled per-device figure on reduced-layer models (``python -m
benchmarks.planner --validate-mesh``).

This is the one planner: the CLI refuses a run that will not fit with
:func:`model_peak`; :func:`plan_memory` / :func:`plan_memory_on_mesh` give a
:class:`MemoryPlan` of a model config, and :func:`plan` / :func:`plan_on_mesh`
its predicted peak per method (TACO layer-wise and plain, AdamW), which
``benchmarks/planner.py`` prints.
"""

import contextlib
import math
from typing import Any, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from examples.finetune import optimizers as optimizers_lib
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import layered as layered_lib
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


# On a device mesh: one device's share.


def abstract_mesh(mesh_shape: dict[str, int]) -> jax.sharding.AbstractMesh:
  """The example's ``data x fsdp x tensor`` mesh of ``mesh_shape``, without
  devices (for shapes and shardings only)."""
  from examples.finetune.model import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  axes = sharding_lib.AXES
  return jax.sharding.AbstractMesh(
      tuple(mesh_shape.get(a, 1) for a in axes), axes,
      axis_types=(jax.sharding.AxisType.Explicit,) * len(axes))


def with_shardings(params, mesh):
  """Abstract ``(outer, layers)`` parameters (``ShapeDtypeStruct``) with the
  example's shardings (``model/sharding.py``) on ``mesh``, a device mesh or
  an :func:`abstract_mesh`. ``jax.eval_shape`` of an optimizer's ``init`` on
  them, under ``jax.sharding.use_abstract_mesh`` of that mesh, gives its
  state's shardings too (:meth:`MemoryPlan.state_bytes`)."""
  from examples.finetune.model import decoder as decoder_lib  # pylint: disable=g-import-not-at-top
  from examples.finetune.model import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  outer, layers = params

  def place(prefix):
    return lambda path, x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
            mesh, sharding_lib.param_spec(
                prefix + decoder_lib.path_names(path), x.shape, mesh_shape)))

  return (jax.tree_util.tree_map_with_path(place(()), outer),
          jax.tree_util.tree_map_with_path(place(('layers',)), layers))


def device_bytes(tree) -> int:
  """One device's bytes of a tree of (possibly sharded) abstract arrays; a
  leaf without a sharding counts whole."""
  def nbytes(x):
    sharding = getattr(x, 'sharding', None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return sum(nbytes(x) for x in jax.tree.leaves(tree)
             if hasattr(x, 'shape') and hasattr(x, 'dtype'))


class MeshTerms(NamedTuple):
  """One device's terms of the formula on a ``data x fsdp x tensor`` mesh.

  Attributes:
    weights: this device's shards of every parameter (exact).
    layer_inputs: each layer's input for this device's batch rows.
    gathered_block: one layer's weights gathered over ``fsdp`` (still split
      over ``tensor``; 0 without ``fsdp``), from the shapes: FSDP gathers a
      block for its use, and both steps keep at most two (one in use, one
      prefetched): the layer-wise step, and the plain step through
      ``taco_optax.layerwise.remat_layers``.
    layer_gradient: one layer's gradient as the backward forms it, whole
      over ``fsdp`` (split over ``tensor``), before it is reduced to this
      device's shard.
    layer_activations: one layer's recomputed activations for this device's
      rows (the MLP's and the heads' widths split over ``tensor``).
    head_phase: twice the float32 logits of this device's rows (those of
      its ``data`` group; ``fsdp`` and ``tensor`` split the vocabulary): the
      vocabulary-split cross-entropy keeps their exp and the selected
      logits (seen in XLA's heap simulation at the peak).
    table_blocks: the column steps' transients.
    position_grads: this device's shard of a learned position table's
      gradient (the layer-wise step keeps it through the layers).
    table_copy: a copy of this device's shard of the largest vocabulary
      matrix (the token table or an untied head) that XLA keeps through the
      layer-wise step's layers on a mesh that splits the vocabulary (seen on
      reduced-layer OPT-13B, Qwen3-32B and Llama-3-70B at fsdp = 2, 4, 8:
      ``python -m benchmarks.planner --validate-mesh``); 0 on one device.
    plain_gradients: the gradients the plain step keeps through its
      backward pass. Where the layers' weights are split over the mesh
      (``fsdp`` or ``tensor``), its blocks run through
      ``taco_optax.layerwise.remat_layers``: each layer's gradient is
      reduced before the next layer's backward starts, and its update
      consumes it there, so what stays is this device's shard of the token
      table's gradient twice (the lookup's and the projection's, an untied
      head's, summed at the end) and a learned position table's gradient
      whole (its lookup gathers the table whole). Otherwise every gradient's
      shard, ``weights``.
  """
  weights: int
  layer_inputs: int
  gathered_block: int
  layer_gradient: int
  layer_activations: int
  head_phase: int
  table_blocks: int
  position_grads: int
  table_copy: int
  plain_gradients: int

  def layerwise_peak(self, state_bytes: int) -> int:
    return mesh_layerwise_peak(self, state_bytes)

  def plain_peak(self, state_bytes: int) -> int:
    return mesh_plain_peak(self, state_bytes)


def _plain_gradients(params, layers_split: bool) -> int:
  """:attr:`MeshTerms.plain_gradients` of ``params`` on one device."""
  outer = params[0]
  if not layers_split:
    return device_bytes(params)
  table = device_bytes(outer['embed'])
  projection = device_bytes(outer['lm_head']) if 'lm_head' in outer else table
  return (table + projection
          + tree_bytes(outer.get('positions', {})))


def mesh_terms(config: config_lib.ModelConfig, params, *,
               mesh_shape: dict[str, int], batch: int, seq: int,
               itemsize: int) -> MeshTerms:
  """:class:`MeshTerms` for ``params`` from :func:`with_shardings`."""
  data = mesh_shape.get('data', 1)
  fsdp = mesh_shape.get('fsdp', 1)
  tensor = mesh_shape.get('tensor', 1)
  rows = batch // (data * fsdp) if batch % (data * fsdp) == 0 else batch
  head_rows = batch // data if batch % data == 0 else batch
  d, ffn = config.hidden_size, config.intermediate_size
  layer_bytes = tree_bytes(params[1]) // config.num_layers
  return MeshTerms(
      weights=device_bytes(params),
      layer_inputs=config.num_layers * rows * seq * d * itemsize,
      gathered_block=layer_bytes // tensor if fsdp > 1 else 0,
      layer_gradient=layer_bytes // tensor,
      layer_activations=(rows * seq * (4 * d + 3 * ffn // tensor) * itemsize
                         + 2 * rows * max(config.num_heads // tensor, 1)
                         * seq * seq * 4),
      head_phase=2 * head_rows * seq * config.vocab_size // (fsdp * tensor)
      * 4,
      table_blocks=4 * COLUMN_BLOCK_ELEMENTS * 4,
      position_grads=device_bytes(params[0].get('positions', {})),
      table_copy=0 if fsdp * tensor == 1 else max(
          device_bytes(params[0]['embed']),
          device_bytes(params[0].get('lm_head', {}))),
      plain_gradients=_plain_gradients(params, fsdp * tensor > 1))


def mesh_layerwise_peak(t: MeshTerms, state_bytes: int) -> int:
  """One device's peak of the layer-wise step (``state_bytes``: its shards
  of the optimizer state)."""
  return (t.weights + state_bytes + t.layer_inputs
          + max(t.head_phase + t.table_blocks,
                2 * t.gathered_block + t.layer_gradient
                + t.layer_activations + t.position_grads + t.table_copy))


def mesh_plain_peak(t: MeshTerms, state_bytes: int) -> int:
  """One device's peak of ``value_and_grad -> tx.update`` with remat.

  Besides the weights, the state, the saved layer inputs and the gradients
  the step keeps (``plain_gradients``), the larger of the head's logits'
  buffers and a block's backward pass: two blocks' weights gathered (the
  one in use and the next one, prefetched: ``remat_layers`` orders every
  block's gathers so, in both passes; never every block's at once, which
  is what XLA does with ``jax.checkpoint`` alone), that block's whole
  gradient before its reduction, and its activations. XLA:CPU's heap
  simulation of reduced SmolLM2, OPT-13B, Qwen3-32B and Llama-3-70B at
  fsdp = 2, 4, 8 holds about 2.1 of those three whole blocks at once (the
  gradient of a block's largest matrices takes the place of gathered ones)
  and its buffer assignment adds about one block of fragmentation to the
  compiled peak, which this is checked against (``python -m
  benchmarks.planner --validate-mesh``, 2 and 4 layers).
  """
  return (t.weights + state_bytes + t.layer_inputs + t.plain_gradients
          + max(t.head_phase, 2 * t.gathered_block + t.layer_gradient
                + t.layer_activations))


# The plan of a model config, per method.


class MemoryPlan(NamedTuple):
  """The example's memory formula (this module's) for one model, batch and
  sequence length.

  Attributes:
    terms: the formula's terms in bytes (``weights``, ``saved_inputs``,
      ``head_phase``, ``layer_phase``, ``embed_matrix_grads``, ...), or on a
      mesh one device's (a ``MeshTerms``).
    params: the abstract ``(outer, layers)`` parameters it was computed
      from (on a mesh, with their shardings on an abstract mesh).
  """
  terms: Terms
  params: Any

  def state_bytes(self, tx: optax.GradientTransformation) -> int:
    """Bytes of ``tx``'s state for :attr:`params`: one device's shards on
    a mesh. The state is traced under the parameters' abstract mesh: outside
    it jax >= 0.11 drops an abstract mesh's shardings from ``eval_shape``'s
    outputs, and every moment would count whole."""
    shardings = [getattr(x, 'sharding', None)
                 for x in jax.tree.leaves(self.params)]
    meshes = {s.mesh for s in shardings if s is not None}
    context = (jax.sharding.use_abstract_mesh(*meshes) if meshes
               else contextlib.nullcontext())
    with context:
      return device_bytes(jax.eval_shape(tx.init, self.params))

  def layerwise_peak(self, state_bytes: int) -> int:
    """Predicted peak bytes of the layer-wise TACO step."""
    return self.terms.layerwise_peak(state_bytes)

  def plain_peak(self, state_bytes: int) -> int:
    """Predicted peak bytes of the plain ``value_and_grad -> update`` step.
    """
    return self.terms.plain_peak(state_bytes)


def abstract_decoder(config: config_lib.ModelConfig, *, dtype: Any,
                     scan_layers: bool = False) -> decoder_lib.DecoderLM:
  """A ``config`` model with ``dtype`` parameters, shapes only (remat on)."""
  return nnx.eval_shape(lambda: decoder_lib.DecoderLM(
      config, dtype=dtype, param_dtype=dtype, remat='block',
      scan_layers=scan_layers, rngs=nnx.Rngs(0)))


def plan_memory(config: config_lib.ModelConfig, *, dtype: Any, batch: int,
                seq: int, scan_layers: bool = True,
                remat: bool = True) -> MemoryPlan:
  """The :class:`MemoryPlan` of a ``config`` model with ``dtype`` parameters
  trained on ``batch`` x ``seq`` tokens; shapes only, nothing is allocated.
  """
  # The bytes do not depend on the layout: the parameters are read stacked.
  params = model_params(abstract_decoder(config, dtype=dtype,
                                         scan_layers=True))
  return MemoryPlan(terms(config, params, batch=batch, seq=seq,
                          itemsize=jnp.dtype(dtype).itemsize,
                          scan_layers=scan_layers, remat=remat), params)


def plan_memory_on_mesh(config: config_lib.ModelConfig,
                        mesh_shape: dict[str, int], *, dtype: Any,
                        batch: int, seq: int) -> MemoryPlan:
  """The :class:`MemoryPlan` (one device's :class:`MeshTerms`, its
  parameters with their shardings on an :func:`abstract_mesh`) of a
  ``config`` model on a ``data x fsdp x tensor`` mesh of ``mesh_shape``
  (the CLI's unrolled layers, remat); shapes only, no devices needed."""
  params = with_shardings(
      layered_lib.layered_model(abstract_decoder(config, dtype=dtype)).params,
      abstract_mesh(mesh_shape))
  return MemoryPlan(mesh_terms(
      config, params, mesh_shape=mesh_shape, batch=batch, seq=seq,
      itemsize=jnp.dtype(dtype).itemsize), params)


def plan(hf_config, *, batch, seq, dtype=jnp.bfloat16, scan_layers=True,
         remat=True):
  """Predicted peak bytes of TACO and AdamW for a Hugging Face config.

  Args:
    hf_config: a ``config.json`` as a dict.
    batch: sequences per step.
    seq: tokens per sequence.
    dtype: parameter (and compute) dtype.
    scan_layers: stacked layers (``lax.scan``) or unrolled ones.
    remat: recompute each block in the backward pass of the plain step.

  Returns:
    A dict of the model ``config``, the bytes of ``weights``, ``taco_state``,
    ``adamw_state``, ``saved_inputs``, ``head_phase``, ``layer_phase``,
    ``position_grads``, and ``peaks``: predicted peak bytes per method.
  """
  config = config_lib.ModelConfig.from_hf_config(hf_config)
  formula = plan_memory(config, dtype=dtype, batch=batch, seq=seq,
                            scan_layers=scan_layers, remat=remat)
  plan_terms, params = formula.terms, formula.params
  taco = optimizers_lib.get('taco').build(
      3e-5, optimizers_lib.decoder_hints(config))
  taco_state = tree_bytes(jax.eval_shape(taco.init, params))
  adamw_state = tree_bytes(
      jax.eval_shape(optax.adamw(1e-5).init, params))
  adamw_state_f32 = 8 * plan_terms.weights // jnp.dtype(dtype).itemsize
  return {
      'config': config, 'weights': plan_terms.weights,
      'taco_state': taco_state, 'adamw_state': adamw_state,
      'saved_inputs': plan_terms.saved_inputs,
      'head_phase': plan_terms.head_phase,
      'layer_phase': plan_terms.layer_phase,
      'position_grads': plan_terms.embed_matrix_grads,
      'peaks': {
          'taco layerwise': formula.layerwise_peak(taco_state),
          'taco plain': formula.plain_peak(taco_state),
          'adamw plain': formula.plain_peak(adamw_state),
          'adamw plain, f32 moments': formula.plain_peak(adamw_state_f32),
      },
  }


def plan_on_mesh(hf_config, mesh_shape, *, batch, seq, dtype=jnp.bfloat16):
  """Predicted per-device peak bytes of TACO and AdamW on a mesh.

  The CLI's layout (unrolled layers, remat) and sharding rule; each device's
  weights and optimizer state are exact (shapes on an abstract mesh: no
  devices needed), the rest is the example's formula
  (:func:`mesh_terms`).

  Returns:
    A dict of ``config``, ``terms`` (one device's ``MeshTerms``),
    ``taco_state``, ``adamw_state`` (one device's bytes) and ``peaks``.
  """
  config = config_lib.ModelConfig.from_hf_config(hf_config)
  formula = plan_memory_on_mesh(config, mesh_shape, dtype=dtype,
                                    batch=batch, seq=seq)
  taco = optimizers_lib.get('taco').build(
      3e-5, optimizers_lib.decoder_hints(config))
  taco_state = formula.state_bytes(taco)
  adamw_state = formula.state_bytes(optax.adamw(1e-5))
  return {
      'config': config, 'terms': formula.terms, 'taco_state': taco_state,
      'adamw_state': adamw_state,
      'peaks': {'taco layerwise': formula.layerwise_peak(taco_state),
                'adamw plain': formula.plain_peak(adamw_state)},
  }
