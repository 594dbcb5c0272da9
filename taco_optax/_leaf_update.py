"""Writing one matrix's TACO winners into its weight, as the gradient appears.

The per-leaf half of the layer-wise train step: the same ``column_step`` as
``scale_by_taco``, then a scatter of each column's ``<= r`` winners into the
weight (no dense update), optionally a block of columns at a time, and per
shard under ``shard_map`` when the weight is split over an explicit mesh.
"""

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from taco_optax import _dimension_numbers as dn
from taco_optax import _sharding
from taco_optax import _transform


class LeafPlan(NamedTuple):
  """How one parameter leaf is updated (all static)."""
  layout: Optional[dn.MatrixLayout]  # None: an AdamW leaf
  scale: float
  dim_num: Optional[dn.TacoDimensionNumbers] = None  # needed on a mesh


def data_dependency(values: jax.Array, after: Any) -> jax.Array:
  """``values + 0`` computed from ``after``: orders ``after`` first.

  A true data edge, which XLA neither drops nor lets CSE merge away (an
  ``optimization_barrier`` is lowered to a control edge on CPU and does not
  survive). E.g. XLA updates a donated weight in place only if every other
  read of it is an ancestor of the update, or else copies the weight up
  front; the input cotangent ``d_out @ W.T`` reads ``W`` without feeding the
  update, so the update is made to depend on it.
  """
  first = _sharding.first_element(jax.tree.leaves(after)[0])
  first = first.astype(values.dtype)
  return values + jnp.where(jnp.isfinite(first), first, 0) * 0


# A matrix whose column step would hold more float32 elements than this is
# processed a block of columns at a time (the column step's transients, e.g.
# the float32 candidates and their magnitudes, are each gradient-sized).
CHUNK_ELEMENTS = 2**20


def column_chunk(layout: dn.MatrixLayout) -> Optional[int]:
  """Columns per block for a chunked update, or None for one pass."""
  if layout.batch_shape or layout.n * layout.m <= 2 * CHUNK_ELEMENTS:
    return None
  if layout.transpose not in ((0, 1), (1, 0)):
    return None
  target = max(1, CHUNK_ELEMENTS // layout.m)
  chunk = max(c for c in range(1, min(target, layout.n) + 1)
              if layout.n % c == 0)
  return chunk if chunk < layout.n else None


def taco_leaf_update(param, grad, values, indices, exponents, plan, mu,
                      update_topk, lr_tx, lr_state, after=None):
  """One TACO leaf: the history step, then the winners scattered into param.

  Same arithmetic as ``scale_by_taco`` -> ``scale_by_learning_rate`` ->
  ``optax.apply_updates`` on the winners; every other entry is ``p + 0``. A
  parameter split over an explicit mesh is updated per device in
  :func:`jax.shard_map`, as ``scale_by_taco`` does (exact merged top-k).
  """
  local_update = functools.partial(_local_leaf_update, plan=plan,
                                   update_topk=update_topk, lr_tx=lr_tx)
  sharded = (None if plan.dim_num is None
             else _sharding.leaf_sharding_of(param, plan.dim_num))
  if sharded is None:
    return local_update(param, grad, values, indices, exponents, mu=mu,
                        lr_state=lr_state, after=after)
  if after is not None:  # the one element data_dependency reads
    after = _sharding.first_element(jax.tree.leaves(after)[0])
  return _sharding.map_over_shards(local_update, *sharded, param, grad,
                                   values, indices, exponents, mu=mu,
                                   lr_state=lr_state, after=after)


def _winner_positions(winners, rows_length, shards):
  """Where the winners sit in this device's rows, and the scatter mode.

  Row indices are global; a winner held by another device points past the
  end of the local rows and its write is dropped.
  """
  if shards is None or not shards.gather_axes:  # every device holds whole rows
    return winners, 'promise_in_bounds'
  local, held = _sharding.local_rows(winners, shards)
  return jnp.where(held, local, rows_length), 'drop'


def _add_at(x, where, delta, mode):
  """``x`` with ``delta`` added at ``where``, rounded once to ``x.dtype``."""
  dropping = mode == 'drop'
  current = (x.at[where].get(mode='fill', fill_value=0) if dropping
             else x[where])
  return x.at[where].set(jnp.asarray(current + delta).astype(x.dtype),
                         unique_indices=not dropping, mode=mode)


def _winner_delta(step, scale, dtype, lr_tx, lr_state, after):
  """What each winner adds to its weight: ``-lr * scale * sign``."""
  direction = (step.winner_signs * scale).astype(dtype)
  delta, _ = lr_tx.update(direction, lr_state)
  return delta if after is None else data_dependency(delta, after)


def _local_leaf_update(param, grad, values, indices, exponents, *, plan, mu,
                       update_topk, lr_tx, lr_state, after=None, shards=None):
  """:func:`taco_leaf_update` on whole arrays, or on one device's blocks.

  With ``shards`` (inside :func:`jax.shard_map`) the arrays are this device's
  blocks, ``plan`` still describes the whole leaf and row indices are global.
  """
  layout = (plan.layout if shards is None
            else dn.matrix_layout(param.shape, plan.dim_num))
  keep = values.shape[-2]
  step_args = dict(mu=mu, k=keep, update_topk=min(update_topk, plan.layout.m),
                   shards=shards)
  chunk = column_chunk(layout)
  if chunk is not None:
    return _chunked_leaf_update(param, grad, values, indices, exponents,
                                layout, plan.scale, step_args, lr_tx,
                                lr_state, after, chunk)
  rows_of_state = lambda x: jnp.swapaxes(x, -1, -2).reshape(-1, keep)
  step = _transform.column_step(
      layout.to_rows(grad), rows_of_state(values), rows_of_state(indices),
      exponents.reshape(-1), **step_args)
  delta = _winner_delta(step, plan.scale, grad.dtype, lr_tx, lr_state, after)
  rows = layout.to_rows(param)
  row_ids = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
  winners, mode = _winner_positions(step.winner_indices, layout.m, shards)
  rows = _add_at(rows, (row_ids, winners), delta, mode)
  # The optax path turns a non-finite gradient into an all-NaN update.
  new_param = jnp.where(step.finite, layout.from_rows(rows, param.shape),
                        jnp.nan)
  state_of_rows = lambda x: jnp.swapaxes(
      x.reshape(layout.batch_shape + (layout.n, keep)), -1, -2)
  return (new_param, state_of_rows(step.history.values),
          state_of_rows(step.history_indices),
          step.history.exponents.reshape(exponents.shape))


def _chunked_leaf_update(param, grad, values, indices, exponents, layout,
                         scale, step_args, lr_tx, lr_state, after, chunk):
  """:func:`_local_leaf_update` of a 2-D leaf, ``chunk`` columns at a time.

  Columns are independent in TACO, so a ``lax.scan`` over column blocks gives
  the same result with block-sized transients; the weight and state are
  updated in place in the carry. Finiteness is judged on the whole leaf, as
  the optax path does.
  """
  shards = step_args['shards']
  rows_are_axis0 = layout.transpose == (0, 1)
  finite = jnp.all(jnp.isfinite(grad))
  if shards is not None:
    finite = _sharding.all_finite(finite, shards)

  def rows(x, start):  # (chunk, m) rows of a param-shaped array
    if rows_are_axis0:
      return jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=0)
    return jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1).T

  def body(carry, block):
    param, values, indices, exponents = carry
    start = block * chunk
    columns = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=-1)
    step = _transform.column_step(
        rows(grad, start), columns(values).T, columns(indices).T,
        columns(exponents), **step_args)
    delta = _winner_delta(step, scale, grad.dtype, lr_tx, lr_state, after)
    row_ids = start + jnp.arange(chunk, dtype=jnp.int32)[:, None]
    winners, mode = _winner_positions(step.winner_indices, layout.m, shards)
    where = (row_ids, winners) if rows_are_axis0 else (winners, row_ids)
    param = _add_at(param, where, delta, mode)
    put = lambda old, new: jax.lax.dynamic_update_slice_in_dim(
        old, jnp.where(finite, new, columns(old)), start, axis=-1)
    return (param, put(values, step.history.values.T),
            put(indices, step.history_indices.T),
            put(exponents, step.history.exponents)), None

  (param, values, indices, exponents), _ = jax.lax.scan(
      body, (param, values, indices, exponents),
      jnp.arange(layout.n // chunk, dtype=jnp.int32))
  return jnp.where(finite, param, jnp.nan), values, indices, exponents


def drop_leading_axis(plan: LeafPlan, shape: tuple[int, ...]) -> LeafPlan:
  """The plan of one slice ``x[l]`` of a stacked leaf."""
  if plan.layout is None:
    return plan
  layout = plan.layout
  if not layout.batch_shape or layout.transpose[0] != 0:
    raise ValueError(
        f'A stacked TACO leaf of shape {shape} must keep its leading (layer) '
        'axis as a batch axis; check weight_dimension_numbers.')
  transpose = tuple(ax - 1 for ax in layout.transpose[1:])
  _, reduction, output = dn._normalize(shape, plan.dim_num)  # pylint: disable=protected-access
  dim_num = dn.TacoDimensionNumbers(tuple(ax - 1 for ax in reduction),
                                    tuple(ax - 1 for ax in output))
  return LeafPlan(layout._replace(batch_shape=layout.batch_shape[1:],
                                   transpose=transpose), plan.scale, dim_num)
