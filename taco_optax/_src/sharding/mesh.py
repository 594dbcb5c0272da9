"""Where a TACO leaf and its state live on a device mesh.

A TACO leaf's state is ``batch + (k, n)`` (values, indices) and ``batch +
(n,)`` (exponents): the output axes are gone, so the state shards like the
parameter's batch and reduction axes and is replicated over the mesh axes that
split the output axes (:class:`LeafSharding`, :func:`with_state_sharding`).
Inside ``shard_map`` a device's block of rows is found by :func:`local_rows`,
:func:`global_rows` and :func:`block_start`; the column step that merges the
devices' candidates is the kernels'
(``taco_optax/_src/kernels/sharded_step.py``).

Sharding is read from the arrays' types, so it applies to meshes whose axes are
:attr:`jax.sharding.AxisType.Explicit` (the default of :func:`jax.make_mesh`).
"""

import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

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


# Inside shard_map: where one device's block of rows sits.


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


# Optimizer-state shardings.


def with_state_sharding(history: Any, mesh: Any, shards: LeafSharding) -> Any:
  """``history`` (a leaf's ``History``: values, indices, exponents) placed on
  its TACO shardings."""
  place = lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec))
  return history._replace(
      values=place(history.values, shards.values_spec),
      indices=place(history.indices, shards.values_spec),
      exponents=place(history.exponents, shards.exponents_spec))


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
