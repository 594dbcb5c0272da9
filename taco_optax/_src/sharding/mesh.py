"""TACO on a device mesh: where a leaf's pieces live; an exact sharded top-k.

A TACO leaf's state is ``batch + (k, n)`` (values, indices) and ``batch +
(n,)`` (exponents): the output axes are gone, so the state shards like the
parameter's batch and reduction axes and is replicated over the mesh axes that
split the output axes.

When the output axes are split over mesh axes (tensor parallelism) every device
holds a slice of each column's ``m`` candidates, and ``lax.top_k`` over a
sharded axis is either refused (explicit meshes) or wrong (jax issue 19271).
Each device therefore takes the top ``k`` of its own slice, the ``k * shards``
candidates of each column are all-gathered (``O(k n)`` bytes, not ``O(m n)``)
and merged. The merge orders candidates by (magnitude descending, global row
index ascending), the order of ``lax.top_k`` on the whole column, so the result
is bit-identical to the single-device step, ties included.

Sharding is read from the arrays' types, so it applies to meshes whose axes are
:attr:`jax.sharding.AxisType.Explicit` (the default of :func:`jax.make_mesh`).
"""

import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from taco_optax._src.kernels import codec
from taco_optax._src.kernels import reference

MeshAxes = tuple[str, ...]
# A leaf's (batch, reduction, output) axes, non-negative and validated (the
# transformation's dimension numbers, normalised).
LeafAxes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _mesh_axes(entry: Any) -> MeshAxes:
  """The mesh axes of one ``PartitionSpec`` entry, as a tuple."""
  if entry is None or entry == PartitionSpec.UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: MeshAxes) -> Any:
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def padded_spec(spec: PartitionSpec, ndim: int) -> tuple[MeshAxes, ...]:
  """Mesh axes per array axis (``()`` for unsharded), padded to ``ndim``."""
  entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  return tuple(_mesh_axes(entry) for entry in entries)


def explicit_sharding(x: Any) -> Optional[NamedSharding]:
  """``x``'s sharding if it splits ``x`` over explicit mesh axes, else None."""
  try:
    sharding = jax.typeof(x).sharding
  except (TypeError, AttributeError):
    return None
  if not isinstance(sharding, NamedSharding):
    return None
  if not any(padded_spec(sharding.spec, len(x.shape))):
    return None
  return sharding


class LeafSharding(NamedTuple):
  """How a TACO leaf and its state are split over a mesh.

  Attributes:
    param_axes: mesh axes per parameter axis.
    batch_axes: parameter axes that are batch axes, in layout order.
    output_axes: parameter axes that are output axes, in layout order.
    output_sizes: global sizes of ``output_axes``.
    local_output_sizes: their sizes on one device.
    values_spec: spec of the ``batch + (k, n)`` values and indices.
    exponents_spec: spec of the ``batch + (n,)`` exponents.
  """
  param_axes: tuple[MeshAxes, ...]
  batch_axes: tuple[int, ...]
  output_axes: tuple[int, ...]
  output_sizes: tuple[int, ...]
  local_output_sizes: tuple[int, ...]
  values_spec: PartitionSpec
  exponents_spec: PartitionSpec

  @property
  def param_spec(self) -> PartitionSpec:
    return PartitionSpec(*(spec_entry(a) for a in self.param_axes))

  @property
  def leaf_mesh_axes(self) -> MeshAxes:
    """Every mesh axis that splits the parameter."""
    return tuple(a for axes in self.param_axes for a in axes)

  @property
  def output_mesh_axes(self) -> tuple[MeshAxes, ...]:
    return tuple(self.param_axes[ax] for ax in self.output_axes)

  @property
  def gather_axes(self) -> MeshAxes:
    """Mesh axes over which a column's candidates are spread."""
    return tuple(a for axes in self.output_mesh_axes for a in axes)


def leaf_sharding(shape: Sequence[int], spec: PartitionSpec,
                  axes: LeafAxes,
                  mesh_shape: dict[str, int]) -> LeafSharding:
  """The :class:`LeafSharding` of a TACO parameter of ``shape`` and ``spec``.

  Args:
    shape: the parameter's (global) shape.
    spec: its ``PartitionSpec``.
    axes: its ``(batch, reduction, output)`` axes (normalised dimension
      numbers).
    mesh_shape: mesh axis name to size.

  Returns:
    A :class:`LeafSharding`.

  Raises:
    ValueError: if a sharded axis is not divisible by its mesh axes, or a
      reduction axis other than the first one is sharded (the ``n`` columns
      would not be contiguous blocks per device).
  """
  shape = tuple(shape)
  batch, reduction, output = axes
  param_axes = padded_spec(spec, len(shape))
  for ax, mesh_axes in enumerate(param_axes):
    split = math.prod(mesh_shape[a] for a in mesh_axes)
    if shape[ax] % split:
      raise ValueError(
          f'Axis {ax} of a TACO leaf of shape {shape} has size {shape[ax]}, '
          f'not divisible by the {split} shards of mesh axes {mesh_axes} '
          f'(spec {spec}).')
  if any(param_axes[ax] for ax in reduction[1:]):
    raise ValueError(
        f'Only the first reduction axis of a TACO leaf may be sharded; got '
        f'spec {spec} for shape {shape} with reduction axes {reduction}. '
        'Shard the first reduction axis, or reorder reduction_axis.')
  shards_of = lambda ax: math.prod(mesh_shape[a] for a in param_axes[ax])
  batch_entries = tuple(spec_entry(param_axes[ax]) for ax in batch)
  columns_entry = spec_entry(param_axes[reduction[0]])
  return LeafSharding(
      param_axes=param_axes,
      batch_axes=batch,
      output_axes=output,
      output_sizes=tuple(shape[ax] for ax in output),
      local_output_sizes=tuple(shape[ax] // shards_of(ax) for ax in output),
      values_spec=PartitionSpec(*batch_entries, None, columns_entry),
      exponents_spec=PartitionSpec(*batch_entries, columns_entry),
  )


def _mesh_shape(mesh: Any) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes))


def leaf_sharding_of(param: Any, axes: LeafAxes
                     ) -> Optional[tuple[Any, LeafSharding]]:
  """``(mesh, LeafSharding)`` if ``param`` is explicitly sharded, else None."""
  sharding = explicit_sharding(param)
  if sharding is None:
    return None
  return sharding.mesh, leaf_sharding(param.shape, sharding.spec, axes,
                                      _mesh_shape(sharding.mesh))


# Inside shard_map: rows of one device, candidates merged across devices.


def _offsets(shards: LeafSharding) -> list[Any]:
  """Where this device's block starts along each output axis."""
  offsets = []
  for axes, size in zip(shards.output_mesh_axes, shards.local_output_sizes):
    position = jax.lax.axis_index(axes) if axes else 0
    offsets.append(position * size)
  return offsets


def block_start(shards: LeafSharding, axis: int, size: int) -> Any:
  """Where this device's block of size ``size`` starts along param ``axis``."""
  axes = shards.param_axes[axis]
  return jax.lax.axis_index(axes) * size if axes else 0


def global_rows(local_indices: jax.Array, shards: LeafSharding) -> jax.Array:
  """Global row (flat output) indices of this device's local ``indices``."""
  local = jnp.unravel_index(local_indices, shards.local_output_sizes)
  parts = [p + o for p, o in zip(local, _offsets(shards))]
  return jnp.ravel_multi_index(parts, shards.output_sizes,
                               mode='wrap').astype(jnp.int32)


def local_rows(global_indices: jax.Array, shards: LeafSharding
               ) -> tuple[jax.Array, jax.Array]:
  """``(local indices, held here)`` of global row indices."""
  local_sizes = shards.local_output_sizes
  whole = jnp.unravel_index(global_indices.astype(jnp.int32),
                            shards.output_sizes)
  parts = [p - o for p, o in zip(whole, _offsets(shards))]
  held = jnp.ones(global_indices.shape, bool)
  for part, size in zip(parts, local_sizes):
    held &= (part >= 0) & (part < size)
  local = jnp.ravel_multi_index(parts, local_sizes, mode='wrap')
  return local.astype(jnp.int32), held


def add_history(dense: jax.Array, indices: jax.Array, values: jax.Array,
                shards: LeafSharding) -> jax.Array:
  """Sharded :func:`reference.scatter_add_rows` with global ``indices``.

  Entries held by other devices are dropped rather than added as zeros, so
  ``-0.0`` stays ``-0.0`` exactly as on one device.
  """
  if not shards.gather_axes:  # every device holds whole rows
    return reference.scatter_add_rows(dense, indices, values)
  local, held = local_rows(indices, shards)
  m_local = dense.shape[-1]
  local = jnp.where(held, local, m_local)  # out of bounds: dropped
  rows = jnp.arange(dense.shape[0], dtype=jnp.int32)[:, None]
  return dense.at[rows, local].add(values.astype(dense.dtype), mode='drop')


def merged_column_topk(candidates: jax.Array, k: int, shards: LeafSharding
                       ) -> tuple[jax.Array, jax.Array]:
  """Exact :func:`reference.column_topk` of rows split across devices.

  Args:
    candidates: ``(N, m_local)`` this device's slice of every row.
    k: entries to keep per row, ``k <= m`` (the global row length).
    shards: the leaf's :class:`LeafSharding`.

  Returns:
    ``(values, indices)``, each ``(N, k)``, identical on every device and to
    the single-device result; ``indices`` are global.
  """
  if not shards.gather_axes:  # every device holds whole rows
    return reference.column_topk(candidates, k)
  local_values, local_indices = reference.column_topk(
      candidates, min(k, candidates.shape[-1]))
  gather = lambda x: jax.lax.all_gather(x, shards.gather_axes, axis=1,
                                        tiled=True)
  values = gather(local_values)
  indices = gather(global_rows(local_indices, shards))
  # lax.top_k's order on the full row: |value| descending, then index.
  _, indices, values = jax.lax.sort((-jnp.abs(values), indices, values),
                                    dimension=1, num_keys=2)
  return values[:, :k], indices[:, :k]


def all_finite(finite: jax.Array, shards: LeafSharding) -> jax.Array:
  """True on every device iff ``finite`` is true on all of the leaf's shards."""
  bad = jax.lax.psum(jnp.logical_not(finite).astype(jnp.int32),
                     shards.leaf_mesh_axes)
  return bad == 0


def selection(shards: LeafSharding) -> reference.Selection:
  """The column step's :class:`~reference.Selection` inside ``shard_map``."""
  return reference.Selection(
      add_history=lambda dense, indices, values: add_history(
          dense, indices, values, shards),
      topk=lambda candidates, k: merged_column_topk(candidates, k, shards),
      all_finite=lambda finite: all_finite(finite, shards))


# Optimizer-state shardings.


def with_state_sharding(history: codec.History, mesh: Any,
                        shards: LeafSharding) -> codec.History:
  """``history`` placed on its TACO shardings."""
  place = lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec))
  return codec.History(place(history.values, shards.values_spec),
                       place(history.indices, shards.values_spec),
                       place(history.exponents, shards.exponents_spec))


def map_over_shards(local_update: Any, mesh: Any, shards: LeafSharding,
                    arrays: tuple[jax.Array, ...], history: codec.History,
                    **hyperparams: Any) -> tuple[jax.Array, codec.History]:
  """Runs ``local_update(*arrays, history, shards=shards, **hyperparams)``
  per device.

  ``arrays`` are one or more parameter-shaped arrays (e.g. the gradient, or
  the parameter and its gradient) and ``history`` the leaf's TACO history;
  ``local_update`` returns one parameter-shaped array and the new history.
  Every array stays where it is: the parameter-shaped result comes out
  sharded like the parameter and the new history like the old one; the only
  communication is the candidate all-gather of :func:`merged_column_topk` and
  the finiteness reduction. Array leaves of the hyper-parameters (from
  :func:`optax.inject_hyperparams`, a schedule's step count, a plan's scale)
  enter replicated; Python numbers and other objects stay constants, so the
  arithmetic matches the unsharded path bit for bit.
  """
  leaves, treedef = jax.tree.flatten(hyperparams)
  is_array = [isinstance(x, jax.Array) for x in leaves]
  replicated_args = [x for x, a in zip(leaves, is_array) if a]
  # The history's tree, of specs (_make: a History holds arrays elsewhere).
  history_specs = codec.History._make(
      (shards.values_spec, shards.values_spec, shards.exponents_spec))
  in_specs = ((shards.param_spec,) * len(arrays), history_specs)
  out_specs = (shards.param_spec, history_specs)

  def per_device(blocks, replicated):
    replicated = iter(replicated)
    values = [next(replicated) if a else x for x, a in zip(leaves, is_array)]
    return local_update(*blocks[0], blocks[1], shards=shards,
                        **treedef.unflatten(values))

  run = jax.shard_map(
      per_device, mesh=mesh,
      in_specs=(in_specs, [PartitionSpec()] * len(replicated_args)),
      out_specs=out_specs,
      # Results merged by all_gather are equal on every device by construction.
      check_vma=False)
  return run((tuple(arrays), history), replicated_args)


def first_element(x: jax.Array) -> jax.Array:
  """``x.ravel()[0]`` as a replicated scalar, whatever ``x``'s sharding.

  On an explicit mesh neither the reshape nor a one-element slice of a sharded
  axis is allowed; the element lives on the devices first along every mesh
  axis that splits ``x``, so each device's first element is all-gathered (a
  few bytes) and the first one kept.
  """
  sharding = explicit_sharding(x)
  if sharding is None:
    return x.ravel()[0]
  axes = tuple(a for entry in padded_spec(sharding.spec, x.ndim)
               for a in entry)
  take_first = lambda block: jax.lax.all_gather(block.ravel()[0], axes)[0]
  return jax.shard_map(take_first, mesh=sharding.mesh,
                       in_specs=sharding.spec, out_specs=PartitionSpec(),
                       check_vma=False)(x)
