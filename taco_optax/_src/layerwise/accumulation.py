"""Gradient accumulation in the layer-wise step: micro-batches, layer-major.

With ``A`` micro-batches per step (every leaf of the batch has a leading axis
of size ``A``), the step runs each piece of the model over the micro-batches
one after another (``lax.map``/``lax.scan``, so transients are one
micro-batch's) and keeps, per layer, only that layer's running mean of the
gradient. The mean is ``optax.MultiSteps``' own (``use_grad_mean=True``):
``acc <- acc + (g_a - acc) / (a + 1)`` in float32 from ``acc = 0``, cast to
the gradient's dtype at the end, so a leaf whose gradient comes from one part
of the model (a layer, the head, the embedding) gets the same bits as
``MultiSteps(taco(...), A)`` fed the same micro-batches. A leaf read by both
the head and the embedding (a tied token table) gets ``mean(head shares) +
mean(embedding shares)``: the same mean summed in another order (see
``docs/accumulation.md``).
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp

from taco_optax._src.layerwise import outer as outer_lib
from taco_optax._src.layerwise import token_table

Params = Any
Batch = Any


def micro_batch_count(batches: Batch) -> int:
  """The size of the micro-batch axis every leaf of ``batches`` leads with."""
  sizes = {x.shape[0] if getattr(x, 'ndim', 0) else None
           for x in jax.tree.leaves(batches)}
  if len(sizes) != 1 or None in sizes:
    shown = sorted(map(str, sizes))
    raise ValueError(
        'with accumulation_steps, every leaf of the batch needs a leading '
        f'micro-batch axis of one size; got leading sizes {shown}.')
  return sizes.pop()


def check_micro_batches(batches: Batch, steps: int) -> None:
  """Raises unless the batch leads with a micro-batch axis of ``steps``."""
  count = micro_batch_count(batches)
  if count != steps:
    raise ValueError(
        f'accumulation_steps={steps} but the batch has {count} micro-batches '
        '(its leading axis); split it with x.reshape(steps, -1, *x.shape[1:]).')


def running_mean(acc: Any, grads: Any, index: jax.Array) -> Any:
  """``optax.MultiSteps``' running mean, one micro-batch ``index`` further."""
  return jax.tree.map(lambda g, a: a + (g - a) / (index + 1), grads, acc)


def zeros_like_float32(tree: Any) -> Any:
  """The accumulator of ``tree``'s gradient (float32, as ``MultiSteps``)."""
  return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def cast_like(tree: Any, like: Any) -> Any:
  """The accumulated mean in each leaf's dtype (``MultiSteps``' cast)."""
  return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


def layer_forward(layer: Callable[[Params, Any, Batch], Any],
                  batches: Batch) -> Callable[[Params, Any], Any]:
  """``run_layer(params, hidden)`` over micro-batch-stacked ``hidden``."""
  def run_layer(layer_params, hidden):
    return jax.lax.map(lambda xs: layer(layer_params, xs[0], xs[1]),
                       (hidden, batches))
  return run_layer


def layer_backward(layer: Callable[[Params, Any, Batch], Any],
                   batches: Batch) -> Callable[[Params, Any, Any], Any]:
  """One layer's backward pass over the micro-batches (``LayerBackward``).

  Returns ``(mean gradient, stacked input cotangents)``: each micro-batch's
  ``jax.vjp`` of the layer (recomputed from its saved input), its weight
  gradient folded into the running mean at once, so one micro-batch's
  gradient and the layer's float32 accumulator are alive, never ``A``.
  """
  def backward(layer_params, layer_inputs, d_outputs):
    def body(acc, xs):
      index, layer_input, d_output, batch = xs
      _, layer_vjp = jax.vjp(lambda p, h: layer(p, h, batch), layer_params,
                             layer_input)
      grads, d_input = layer_vjp(d_output)
      return running_mean(acc, grads, index), d_input
    count = micro_batch_count(batches)
    acc, d_inputs = jax.lax.scan(
        body, zeros_like_float32(layer_params),
        (jnp.arange(count, dtype=jnp.int32), layer_inputs, d_outputs,
         batches))
    return cast_like(acc, layer_params), d_inputs
  return backward


def _restricted(fn: Callable[..., Any], leaves: list[Any], treedef,
                reads: list[bool]) -> Callable[..., Any]:
  """``fn(outer, *args)`` as a function of the leaves ``reads`` marks."""
  def restricted(read_leaves, *args):
    it = iter(read_leaves)
    return fn(treedef.unflatten([next(it) if r else x
                                 for x, r in zip(leaves, reads)]), *args)
  return restricted


def _spread(read_values: list[Any], reads: list[bool]) -> list[Any]:
  it = iter(read_values)
  return [next(it) if r else None for r in reads]


def head_backward(head: Callable[[Params, Any, Batch], jax.Array],
                  outer: Params, hidden: Any, batches: Batch,
                  reads: list[bool]):
  """``(mean loss, mean gradients, stacked d_hidden)`` of the head.

  The head's mean gradient (float32) of each outer leaf it ``reads``
  (``None`` at the others), a micro-batch at a time. A
  :class:`TableProjection`'s table is accumulated a block of columns at a
  time from each micro-batch's factors (:func:`_table_running_mean`), so only
  the float32 accumulator is table-sized.
  """
  leaves, treedef = jax.tree.flatten(outer)
  table = (token_table.leaf_index(outer, head.table)
           if isinstance(head, token_table.TableProjection) else None)
  dense_reads = [r and i != table for i, r in enumerate(reads)]
  read = [x for x, r in zip(leaves, dense_reads) if r]
  restricted = _restricted(head, leaves, treedef, dense_reads)

  def body(carry, xs):
    acc, table_acc = carry
    index, h, batch = xs
    if table is None:
      value, head_vjp = jax.vjp(lambda o, x: restricted(o, x, batch), read,
                                h)
      grads, d_hidden = head_vjp(jnp.ones_like(value))
    else:
      outer_lib.refuse_table_reads(
          lambda o: head.features(o, h, batch), outer, head.table,
          'TableProjection.features')
      value, all_grads, d_hidden, _, gradient = token_table.head_backward(
          head, outer, h, batch)
      grads = [g for g, r in zip(all_grads, dense_reads) if r]
      table_acc = _table_running_mean(table_acc, gradient, index)
    return (running_mean(acc, grads, index), table_acc), (value, d_hidden)
  count = micro_batch_count(batches)
  table_acc = (None if table is None
               else jnp.zeros(leaves[table].shape, jnp.float32))
  (acc, table_acc), (values, d_hidden) = jax.lax.scan(
      body, (zeros_like_float32(read), table_acc),
      (jnp.arange(count, dtype=jnp.int32), hidden, batches))
  means = _spread(acc, dense_reads)
  if table is not None:
    means[table] = table_acc
  return jnp.mean(values.astype(jnp.float32)), means, d_hidden


def _table_running_mean(acc: jax.Array, gradient, index: jax.Array
                        ) -> jax.Array:
  """:func:`running_mean` of a ``TableGradient``, a block of columns at a
  time (the same elementwise arithmetic; no dense share is formed)."""
  axis = gradient.axis
  n, m = acc.shape[axis], acc.shape[1 - axis]
  target = max(1, _BLOCK_ELEMENTS // m)
  chunk = max(c for c in range(1, min(target, n) + 1) if n % c == 0)

  def body(acc, start):
    rows = gradient.columns(start, chunk)  # (chunk, m)
    block = jax.lax.dynamic_slice_in_dim(acc, start, chunk, axis)
    block = block if axis == 0 else block.T
    block = block + (rows - block) / (index + 1)
    block = block if axis == 0 else block.T
    return jax.lax.dynamic_update_slice_in_dim(acc, block, start, axis), None
  acc, _ = jax.lax.scan(body, acc, jnp.arange(0, n, chunk, dtype=jnp.int32))
  return acc


# Columns per block of a table's accumulation: as the column-block update's.
_BLOCK_ELEMENTS = 2**20


def embed_backward(embed: Callable[[Params, Batch], Any], outer: Params,
                   d_hidden: Any, batches: Batch, reads: list[bool],
                   head_means: list[Any]) -> list[Any]:
  """Each outer leaf's whole mean gradient (float32; ``None``: unread).

  The embedding's mean gradient of each leaf it ``reads``, added to the
  head's (``head_means``). A leaf only the embedding reads gets MultiSteps'
  running mean; one both read (a tied table) continues in the head's
  accumulator, ``acc + g_a / A``, so no second table-sized buffer exists.
  """
  leaves, treedef = jax.tree.flatten(outer)
  read = [x for x, r in zip(leaves, reads) if r]
  restricted = _restricted(embed, leaves, treedef, reads)
  shared = [h is not None for h, r in zip(head_means, reads) if r]
  start = [h if h is not None else jnp.zeros(x.shape, jnp.float32)
           for h, x, r in zip(head_means, leaves, reads) if r]
  count = micro_batch_count(batches)

  def body(acc, xs):
    index, d, batch = xs
    _, embed_vjp = jax.vjp(lambda o: restricted(o, batch), read)
    (grads,) = embed_vjp(d)
    return [a + g / count if both else a + (g - a) / (index + 1)
            for a, g, both in zip(acc, grads, shared)], None
  acc, _ = jax.lax.scan(body, start,
                        (jnp.arange(count, dtype=jnp.int32), d_hidden,
                         batches))
  return [e if r else h for e, h, r in zip(_spread(acc, reads), head_means,
                                           reads)]


def embed_forward(embed: Callable[[Params, Batch], Any], outer: Params,
                  batches: Batch) -> Any:
  """Each micro-batch's embedding, stacked."""
  return jax.lax.map(lambda batch: embed(outer, batch), batches)
