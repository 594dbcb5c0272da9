"""What a leaf's winners add to its weight, and where, in the layer-wise step.

The pieces every writer of winners shares (the one-pass update in
``weight_update``, the column-block loop in ``column_blocks``, the tied
table's phase 2 in ``tied_table``): how one leaf is written
(:class:`WinnerWrite`), each winner's delta, the winners' positions on this
device, their stochastic-rounding bits, and the two ways of adding the
deltas (a scatter, or one elementwise pass over a block of rows).
"""

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from taco_optax._src import kernels
from taco_optax._src import routing
from taco_optax._src import sharding
from taco_optax._src import transform
from taco_optax._src.layerwise import ordering

# train_step's default column_block_elements: a matrix whose column step
# would hold more float32 elements than this is updated a block of columns
# at a time (the step's transients, e.g. the float32 candidates and their
# magnitudes, are each gradient-sized).
DEFAULT_COLUMN_BLOCK_ELEMENTS = 2**20


def column_chunk(layout: routing.MatrixLayout,
                 block_elements: int) -> Optional[int]:
  """Columns per block for a chunked update, or None for one pass."""
  if layout.batch_shape or layout.n * layout.m <= 2 * block_elements:
    return None
  if layout.transpose not in ((0, 1), (1, 0)):
    return None
  target = max(1, block_elements // layout.m)
  chunk = max(c for c in range(1, min(target, layout.n) + 1)
              if layout.n % c == 0)
  return chunk if chunk < layout.n else None


def column_axis(layout: routing.MatrixLayout) -> int:
  """The axis of a 2-D leaf that holds its columns (the paper's ``n``)."""
  return 0 if layout.transpose == (0, 1) else 1


class LeafRounding(NamedTuple):
  """Stochastic rounding of one 16-bit leaf's winners (see ``rounding``).

  Attributes:
    key: the leaf's ``(2,)`` key at this step (``transform.leaf_key``).
    shape: the whole leaf's shape (every layer of a stacked leaf).
    layer: the slice's index when the update is one slice of a stacked
      leaf, else ``None``.
  """
  key: jax.Array
  shape: tuple[int, ...]
  layer: Optional[jax.Array] = None


class WinnerWrite(NamedTuple):
  """How one leaf's winners are written, besides its arrays.

  Attributes:
    plan: the leaf's :class:`LeafPlan` (of the whole leaf on a mesh).
    mu: the history EMA decay.
    learning_rate: the TACO branch's ``scale_by_learning_rate``.
    learning_rate_state: its state.
    block_elements: ``train_step``'s ``column_block_elements``.
    after: what the winners' delta is ordered after (``None``: nothing).
    rounding: the leaf's :class:`LeafRounding` when it is rounded
      stochastically.
    measure: whether to return the gradient's ``sum(g**2)`` (float32), for
      the step's global gradient norm.
    whole: whether the weight is a whole leaf, not one layer's slice of a
      stacked leaf inside the backward scan (where the CPU kernel's write,
      unlike a scatter, would not be fused into the stacked leaf's update
      in place).
  """
  plan: transform.LeafPlan
  mu: Union[float, jax.Array]
  learning_rate: optax.GradientTransformation
  learning_rate_state: Any
  block_elements: int
  after: Any = None
  rounding: Optional[LeafRounding] = None
  measure: bool = False
  whole: bool = True


def square_sum(grad: jax.Array) -> jax.Array:
  """``sum(g**2)`` in float32 (``optax.global_norm``'s terms)."""
  return jnp.sum(jnp.square(grad.astype(jnp.float32)))


def winner_bits(rounding: LeafRounding, layout: routing.MatrixLayout,
                shape: tuple[int, ...], row_ids: jax.Array,
                winners: jax.Array, shards=None) -> jax.Array:
  """The random bits of the elements at ``(row_ids, winners)`` of the rows.

  ``layout`` and ``shape`` are those of the block being updated (a slice, a
  device's block); the bits are those of the same elements of the whole leaf
  (``transform.element_bits`` of their flat index), as the optax path draws
  them.
  """
  coords = layout.element_coords(shape, row_ids, winners)
  if shards is not None:
    coords = [c + sharding.block_start(shards, axis, shape[axis])
              for axis, c in enumerate(coords)]
  if rounding.layer is not None:
    coords = [jnp.broadcast_to(rounding.layer, coords[0].shape)] + coords
  return transform.element_bits(rounding.key,
                                transform.flat_index(rounding.shape, coords))


def local_winners(winners, shards):
  """Where the winners sit in this device's rows (``-1``: on another device).

  Row indices are global; on a mesh a device holds a slice of every row.
  """
  if shards is None or not shards.gather_axes:  # every device holds whole rows
    return winners
  local, held = sharding.local_rows(winners, shards)
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


def winner_delta(step: kernels.ColumnStep, dtype: Any,
                 write: WinnerWrite) -> jax.Array:
  """What each winner adds to its weight: ``-lr * scale * sign``."""
  direction = (step.winner_signs * write.plan.scale).astype(dtype)
  delta, _ = write.learning_rate.update(direction, write.learning_rate_state)
  if delta.dtype == jnp.float32:
    # As the optax path materialises its update before apply_updates adds
    # it, -lr * scale is rounded to float32 before the weight adds it: left
    # to itself XLA:CPU (jax >= 0.11) contracts the multiply and the add
    # into one FMA here, and a weight differs from the optax path's by an
    # ulp. (16-bit deltas are not barred: XLA keeps them in float32 on both
    # paths alike.)
    delta = jax.lax.optimization_barrier(delta)
  if write.after is None:
    return delta
  return ordering.data_dependency(delta, write.after)


def add_at_winners(rows: jax.Array, winners: jax.Array, delta: jax.Array,
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
  _, reduction, output = routing.normalize_axes(shape, plan.dim_num)
  dim_num = routing.TacoDimensionNumbers(tuple(ax - 1 for ax in reduction),
                                    tuple(ax - 1 for ax in output))
  return plan._replace(
      layout=layout._replace(batch_shape=layout.batch_shape[1:],
                             transpose=transpose),
      dim_num=dim_num)
