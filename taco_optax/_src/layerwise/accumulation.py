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

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from taco_optax._src.layerwise import leaves as leaves_lib
from taco_optax._src.layerwise import micro_batch_table
from taco_optax._src.layerwise import ordering
from taco_optax._src.layerwise import token_table
from taco_optax._src.layerwise.outer import refuse_table_reads

Key = leaves_lib.Key

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
  # mypy: None in sizes raised above.
  return sizes.pop()  # type: ignore[return-value]


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
  """The accumulator of ``tree``'s gradient (float32, as ``MultiSteps``),
  split over a mesh as each leaf is."""
  return jax.tree.map(lambda x: jnp.zeros_like(x, jnp.float32), tree)


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
    def body(carry, xs):
      acc, d_inputs = carry
      index, layer_input, d_output, batch = xs
      _, layer_vjp = jax.vjp(lambda p, h: layer(p, h, batch), layer_params,
                             layer_input)
      grads, d_input = layer_vjp(d_output)
      d_inputs = jax.tree.map(
          lambda all_, one: jax.lax.dynamic_update_index_in_dim(
              all_, one, index, 0), d_inputs, d_input)
      return (running_mean(acc, grads, index), d_inputs), None
    count = micro_batch_count(batches)
    # Both made from this layer's cotangents: XLA otherwise forms every
    # unrolled layer's zero accumulator and stacked input cotangents (a
    # scan's outputs: one shared broadcast, a copy per loop) at the start of
    # the step and keeps them all alive until their layer's turn.
    zeros, d_inputs = ordering.ordered_after(
        (zeros_like_float32(layer_params),
         jax.tree.map(jnp.zeros_like, layer_inputs)), d_outputs)
    (acc, d_inputs), _ = jax.lax.scan(
        body, (zeros, d_inputs),
        (jnp.arange(count, dtype=jnp.int32), layer_inputs, d_outputs,
         batches))
    return cast_like(acc, layer_params), d_inputs
  return backward


class _Reads(NamedTuple):
  """The outer leaves a function reads, as a function of those alone."""
  keys: list[Key]  # the read leaves' keys, in leaf order
  values: list[jax.Array]
  restricted: Callable[..., Any]  # (read values, *args) -> fn(outer, *args)


def _reads(fn: Callable[..., Any], outer: Params,
           reads: frozenset[Key]) -> _Reads:
  keyed = list(leaves_lib.keyed(outer, leaves_lib.OUTER))
  treedef = jax.tree.structure(outer)

  def restricted(read_values, *args):
    it = iter(read_values)
    return fn(treedef.unflatten([next(it) if key in reads else x
                                 for key, x in keyed]), *args)
  return _Reads([key for key, _ in keyed if key in reads],
                [x for key, x in keyed if key in reads], restricted)


def head_means(head: Callable[[Params, Any, Batch], jax.Array],
               outer: Params, hidden: Any, batches: Batch,
               reads: frozenset[Key], block_elements: int,
               factors: frozenset[Key] = frozenset()
               ) -> tuple[jax.Array, dict[Key, Any], Any]:
  """``(mean loss, mean gradients, stacked d_hidden)`` of the head.

  The head's mean gradient (float32) of each outer leaf it ``reads``, by
  key, a micro-batch at a time. A :class:`TableProjection`'s table is
  accumulated a block of columns at a time (``block_elements`` float32
  elements) from each micro-batch's factors (:func:`fold_table`), so only
  the float32 accumulator is table-sized; a table in ``factors`` keeps every
  micro-batch's factors instead (a ``micro_batch_table.MeanGradient``).
  """
  projection = (head if isinstance(head, token_table.TableProjection)
                else None)
  table = None
  if projection is not None:
    table = leaves_lib.OUTER + token_table.table_path(outer, projection.table)
  keep = table is not None and table in factors
  dense = _reads(head, outer, frozenset(reads - {table}))

  def body(carry, xs):
    acc, table_acc = carry
    index, h, batch = xs
    kept = None
    if projection is None:
      value, head_vjp = jax.vjp(
          lambda o, x: dense.restricted(o, x, batch), dense.values, h)
      grads, d_hidden = head_vjp(jnp.ones_like(value))
    else:
      refuse_table_reads(lambda o: projection.features(o, h, batch), outer,
                         projection.table, 'TableProjection.features')
      result = token_table.projection_backward(projection, outer, h, batch)
      by_key = {leaves_lib.OUTER + path: g
                for path, g in result.grads.items()}
      grads, d_hidden = [by_key[key] for key in dense.keys], result.d_hidden
      if keep:
        kept = (result.features, result.d_logits)
      else:
        table_acc = fold_table(
            table_acc, result.gradient,
            lambda acc, g: acc + (g - acc) / (index + 1), block_elements)
      value = result.value
    return ((running_mean(acc, grads, index), table_acc),
            (value, d_hidden, kept))
  count = micro_batch_count(batches)
  table_acc = None
  if table is not None and not keep:
    table_acc = jnp.zeros_like(dict(leaves_lib.keyed(
        outer, leaves_lib.OUTER))[table], jnp.float32)
  (acc, table_acc), (values, d_hidden, kept) = jax.lax.scan(
      body, (zeros_like_float32(dense.values), table_acc),
      (jnp.arange(count, dtype=jnp.int32), hidden, batches))
  means = dict(zip(dense.keys, acc))
  if keep and projection is not None and table is not None:
    array = token_table.table_at(outer, projection.table)
    means[table] = micro_batch_table.MeanGradient(
        array, projection.table_axis, (), count=count,
        shares=(micro_batch_table.Share(
            lambda f: token_table.projection_gradient(projection, array, *f),
            kept),))
  elif table is not None:
    means[table] = table_acc
  return jnp.mean(values.astype(jnp.float32)), means, d_hidden


def fold_table(acc: jax.Array, gradient: token_table.TableGradient,
               fold: Callable[[jax.Array, jax.Array], jax.Array],
               block_elements: int) -> jax.Array:
  """``fold(acc, gradient)`` elementwise, a block of columns at a time.

  A block of ``gradient``'s columns is formed from its factors only (about
  ``block_elements`` float32 elements), folded into the same block of the
  float32 accumulator, which is updated in place: no dense share of the
  table's gradient is formed (e.g. :func:`running_mean`'s arithmetic).
  """
  axis = gradient.axis
  n, m = acc.shape[axis], acc.shape[1 - axis]
  target = max(1, block_elements // m)
  chunk = max(c for c in range(1, min(target, n) + 1) if n % c == 0)

  def body(acc, start):
    rows = gradient.columns(start, chunk)  # (chunk, m)
    block = jax.lax.dynamic_slice_in_dim(acc, start, chunk, axis)
    block = fold(block if axis == 0 else block.T, rows)
    block = block if axis == 0 else block.T
    return jax.lax.dynamic_update_slice_in_dim(acc, block, start, axis), None
  acc, _ = jax.lax.scan(body, acc, jnp.arange(0, n, chunk, dtype=jnp.int32))
  return acc


def embed_means(embed: Callable[[Params, Batch], Any], outer: Params,
                d_hidden: Any, batches: Batch, reads: frozenset[Key],
                head_means: dict[Key, Any], block_elements: int,
                factors: frozenset[Key] = frozenset()) -> dict[Key, Any]:
  """Each outer leaf's whole mean gradient (float32), by key; a leaf
  nothing reads has none.

  The embedding's mean gradient of each leaf it ``reads``, added to the
  head's (``head_means``). A leaf only the embedding reads gets MultiSteps'
  running mean; one both read (a tied table) continues in the head's
  accumulator, ``acc + g_a / A``, so no second table-sized buffer exists. A
  :class:`TableLookup`'s table is folded in from each micro-batch's looked-up
  rows a block of columns at a time (:func:`fold_table`, ``block_elements``),
  so no dense share of its gradient is formed either; a table in
  ``factors`` keeps every micro-batch's ids and rows' cotangent instead, as
  one more share of its ``micro_batch_table.MeanGradient``.
  """
  lookup = embed if isinstance(embed, token_table.TableLookup) else None
  table = None
  if lookup is not None:
    table = leaves_lib.OUTER + token_table.table_path(outer, lookup.table)
    first = jax.tree.map(lambda x: x[0], batches)
    rows = lookup.gather(token_table.table_at(outer, lookup.table),
                         lookup.ids(first))
    refuse_table_reads(lambda o: lookup.apply(o, rows, first), outer,
                       lookup.table, 'TableLookup.apply')
  keep = table is not None and table in factors
  read = _reads(embed, outer, reads - {table})
  count = micro_batch_count(batches)

  def fold(key, index):
    if key in head_means:
      return lambda a, g: a + g / count
    return lambda a, g: a + (g - a) / (index + 1)

  def start(key, x):
    return (head_means[key] if key in head_means
            else jnp.zeros_like(x, jnp.float32))

  def body(carry, xs):
    acc, table_acc = carry
    index, d, batch = xs
    kept = None
    if lookup is None or table is None:
      _, embed_vjp = jax.vjp(lambda o: read.restricted(o, batch),
                             read.values)
      (grads,) = embed_vjp(d)
    else:
      result = token_table.lookup_backward(lookup, outer, batch)(d)
      by_key = {leaves_lib.OUTER + path: g
                for path, g in result.grads.items()}
      grads = [by_key[key] for key in read.keys]
      if keep:
        kept = (result.ids, result.d_rows)
      else:
        gradient = token_table.lookup_gradient(
            lookup, token_table.table_at(outer, lookup.table), result.ids,
            result.d_rows)
        table_acc = fold_table(table_acc, gradient, fold(table, index),
                               block_elements)
    return ([fold(key, index)(a, g)
             for key, a, g in zip(read.keys, acc, grads)], table_acc), kept
  table_start = None
  if lookup is not None and table is not None and not keep:
    table_start = start(table, token_table.table_at(outer, lookup.table))
  (acc, table_acc), kept = jax.lax.scan(
      body, ([start(key, x) for key, x in zip(read.keys, read.values)],
             table_start),
      (jnp.arange(count, dtype=jnp.int32), d_hidden, batches))
  means = {**head_means, **dict(zip(read.keys, acc))}
  if keep and lookup is not None and table is not None:
    means[table] = _with_lookup(lookup, outer, head_means.get(table), kept,
                                count)
  elif table is not None:
    means[table] = table_acc
  return means


def _with_lookup(embed: token_table.TableLookup, outer: Params,
                 head_mean: Any, kept: Any,
                 count: int) -> micro_batch_table.MeanGradient:
  """The lookup's share (its micro-batches' ``kept`` factors) as the last
  share of the table's mean: after the head's ``head_mean`` (a tied
  table's), or alone."""
  array = token_table.table_at(outer, embed.table)
  share = micro_batch_table.Share(
      lambda f: token_table.lookup_gradient(embed, array, *f), kept)
  if head_mean is None:
    return micro_batch_table.MeanGradient(array, 1, (), count=count,
                                          shares=(share,))
  if head_mean.axis != 1:
    raise ValueError('a table read along two different column axes.')
  return head_mean.with_share(share)


def embed_forward(embed: Callable[[Params, Batch], Any], outer: Params,
                  batches: Batch) -> Any:
  """Each micro-batch's embedding, stacked."""
  return jax.lax.map(lambda batch: embed(outer, batch), batches)
