"""A token table split by rows on a mesh, updated a block of columns at a time.

When a table's vocabulary (its rows, TACO's output axis) is split over mesh
axes and its gradient is a :class:`TableGradient` whose uses keep to each
device's rows (a lookup and a projection written for such a table, e.g. the
example's ``vocab_parallel``), each block of the gradient's columns comes
out split the same way: every device forms its own rows of the block from
the factors, with no communication and no dense table gradient. Each
block's column step then runs per device (``kernels.map_over_shards``: the
top-k of each device's rows, the ``k x shards`` candidates merged exactly),
and its winners are written into the table in the loop's carry.

The result equals the one-pass step on the dense gradient: columns are
independent, the finiteness of the whole gradient decides (as the optax path
does) whether the weights become NaN and whether the history is kept.
"""

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from taco_optax._src import kernels
from taco_optax._src import sharding
from taco_optax._src.layerwise import token_table
from taco_optax._src.layerwise import winners as winners_lib


def local_shape(shards: sharding.LeafSharding, mesh, shape) -> tuple[int, ...]:
  """One device's block shape of a leaf of ``shape``."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  out = []
  for size, axes in zip(shape, shards.param_axes):
    for axis in axes:
      size //= sizes[axis]
    out.append(size)
  return tuple(out)


def chunk_of(param: jax.Array, grad: token_table.TableGradient, write,
             mesh, shards) -> Optional[int]:
  """Columns per block, or None when the table takes the dense path (not
  2-D, columns not along the gradient's axis, columns split over the mesh,
  or stochastic rounding, whose bits follow the whole leaf's layout)."""
  if param.ndim != 2 or write.rounding is not None:
    return None
  layout = write.plan.local_layout(local_shape(shards, mesh, param.shape))
  axis = winners_lib.column_axis(layout)
  if grad.axis != axis or shards.param_axes[axis]:
    return None
  return winners_lib.column_chunk(layout, write.block_elements)


def update(param: jax.Array, grad: token_table.TableGradient,
           history: kernels.History, write: winners_lib.WinnerWrite,
           chunk: int, local_update: Callable):
  """``(param, history, square_sum)``: the table's update, ``chunk``
  columns at a time (``square_sum``: the gradient's float32 ``sum(g**2)``
  with ``write.measure``, else None). ``local_update(param, grad, history,
  write=...)`` updates one device's shard of a block of columns."""
  axis = grad.axis
  n = param.shape[axis]
  plan = write.plan
  block_write = write._replace(measure=False)

  def body(carry, block):
    table, new_history, finite, square_sum = carry
    start = block * chunk
    rows = grad.columns(start, chunk)  # (chunk, m): rows split like param's
    block_grad = rows if axis == 0 else rows.T
    finite = finite & jnp.all(jnp.isfinite(block_grad))
    if write.measure:
      square_sum = square_sum + jnp.sum(jnp.square(
          block_grad.astype(jnp.float32)))
    columns = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, -1)
    block_param = jax.lax.dynamic_slice_in_dim(table, start, chunk, axis)
    found = sharding.leaf_sharding_of(block_param,
                                      plan.axes(block_param.shape))
    assert found is not None, 'a block of a sharded table is sharded too'
    mesh, shards = found
    block_param, block_history = kernels.map_over_shards(
        local_update, mesh, shards,
        (block_param, block_grad),
        kernels.History(*map(columns, new_history)), write=block_write)
    table = jax.lax.dynamic_update_slice_in_dim(table, block_param, start,
                                                axis)
    new_history = kernels.History(*(
        jax.lax.dynamic_update_slice_in_dim(old, new, start, -1)
        for old, new in zip(new_history, block_history)))
    return (table, new_history, finite, square_sum), None

  (table, new_history, finite, square_sum), _ = jax.lax.scan(
      body, (param, history, jnp.array(True), jnp.zeros((), jnp.float32)),
      jnp.arange(n // chunk, dtype=jnp.int32))
  new_history = kernels.History(*(
      jnp.where(finite, new, old) for new, old in zip(new_history, history)))
  return (jnp.where(finite, table, jnp.nan), new_history,
          square_sum if write.measure else None)
