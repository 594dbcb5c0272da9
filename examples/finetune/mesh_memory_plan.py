"""Predicted peak training memory of a ``DecoderLM`` on a device mesh: one
device's share.

:mod:`memory_plan`'s formula with every term on one device: its shards of
the weights (the example's shardings, ``model/sharding.py``), the blocks it
gathers, its split of the batch and of the vocabulary. Checked against the
compiled per-device figure on reduced-layer models (``python -m
benchmarks.planner --validate-mesh``).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from examples.finetune import memory_plan
from examples.finetune.model import config as config_lib


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
  state's shardings too (``api.MemoryPlan.state_bytes``)."""
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
          + memory_plan.tree_bytes(outer.get('positions', {})))


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
  layer_bytes = memory_plan.tree_bytes(params[1]) // config.num_layers
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
      table_blocks=4 * memory_plan.COLUMN_BLOCK_ELEMENTS * 4,
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
