"""A large matrix's TACO update a block of columns at a time.

Columns are independent in TACO, so a ``lax.scan`` over column blocks gives
the one-pass update's result with block-sized transients: the column step's
float32 candidates and magnitudes are each gradient-sized, and a token
table's gradient (a ``TableGradient``) is formed one block at a time, never
whole.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp

from taco_optax._src import kernels
from taco_optax._src import routing
from taco_optax._src import sharding
from taco_optax._src.layerwise import token_table
from taco_optax._src.layerwise import winners as winners_lib


def chunked_leaf_update(param: jax.Array, grad: Any,
                        history: kernels.History,
                        layout: routing.MatrixLayout, chunk: int,
                        write: winners_lib.WinnerWrite,
                        shards: Optional[sharding.LeafSharding]
                        ) -> tuple[jax.Array, kernels.History,
                                   Optional[jax.Array]]:
  """``weight_update.local_leaf_update`` of a 2-D leaf, ``chunk`` columns at
  a time.

  The weight and history are updated in place in the carry. Finiteness is
  judged on the whole leaf, as the optax path does. A ``TableGradient`` is
  formed a block at a time; its finiteness is known only after the last
  block, so the history is chosen then.

  Returns:
    ``(param, history, square_sum)``: with ``write.measure`` the
    gradient's float32 ``sum(g**2)``, summed over the blocks for a
    ``TableGradient`` (else ``None``).
  """
  blockwise = isinstance(grad, token_table.TableGradient)
  if blockwise:
    finite = jnp.array(True)
  else:
    finite = jnp.all(jnp.isfinite(grad))
    if shards is not None:
      finite = kernels.all_finite(finite, shards)
  blocks = _Blocks(layout, chunk, param.dtype)
  if blockwise:
    grad_rows = lambda start: grad.columns(start, chunk)
  else:
    grad_bits = blocks.as_bits(grad)
    grad_rows = lambda start: blocks.rows(grad_bits, start, grad.dtype)

  square_sum = jnp.zeros((), jnp.float32)
  if write.measure and not blockwise:
    square_sum = winners_lib.square_sum(grad)

  def body(carry, block):
    param_bits, history, finite, square_sum = carry
    start = block * chunk
    columns = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=-1)
    block_grad = grad_rows(start)
    if blockwise:
      finite = finite & jnp.all(jnp.isfinite(block_grad))
      if write.measure:
        square_sum = square_sum + winners_lib.square_sum(block_grad)
    step, new_history = kernels.history_step(
        block_grad, kernels.History(*map(columns, history)),
        update_topk=write.plan.update_topk, mu=write.mu,
        implementation=write.plan.implementation, shards=shards)
    delta = winners_lib.winner_delta(step, grad.dtype, write)
    winners = winners_lib.local_winners(step.winner_indices, shards)
    bits = None if write.rounding is None else winners_lib.winner_bits(
        write.rounding, layout, param.shape,
        start + jnp.arange(chunk, dtype=jnp.int32)[:, None], winners, shards)
    block = winners_lib.add_at_winners(
        blocks.rows(param_bits, start, param.dtype), winners, delta, bits)
    param_bits = blocks.put_rows(param_bits, block, start)
    keep = (lambda old, new: new) if blockwise else (
        lambda old, new: jnp.where(finite, new, columns(old)))
    put = lambda old, new: jax.lax.dynamic_update_slice_in_dim(
        old, keep(old, new), start, axis=-1)
    return (param_bits, kernels.History(*map(put, history, new_history)),
            finite, square_sum), None

  (param_bits, new_history, finite, square_sum), _ = jax.lax.scan(
      body, (blocks.as_bits(param), history, finite, square_sum),
      jnp.arange(layout.n // chunk, dtype=jnp.int32))
  if blockwise:  # the history is kept when the gradient was not finite
    new_history = kernels.History(*(
        jnp.where(finite, new, old) for new, old in zip(new_history, history)))
  param = blocks.from_bits(param_bits, param.dtype)
  return (jnp.where(finite, param, jnp.nan), new_history,
          square_sum if write.measure else None)


class _Blocks:
  """Blocks of ``chunk`` columns of a param-shaped 2-D array, as rows.

  XLA:CPU slices and updates 16-bit floats in float32 (converting the whole
  array on every iteration): the loop moves their bits as integers instead.
  """

  def __init__(self, layout: routing.MatrixLayout, chunk: int, dtype: Any):
    self.rows_are_axis0 = layout.transpose == (0, 1)
    self.axis = winners_lib.column_axis(layout)
    self.chunk = chunk
    self.bits_dtype = (jnp.dtype(f'uint{8 * jnp.dtype(dtype).itemsize}')
                       if jnp.dtype(dtype).itemsize < 4 else None)

  def as_bits(self, x: jax.Array) -> jax.Array:
    if self.bits_dtype is None:
      return x
    return jax.lax.bitcast_convert_type(x, self.bits_dtype)

  def from_bits(self, x: jax.Array, dtype: Any) -> jax.Array:
    if self.bits_dtype is None:
      return x
    return jax.lax.bitcast_convert_type(x, dtype)

  def rows(self, x: jax.Array, start: jax.Array, dtype: Any) -> jax.Array:
    """The ``(chunk, m)`` rows of columns ``[start, start + chunk)``."""
    block = self.from_bits(
        jax.lax.dynamic_slice_in_dim(x, start, self.chunk, axis=self.axis),
        dtype)
    return block if self.rows_are_axis0 else block.T

  def put_rows(self, x: jax.Array, block: jax.Array,
               start: jax.Array) -> jax.Array:
    block = self.as_bits(block if self.rows_are_axis0 else block.T)
    return jax.lax.dynamic_update_slice_in_dim(x, block, start,
                                               axis=self.axis)
