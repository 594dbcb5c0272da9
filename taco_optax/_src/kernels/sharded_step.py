"""TACO's column step on a leaf split over a device mesh (exact).

When the output axes are split over mesh axes (tensor parallelism) every device
holds a slice of each column's ``m`` candidates, and ``lax.top_k`` over a
sharded axis is either refused (explicit meshes) or wrong (jax issue 19271).
Each device therefore takes the top ``k`` of its own slice, the ``k * shards``
candidates of each column are all-gathered (``O(k n)`` bytes, not ``O(m n)``)
and merged. The merge orders candidates by (magnitude descending, global row
index ascending), the order of ``lax.top_k`` on the whole column, so the result
is bit-identical to the single-device step, ties included.

Where a leaf's blocks live (:class:`~taco_optax._src.sharding.LeafSharding`)
is the sharding room's; this module is the step's arithmetic across them, and
:func:`map_over_shards` runs an update per device in ``shard_map``.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from taco_optax._src import sharding
from taco_optax._src.kernels import codec
from taco_optax._src.kernels import reference


def add_history(dense: jax.Array, indices: jax.Array, values: jax.Array,
                shards: sharding.LeafSharding) -> jax.Array:
  """Sharded :func:`reference.scatter_add_rows` with global ``indices``.

  Entries held by other devices are dropped rather than added as zeros, so
  ``-0.0`` stays ``-0.0`` exactly as on one device.
  """
  if not shards.gather_axes:  # every device holds whole rows
    return reference.scatter_add_rows(dense, indices, values)
  local, held = sharding.local_rows(indices, shards)
  m_local = dense.shape[-1]
  local = jnp.where(held, local, m_local)  # out of bounds: dropped
  rows = jnp.arange(dense.shape[0], dtype=jnp.int32)[:, None]
  return dense.at[rows, local].add(values.astype(dense.dtype), mode='drop')


def merged_column_topk(candidates: jax.Array, k: int,
                       shards: sharding.LeafSharding
                       ) -> tuple[jax.Array, jax.Array]:
  """Exact :func:`reference.column_topk` of rows split across devices.

  Args:
    candidates: ``(N, m_local)`` this device's slice of every row.
    k: entries to keep per row, ``k <= m`` (the global row length).
    shards: the leaf's :class:`sharding.LeafSharding`.

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
  indices = gather(sharding.global_rows(local_indices, shards))
  # lax.top_k's order on the full row: |value| descending, then index.
  _, indices, values = jax.lax.sort((-jnp.abs(values), indices, values),
                                    dimension=1, num_keys=2)
  return values[:, :k], indices[:, :k]


def all_finite(finite: jax.Array, shards: sharding.LeafSharding) -> jax.Array:
  """True on every device iff ``finite`` is true on all of the leaf's shards."""
  bad = jax.lax.psum(jnp.logical_not(finite).astype(jnp.int32),
                     shards.leaf_mesh_axes)
  return bad == 0


def selection(shards: sharding.LeafSharding) -> reference.Selection:
  """The column step's :class:`~reference.Selection` inside ``shard_map``."""
  return reference.Selection(
      add_history=lambda dense, indices, values: add_history(
          dense, indices, values, shards),
      topk=lambda candidates, k: merged_column_topk(candidates, k, shards),
      all_finite=lambda finite: all_finite(finite, shards))



def map_over_shards(local_update: Any, mesh: Any, shards: sharding.LeafSharding,
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
