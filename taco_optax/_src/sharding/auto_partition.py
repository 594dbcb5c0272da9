"""TACO's single-device column step with a partitioning rule for Auto meshes.

On a mesh whose axes are :attr:`jax.sharding.AxisType.Auto` nothing about
sharding is read from the arrays' types: XLA partitions the step itself. Left
alone it gathers the whole gradient before ``lax.top_k`` and replicates the
fused CPU kernel (a custom call has no partitioning rule of its own).
:func:`partitioned_step` wraps the step in
:func:`jax.experimental.custom_partitioning`, so XLA hands this module the
shardings it chose for the ``(N, m)`` rows, and each device runs:

* rows ``N`` split, the candidate axis ``m`` whole: the local step (what
  ``dispatch`` chose) on its own rows; only the finiteness flag is combined;
* ``m`` split as well: ``dispatch``' sharded step (the exact merged top-k:
  the top ``k`` of each slice, ``k * shards`` candidates all-gathered and
  merged in ``lax.top_k``'s order), as on an Explicit mesh.

Results equal the single-device step bit for bit. A sharding that does not
split the arrays into equal blocks is replicated (correct, but it gathers).

The rows are formed before the op (``MatrixLayout.to_rows``). A 2-D kernel
``(in, out)`` keeps its sharding (``in`` -> ``N``, ``out`` -> ``m``), and so
does a stacked ``(L, in, out)`` whose ``in`` axis is whole or whose ``L`` axis
carries the split. A stacked leaf split on ``in`` but not on ``L`` cannot be
flattened to ``L * in`` rows without moving data: XLA gathers its ``in`` axis
before the op (still exact).
"""

import math
from typing import Any, Callable, Union

import jax
from jax.experimental.custom_partitioning import custom_partitioning
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from taco_optax._src.sharding import mesh as mesh_lib

# (grad_rows, values, indices, exponents, mu, update_topk) -> the kernels'
# ColumnStep (a NamedTuple with a ``finite`` flag), read here as a tuple.
LocalStep = Callable[..., Any]
# The same plus the leaf's mesh_lib.LeafSharding: one device's slice of rows.
ShardedStep = Callable[..., Any]

# Rows N, candidates m, history k, winners r; an empty entry is a scalar (mu
# when it is an array, the finiteness flag).
_RULE = 'N m, N k, N k, N{mu} -> N k, N, N k, N r, N r, '


def _split_axes(sharding: Any, shape: tuple[int, ...]
                ) -> tuple[Any, mesh_lib.MeshAxes, mesh_lib.MeshAxes]:
  """``(mesh, axes splitting N, axes splitting m)`` of the rows' sharding.

  Axes that do not split their dimension into equal blocks, and every axis of
  a sharding without mesh axis names, come back empty (replicated).
  """
  if not isinstance(sharding, NamedSharding):
    return None, (), ()
  mesh = sharding.mesh
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  axes = mesh_lib.padded_spec(sharding.spec, 2)
  even = lambda dim: not shape[dim] % math.prod(sizes[a] for a in axes[dim])
  rows = axes[0] if even(0) else ()
  candidates = axes[1] if even(1) and set(axes[1]).isdisjoint(rows) else ()
  return mesh, rows, candidates


def _specs(rows: mesh_lib.MeshAxes, candidates: mesh_lib.MeshAxes,
           array_mu: bool
           ) -> tuple[tuple[PartitionSpec, ...], tuple[PartitionSpec, ...]]:
  """Argument and result specs of the op for a row/candidate split."""
  row = mesh_lib.spec_entry(rows)
  per_row = PartitionSpec(row, None)
  arguments: tuple[PartitionSpec, ...] = (
      PartitionSpec(row, mesh_lib.spec_entry(candidates)), per_row,
               per_row, PartitionSpec(row))
  arguments += (PartitionSpec(),) if array_mu else ()
  results = (per_row, PartitionSpec(row), per_row, per_row, per_row,
             PartitionSpec())
  return arguments, results


def _per_device_step(local_step: LocalStep, update_topk: int, mesh: Any,
                     rows: mesh_lib.MeshAxes, candidates: mesh_lib.MeshAxes,
                     shape: tuple[int, int], sharded_step: ShardedStep
                     ) -> Callable[..., tuple[Any, ...]]:
  """The step on one device's block, with global results."""
  if candidates:
    shards = mesh_lib.leaf_sharding(
        shape, PartitionSpec(mesh_lib.spec_entry(rows),
                             mesh_lib.spec_entry(candidates)),
        ((), (0,), (1,)), dict(zip(mesh.axis_names, mesh.axis_sizes)))

  def step(mu, grad_rows, values, indices, exponents):
    if candidates:
      return tuple(sharded_step(grad_rows, values, indices, exponents, mu,
                                update_topk, shards))
    result = local_step(grad_rows, values, indices, exponents, mu,
                        update_topk)
    if not rows:
      return tuple(result)
    # One device's rows may be finite while another's are not: every device
    # then keeps its history, as the single-device step keeps all of it.
    finite = jax.lax.psum(jnp.logical_not(result.finite).astype(jnp.int32),
                          rows) == 0
    keep = lambda new, old: jnp.where(finite, new, old)
    return tuple(result._replace(
        values=keep(result.values, values),
        exponents=keep(result.exponents, exponents),
        indices=keep(result.indices, indices), finite=finite))

  return step


def _make_op(local_step: LocalStep, sharded_step: ShardedStep,
             static_mu: Any, update_topk: int
             ) -> Callable[..., tuple[jax.Array, ...]]:
  """The op for one step function, ``update_topk`` and (Python) ``mu``."""
  array_mu = static_mu is None

  def whole(*arrays):
    *inputs, mu = arrays if array_mu else (*arrays, static_mu)
    return tuple(local_step(*inputs, mu, update_topk))

  op = custom_partitioning(whole)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    grad = arg_shapes[0]
    named_mesh, rows, candidates = _split_axes(grad.sharding, grad.shape)
    mesh = named_mesh or mesh
    arguments, results = _specs(rows, candidates, array_mu)
    step = _per_device_step(local_step, update_topk, mesh, rows, candidates,
                            grad.shape, sharded_step)

    def lower(*blocks):
      *inputs, mu = blocks if array_mu else (*blocks, static_mu)
      return step(mu, *inputs)

    named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)
    return mesh, lower, named(results), named(arguments)

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    del result_shape
    grad = arg_shapes[0]
    named_mesh, rows, candidates = _split_axes(grad.sharding, grad.shape)
    _, results = _specs(rows, candidates, array_mu)
    return tuple(NamedSharding(named_mesh or mesh, s) for s in results)

  op.def_partition(
      partition, infer_sharding_from_operands=infer_sharding_from_operands,
      sharding_rule=_RULE.format(mu=', ' if array_mu else ''))

  # custom_partitioning has no batching rule: under vmap each entry runs the
  # unpartitioned step, as it did before this op existed.
  batchable = jax.custom_batching.custom_vmap(op)

  @batchable.def_vmap
  def _(axis_size, in_batched, *arrays):
    del axis_size
    outputs = jax.vmap(whole, in_axes=[0 if b else None for b in in_batched]
                       )(*arrays)
    return outputs, (True,) * len(outputs)

  return batchable


# The op of each (step function, static mu, update_topk): process-wide, so
# that every trace of the same step reuses one custom_partitioning op (a new
# op per trace would defeat jit's cache). Holds functions only, no arrays.
_ops: dict[tuple[Any, ...], Any] = {}


def partitioned_step(grad_rows: jax.Array, values: jax.Array,
                     indices: jax.Array, exponents: jax.Array,
                     mu: Union[float, jax.Array], update_topk: int,
                     local_step: LocalStep, sharded_step: ShardedStep
                     ) -> tuple[jax.Array, ...]:
  """``local_step`` on rows, partitioned per device on an Auto mesh.

  Same arguments as
  :func:`taco_optax._src.kernels.reference.reference_column_step` on one
  device, and its results as a plain tuple (``dispatch`` makes them its
  ``ColumnStep`` again). In a process with one device it is ``local_step``
  itself; under :func:`jax.vmap` each entry runs ``local_step``
  unpartitioned.

  Args:
    grad_rows: ``(N, m)`` gradient rows.
    values: ``(N, k)`` history values.
    indices: ``(N, k)`` their (global) row indices.
    exponents: ``(N,)`` their scales.
    mu: EMA decay: a Python number stays a constant (as on one device), an
      array enters replicated.
    update_topk: winners per row.
    local_step: the single-device step to run per device on whole rows.
    sharded_step: the step to run per device when the candidate axis is
      split (it takes the leaf's ``mesh_lib.LeafSharding`` last).

  Returns:
    The fields of the kernels' ``ColumnStep``, in its order.
  """
  if jax.device_count() == 1:  # nothing to partition
    return tuple(local_step(grad_rows, values, indices, exponents, mu,
                            update_topk))
  static_mu = None if isinstance(mu, jax.Array) else mu
  key = (local_step, sharded_step, static_mu, update_topk)
  if key not in _ops:
    _ops[key] = _make_op(local_step, sharded_step, static_mu, update_topk)
  arrays: tuple[jax.Array, ...] = (grad_rows, values, indices, exponents)
  arrays += (jnp.asarray(mu),) if static_mu is None else ()
  return tuple(_ops[key](*arrays))
