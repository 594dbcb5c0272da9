"""Writing one matrix's TACO winners into its weight, as the gradient appears.

The per-leaf half of the layer-wise train step: the same history step as
``scale_by_taco`` (``kernels.history_step``), then a scatter of each column's
``<= r`` winners into the weight (no dense update), optionally a block of
columns at a time, and per shard under ``shard_map`` when the weight is split
over an explicit mesh.
"""

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from taco_optax._src import transform
from taco_optax._src import kernels
from taco_optax._src.layerwise import token_table


def data_dependency(values: jax.Array, after: Any) -> jax.Array:
  """``values + 0`` computed from ``after``: orders ``after`` first.

  A true data edge, which XLA neither drops nor lets CSE merge away (an
  ``optimization_barrier`` is lowered to a control edge on CPU and does not
  survive). E.g. XLA updates a donated weight in place only if every other
  read of it is an ancestor of the update, or else copies the weight up
  front; the input cotangent ``d_out @ W.T`` reads ``W`` without feeding the
  update, so the update is made to depend on it.
  """
  first = kernels.first_element(jax.tree.leaves(after)[0])
  first = first.astype(values.dtype)
  return values + jnp.where(jnp.isfinite(first), first, 0) * 0


# A matrix whose column step would hold more float32 elements than this is
# processed a block of columns at a time (the column step's transients, e.g.
# the float32 candidates and their magnitudes, are each gradient-sized).
COLUMN_BLOCK_ELEMENTS = 2**20


def column_chunk(layout: transform.MatrixLayout) -> Optional[int]:
  """Columns per block for a chunked update, or None for one pass."""
  if layout.batch_shape or layout.n * layout.m <= 2 * COLUMN_BLOCK_ELEMENTS:
    return None
  if layout.transpose not in ((0, 1), (1, 0)):
    return None
  target = max(1, COLUMN_BLOCK_ELEMENTS // layout.m)
  chunk = max(c for c in range(1, min(target, layout.n) + 1)
              if layout.n % c == 0)
  return chunk if chunk < layout.n else None


class LeafRounding(NamedTuple):
  """Stochastic rounding of one 16-bit leaf's winners (see ``_rounding``).

  Attributes:
    key: the leaf's ``(2,)`` key at this step (``transform.leaf_key``).
    shape: the whole leaf's shape (every layer of a stacked leaf).
    layer: the slice's index when the update is one slice of a stacked
      leaf, else ``None``.
  """
  key: jax.Array
  shape: tuple[int, ...]
  layer: Optional[jax.Array] = None


def winner_bits(rounding: LeafRounding, layout: transform.MatrixLayout,
                shape: tuple[int, ...], row_ids: jax.Array,
                winners: jax.Array, shards=None) -> jax.Array:
  """The random bits of the elements at ``(row_ids, winners)`` of the rows.

  ``layout`` and ``shape`` are those of the block being updated (a slice, a
  device's block); the bits are those of the same elements of the whole leaf
  (``transform.element_bits`` of their flat index), as the optax path draws
  them.
  """
  flat = row_ids.astype(jnp.int32) * layout.m + winners
  permuted = jnp.unravel_index(jnp.maximum(flat, 0),
                               tuple(shape[a] for a in layout.transpose))
  coords = [None] * len(shape)
  for position, axis in zip(permuted, layout.transpose):
    coords[axis] = position
  if shards is not None:
    coords = [c + kernels.block_start(shards, axis, shape[axis])
              for axis, c in enumerate(coords)]
  if rounding.layer is not None:
    coords = [jnp.broadcast_to(rounding.layer, flat.shape)] + coords
  return transform.element_bits(rounding.key,
                                transform.flat_index(rounding.shape, coords))


def taco_leaf_update(param, grad, values, indices, exponents, *, plan, mu,
                     lr_tx, lr_state, after=None, rounding=None):
  """One TACO leaf: the history step, then the winners scattered into param.

  Same arithmetic as ``scale_by_taco`` -> ``scale_by_learning_rate`` ->
  (with ``rounding``, a :class:`LeafRounding`, stochastic rounding) ->
  ``optax.apply_updates`` on the winners; every other entry is ``p + 0``. A
  parameter split over an explicit mesh is updated per device in
  :func:`jax.shard_map`, as ``scale_by_taco`` does (exact merged top-k).
  ``grad`` may be a ``TableGradient``: a column-chunked update then forms it
  one block of columns at a time, never whole.

  Returns:
    ``(param, values, indices, exponents)``, updated.
  """
  local_update = functools.partial(_local_leaf_update, lr_tx=lr_tx)
  sharded = kernels.leaf_sharding_of(param, plan.axes(param.shape))
  if sharded is not None and isinstance(grad, token_table.TableGradient):
    grad = grad.dense()
  if sharded is None:
    return local_update(param, grad, values, indices, exponents, plan=plan,
                        mu=mu, lr_state=lr_state, after=after,
                        rounding=rounding)
  if after is not None:  # the one element data_dependency reads
    after = kernels.first_element(jax.tree.leaves(after)[0])
  return kernels.map_over_shards(local_update, *sharded, param, grad,
                               values, indices, exponents, plan=plan, mu=mu,
                               lr_state=lr_state, after=after,
                               rounding=rounding)


def _local_winners(winners, shards):
  """Where the winners sit in this device's rows (``-1``: on another device).

  Row indices are global; on a mesh a device holds a slice of every row.
  """
  if shards is None or not shards.gather_axes:  # every device holds whole rows
    return winners
  local, held = kernels.local_rows(winners, shards)
  return jnp.where(held, local, -1)


def scatter_add(x, where, delta, dropping, bits=None):
  """``x`` with ``delta`` added at ``where``, rounded once to ``x.dtype``.

  In place on a donated ``x``; with ``dropping``, out-of-range positions
  (winners held by another device, marked ``-1``) are skipped. With ``bits``
  (one per position) ``delta`` is first rounded stochastically as
  ``transform.rounded_update`` rounds it on the optax path.
  """
  if dropping:
    rows, winners = where
    where = (rows, jnp.where(winners < 0, x.shape[1], winners))
    current = x.at[where].get(mode='fill', fill_value=0)
  else:
    current = x[where]
  if bits is not None:
    delta = transform.rounded_update(current, delta, bits)
  new = jnp.asarray(current + delta).astype(x.dtype)
  return x.at[where].set(new, unique_indices=not dropping,
                         mode='drop' if dropping else 'promise_in_bounds')


def _add_at_winners(rows: jax.Array, winners: jax.Array, delta: jax.Array,
                    bits: Optional[jax.Array]) -> jax.Array:
  """``rows`` with ``delta[i, s]`` added at ``rows[i, winners[i, s]]``.

  As :func:`scatter_add` (each sum rounded once to ``rows.dtype``, every
  other entry untouched), written as one elementwise pass over a block of
  rows: inside the chunked loop, where XLA:CPU would run a scatter of 16-bit
  floats in float32 by converting the whole weight on every iteration.
  Winners outside ``[0, m)`` (``-1``: held by another device) match nothing.
  With ``bits``, ``delta`` is rounded stochastically as in :func:`scatter_add`.
  """
  if bits is not None:
    current = jnp.take_along_axis(rows, jnp.clip(winners, 0, rows.shape[1] - 1),
                                  axis=1)
    delta = transform.rounded_update(current, delta, bits)
  positions = jax.lax.broadcasted_iota(jnp.int32, rows.shape, 1)
  out = rows
  for slot in range(winners.shape[1]):
    hit = positions == winners[:, slot:slot + 1]
    added = (rows + delta[:, slot:slot + 1]).astype(rows.dtype)
    out = jnp.where(hit, added, out)
  return out


def winner_delta(step, scale, dtype, lr_tx, lr_state, after):
  """What each winner adds to its weight: ``-lr * scale * sign``."""
  direction = (step.winner_signs * scale).astype(dtype)
  delta, _ = lr_tx.update(direction, lr_state)
  return delta if after is None else data_dependency(delta, after)


def _local_leaf_update(param, grad, values, indices, exponents, *, plan, mu,
                       lr_tx, lr_state, after=None, rounding=None,
                       shards=None):
  """:func:`taco_leaf_update` on whole arrays, or on one device's blocks.

  With ``shards`` (inside :func:`jax.shard_map`) the arrays are this device's
  blocks, ``plan`` still describes the whole leaf and row indices are global.
  """
  layout = plan.local_layout(param.shape)
  chunk = column_chunk(layout)
  if isinstance(grad, token_table.TableGradient) and (
      chunk is None or grad.axis != column_axis(layout)):
    grad = grad.dense()
  if chunk is not None:
    return _chunked_leaf_update(param, grad, values, indices, exponents,
                                layout, plan, mu, lr_tx, lr_state, after,
                                shards, chunk, rounding)
  step, state = kernels.history_step(
      layout.to_rows(grad), values, indices, exponents,
      update_topk=plan.update_topk, mu=mu,
      implementation=plan.implementation, shards=shards)
  delta = winner_delta(step, plan.scale, grad.dtype, lr_tx, lr_state, after)
  rows = layout.to_rows(param)
  row_ids = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
  winners = _local_winners(step.winner_indices, shards)
  bits = None if rounding is None else winner_bits(
      rounding, layout, param.shape, row_ids, winners, shards)
  rows = scatter_add(rows, (row_ids, winners), delta,
                     dropping=shards is not None and bool(shards.gather_axes),
                     bits=bits)
  # The optax path turns a non-finite gradient into an all-NaN update.
  new_param = jnp.where(step.finite, layout.from_rows(rows, param.shape),
                        jnp.nan)
  return (new_param,) + state


def column_axis(layout: transform.MatrixLayout) -> int:
  """The axis of a 2-D leaf that holds its columns (the paper's ``n``)."""
  return 0 if layout.transpose == (0, 1) else 1


def _chunked_leaf_update(param, grad, values, indices, exponents, layout,
                         plan, mu, lr_tx, lr_state, after, shards, chunk,
                         rounding):
  """:func:`_local_leaf_update` of a 2-D leaf, ``chunk`` columns at a time.

  Columns are independent in TACO, so a ``lax.scan`` over column blocks gives
  the same result with block-sized transients; the weight and state are
  updated in place in the carry. Finiteness is judged on the whole leaf, as
  the optax path does. A ``TableGradient`` is formed a block at a time; its
  finiteness is known only after the last block, so the state is chosen then.
  """
  rows_are_axis0 = layout.transpose == (0, 1)
  blockwise = isinstance(grad, token_table.TableGradient)
  if blockwise:
    finite = jnp.array(True)
  else:
    finite = jnp.all(jnp.isfinite(grad))
    if shards is not None:
      finite = kernels.all_finite(finite, shards)

  axis = column_axis(layout)
  # XLA:CPU slices and updates 16-bit floats in float32 (converting the whole
  # array on every iteration): the loop moves their bits as integers instead.
  bits_dtype = (jnp.dtype(f'uint{8 * param.dtype.itemsize}')
                if param.dtype.itemsize < 4 else None)
  as_bits = lambda x: (x if bits_dtype is None
                       else jax.lax.bitcast_convert_type(x, bits_dtype))
  from_bits = lambda x, dtype: (x if bits_dtype is None
                                else jax.lax.bitcast_convert_type(x, dtype))

  def rows(x, start, dtype):  # (chunk, m) rows of a param-shaped array
    block = from_bits(jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=axis),
                      dtype)
    return block if rows_are_axis0 else block.T

  def put_rows(x, block, start):
    block = as_bits(block if rows_are_axis0 else block.T)
    return jax.lax.dynamic_update_slice_in_dim(x, block, start, axis=axis)

  if blockwise:
    grad_rows = lambda start: grad.columns(start, chunk)
  else:
    grad_bits = as_bits(grad)
    grad_rows = lambda start: rows(grad_bits, start, grad.dtype)

  def body(carry, block):
    param_bits, values, indices, exponents, finite = carry
    start = block * chunk
    columns = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=-1)
    block_grad = grad_rows(start)
    if blockwise:
      finite = finite & jnp.all(jnp.isfinite(block_grad))
    step, new_state = kernels.history_step(
        block_grad, columns(values), columns(indices), columns(exponents),
        update_topk=plan.update_topk, mu=mu,
        implementation=plan.implementation, shards=shards)
    delta = winner_delta(step, plan.scale, grad.dtype, lr_tx, lr_state, after)
    winners = _local_winners(step.winner_indices, shards)
    bits = None if rounding is None else winner_bits(
        rounding, layout, param.shape,
        start + jnp.arange(chunk, dtype=jnp.int32)[:, None], winners, shards)
    block = _add_at_winners(rows(param_bits, start, param.dtype), winners,
                            delta, bits)
    param_bits = put_rows(param_bits, block, start)
    keep = (lambda old, new: new) if blockwise else (
        lambda old, new: jnp.where(finite, new, columns(old)))
    put = lambda old, new: jax.lax.dynamic_update_slice_in_dim(
        old, keep(old, new), start, axis=-1)
    return (param_bits,) + tuple(
        put(old, new) for old, new in zip((values, indices, exponents),
                                          new_state)) + (finite,), None

  old_state = (values, indices, exponents)
  (param_bits, *state, finite), _ = jax.lax.scan(
      body, (as_bits(param),) + old_state + (finite,),
      jnp.arange(layout.n // chunk, dtype=jnp.int32))
  if blockwise:  # the history is kept when the gradient was not finite
    state = [jnp.where(finite, new, old) for new, old in zip(state, old_state)]
  param = from_bits(param_bits, param.dtype)
  return (jnp.where(finite, param, jnp.nan),) + tuple(state)


def drop_leading_axis(plan: Optional[transform.LeafPlan], shape: tuple[int, ...]
                      ) -> Optional[transform.LeafPlan]:
  """The plan of one slice ``x[l]`` of a stacked leaf."""
  if plan is None:
    return plan
  layout = plan.layout
  if not layout.batch_shape or layout.transpose[0] != 0:
    raise ValueError(
        f'A stacked TACO leaf of shape {shape} must keep its leading (layer) '
        'axis as a batch axis; check weight_dimension_numbers.')
  transpose = tuple(ax - 1 for ax in layout.transpose[1:])
  _, reduction, output = transform.normalize_axes(shape, plan.dim_num)
  dim_num = transform.TacoDimensionNumbers(tuple(ax - 1 for ax in reduction),
                                    tuple(ax - 1 for ax in output))
  return plan._replace(
      layout=layout._replace(batch_shape=layout.batch_shape[1:],
                             transpose=transpose),
      dim_num=dim_num)
