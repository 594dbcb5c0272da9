"""Writing one matrix's TACO winners into its weight, as the gradient appears.

The per-leaf half of the layer-wise train step: the same history step as
``scale_by_taco`` (``kernels.history_step``), then a scatter of each column's
``<= r`` winners into the weight (no dense update), a block of columns at a
time for large matrices (``column_blocks``), and per shard under
``shard_map`` when the weight is split over an explicit mesh.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from taco_optax._src import kernels
from taco_optax._src import sharding
from taco_optax._src.layerwise import column_blocks
from taco_optax._src.layerwise import sharded_table
from taco_optax._src.layerwise import token_table
from taco_optax._src.layerwise import winners as winners_lib
from taco_optax._src.layerwise.winners import WinnerWrite


class LeafUpdate(NamedTuple):
  """One TACO leaf's update.

  Attributes:
    param: the new weight.
    history: the new history.
    square_sum: the gradient's float32 ``sum(g**2)`` when ``write.measure``,
      else ``None``.
  """
  param: jax.Array
  history: kernels.History
  square_sum: Optional[jax.Array] = None


def _measured(grad: jax.Array, write: WinnerWrite) -> Optional[jax.Array]:
  return winners_lib.square_sum(grad) if write.measure else None


def taco_leaf_update(param: jax.Array, grad: Any,
                     history: kernels.History, write: WinnerWrite
                     ) -> LeafUpdate:
  """One TACO leaf: the history step, then the winners scattered into param.

  Same arithmetic as ``scale_by_taco`` -> ``scale_by_learning_rate`` ->
  (with ``write.rounding``, stochastic rounding) -> ``optax.apply_updates``
  on the winners; every other entry is ``p + 0``. A parameter split over an
  explicit mesh is updated per device in :func:`jax.shard_map`, as
  ``scale_by_taco`` does (exact merged top-k). ``grad`` may be a
  ``TableGradient``: a column-chunked update then forms it one block of
  columns at a time, never whole.

  Returns:
    The :class:`LeafUpdate`.
  """
  sharded = sharding.leaf_sharding_of(param, write.plan.axes(param.shape))
  if sharded is None:
    return _local_update(param, grad, history, write)
  if write.after is not None:  # the one element data_dependency reads
    write = write._replace(
        after=sharding.first_element(jax.tree.leaves(write.after)[0]))
  if isinstance(grad, token_table.TableGradient):
    chunk = sharded_table.chunk_of(param, grad, write, *sharded)
    if chunk is not None:  # each device forms its rows, a block at a time
      return LeafUpdate(*sharded_table.update(
          param, grad, history, write, chunk, local_leaf_update))
    grad = grad.dense()
  square_sum = _measured(grad, write)
  write = write._replace(measure=False)
  # map_over_shards keeps Python values of ``write`` (the plan, the
  # transformation's functions) constants; its arrays enter replicated.
  return LeafUpdate(*kernels.map_over_shards(
      local_leaf_update, *sharded, (param, grad), history, write=write),
                    square_sum)


def _local_update(param: jax.Array, grad: Any, history: kernels.History,
                  write: WinnerWrite) -> LeafUpdate:
  """:func:`taco_leaf_update` on whole arrays."""
  layout = write.plan.local_layout(param.shape)
  chunk = winners_lib.column_chunk(layout, write.block_elements)
  if isinstance(grad, token_table.TableGradient) and (
      chunk is None or grad.axis != winners_lib.column_axis(layout)):
    grad = grad.dense()
  if isinstance(grad, token_table.TableGradient):  # formed block by block
    return LeafUpdate(*column_blocks.chunked_leaf_update(
        # mypy: a TableGradient reaches here only with a chunk (else
        # densified above).
        param, grad, history, layout, chunk, write, None))  # type: ignore[arg-type]
  square_sum = _measured(grad, write)
  param, history = local_leaf_update(param, grad, history,
                                     write=write._replace(measure=False))
  return LeafUpdate(param, history, square_sum)


def local_leaf_update(param: jax.Array, grad: Any, history: kernels.History,
                      *, write: WinnerWrite,
                      shards: Optional[sharding.LeafSharding] = None
                      ) -> tuple[jax.Array, kernels.History]:
  """:func:`taco_leaf_update` on whole arrays, or on one device's blocks.

  With ``shards`` (inside :func:`jax.shard_map`) the arrays are this device's
  blocks, ``write.plan`` still describes the whole leaf and row indices are
  global.
  """
  plan = write.plan
  layout = plan.local_layout(param.shape)
  chunk = winners_lib.column_chunk(layout, write.block_elements)
  if isinstance(grad, token_table.TableGradient) and (
      chunk is None or grad.axis != winners_lib.column_axis(layout)):
    grad = grad.dense()
  if chunk is not None:
    return column_blocks.chunked_leaf_update(param, grad, history, layout,
                                             chunk, write, shards)[:2]
  step, history = kernels.history_step(
      layout.to_rows(grad), history, update_topk=plan.update_topk,
      mu=write.mu, implementation=plan.implementation, shards=shards)
  delta = winners_lib.winner_delta(step, grad.dtype, write)
  rounding = write.rounding
  if (shards is None and write.whole and not layout.batch_shape
      and layout.transpose in ((0, 1), (1, 0))
      and (rounding is None or (rounding.layer is None
                                and rounding.shape == param.shape))):
    # One custom call, no scatter (nor, for a 16-bit weight, its stochastic
    # rounding) for XLA:CPU to compile for this weight.
    written = kernels.winner_write(
        param, step.winner_indices, delta, step.finite,
        winners_lib.column_axis(layout), plan.implementation,
        None if rounding is None else rounding.key)
    if written is not None:
      return written, history
  rows = layout.to_rows(param)
  row_ids = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
  winners = winners_lib.local_winners(step.winner_indices, shards)
  bits = None if write.rounding is None else winners_lib.winner_bits(
      write.rounding, layout, param.shape, row_ids, winners, shards)
  rows = winners_lib.scatter_add(rows, (row_ids, winners), delta,
                     dropping=shards is not None and bool(shards.gather_axes),
                     bits=bits)
  # The optax path turns a non-finite gradient into an all-NaN update.
  new_param = jnp.where(step.finite, layout.from_rows(rows, param.shape),
                        jnp.nan)
  return new_param, history
