"""A token table's mean gradient over micro-batches, kept as their factors.

With ``A`` micro-batches the layer-wise step needs a token table's mean
gradient only at the table's update, after the embedding's backward pass. A
float32 accumulator holds it as one more table (``vocab x d`` floats, alive
from the head to the end of the step). Each micro-batch's shares of it are
also given by small factors: the projection's features and logits' cotangent
(``rows x (d + vocab)``: a classification head scores one position per
sequence) and the lookup's looked-up ids and rows' cotangent (``tokens x
d``). When those of all ``A`` micro-batches take fewer bytes than the
accumulator (:func:`kept_as_factors`, by the size rule of
:func:`table_mean_bytes`), the step keeps them instead, and the update forms
the mean from them a block of columns at a time (:class:`MeanGradient`), in
the accumulator's arithmetic.
"""

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from taco_optax._src.layerwise import leaves as leaves_lib
from taco_optax._src.layerwise import token_table

Key = leaves_lib.Key


class Share(NamedTuple):
  """One use of a table in every micro-batch.

  Attributes:
    gradient: ``gradient(factors)`` is one micro-batch's share of the
      table's gradient (a ``TableGradient``) from its ``factors``.
    factors: every micro-batch's factors: each leaf leads with the
      micro-batch axis.
  """
  gradient: Callable[[Any], token_table.TableGradient]
  factors: Any


@dataclasses.dataclass(frozen=True)
class MeanGradient(token_table.TableGradient):
  """``optax.MultiSteps``' mean of a table's gradient over ``count``
  micro-batches, formed from each one's factors (``uses`` is empty).

  The first share is folded as MultiSteps' running mean, ``acc + (g_a -
  acc) / (a + 1)`` from 0 in float32, and each later one (the lookup's share
  of a tied table) as ``acc + g_a / count``: the arithmetic of the float32
  accumulators this replaces (``accumulation.head_means``,
  ``accumulation.embed_means``). The mean is cast to the table's dtype, then
  ``transform`` is applied (clipping), as a dense mean would be.
  """
  shares: tuple[Share, ...] = ()
  count: int = 1

  def columns(self, start: jax.Array, size: int) -> jax.Array:
    """The mean's columns ``[start, start + size)``, as ``(size, m)`` rows."""
    return self._mean(lambda gradient: gradient.columns(start, size))

  def dense(self) -> jax.Array:
    """The whole mean."""
    return self._mean(lambda gradient: gradient.dense())

  def plus(self, other):
    raise NotImplementedError('a mean over micro-batches takes its shares '
                              'through with_share.')

  def with_share(self, share: Share) -> 'MeanGradient':
    """This mean with one more use of the table (a tied table's lookup)."""
    return dataclasses.replace(self, shares=self.shares + (share,))

  def _mean(self, form: Callable[[token_table.TableGradient], jax.Array]
            ) -> jax.Array:
    def micro_batch(share, index):
      factors = jax.tree.map(lambda x: x[index], share.factors)
      return form(share.gradient(factors))

    # Split over a mesh as a micro-batch's share is (its value is unused).
    acc = jnp.zeros_like(micro_batch(self.shares[0], 0), jnp.float32)
    for position, share in enumerate(self.shares):
      def body(index, acc, share=share, first=position == 0):
        grad = micro_batch(share, index)
        if first:
          return acc + (grad - acc) / (index + 1)
        return acc + grad / self.count
      acc = jax.lax.fori_loop(0, self.count, body, acc)
    total = acc.astype(self.table.dtype)
    return total if self.transform is None else self.transform(total)


def _nbytes(tree: Any) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _keeps_factors(table_size: int, factor_bytes: int,
                   accumulation_steps: int) -> bool:
  return accumulation_steps * factor_bytes < 4 * table_size


def table_mean_bytes(table_size: int, factor_bytes: int,
                     accumulation_steps: int) -> int:
  """Bytes the accumulated layer-wise step keeps for a token table's mean.

  ``train_step(..., accumulation_steps=A)`` keeps a token table's mean
  gradient over the ``A`` micro-batches (from the head to the table's
  update) as the smaller of its float32 accumulator, ``4 * table_size``
  bytes, and every micro-batch's factors, ``A * factor_bytes``; a tie keeps
  the accumulator. One micro-batch's factors are those of each use of the
  table: a :class:`TableProjection`'s features and logits' cotangent
  (``rows x (d + vocab)``, ``rows`` the positions it scores) and a
  :class:`TableLookup`'s ids and rows' cotangent (``tokens x (1 + d)``).

  Args:
    table_size: the table's elements (``vocab x d``).
    factor_bytes: one micro-batch's factors' bytes.
    accumulation_steps: micro-batches per step.

  Returns:
    The bytes kept: ``min(4 * table_size, A * factor_bytes)``.

  Examples:
    >>> from taco_optax import layerwise
    >>> # SmolLM2's 49152 x 576 tied table, micro-batches of 2 x 64 tokens
    >>> # scored at one position each (float32):
    >>> head = 2 * (576 + 49152) * 4
    >>> lookup = 2 * 64 * (1 + 576) * 4
    >>> layerwise.table_mean_bytes(49152 * 576, head + lookup, 4)
    2772992
    >>> # Micro-batches of 4 x 64 scored at every next token: the
    >>> # accumulator is the smaller.
    >>> head = 4 * 63 * (576 + 49152) * 4
    >>> lookup = 4 * 64 * (1 + 576) * 4
    >>> layerwise.table_mean_bytes(49152 * 576, head + lookup, 4)
    113246208
  """
  if _keeps_factors(table_size, factor_bytes, accumulation_steps):
    return accumulation_steps * factor_bytes
  return 4 * table_size


def kept_as_factors(loss, outer: Any, hidden: Any, batch: Any, count: int,
                    head_reads: frozenset[Key]) -> frozenset[Key]:
  """The keys of the token tables whose mean gradient is kept as factors.

  A table read through a :class:`TableProjection` head and/or a
  :class:`TableLookup` embedding (not read by the head otherwise) is kept as
  factors when ``count`` micro-batches' factors (one micro-batch's
  ``hidden`` and ``batch`` measured) take fewer bytes than its float32
  accumulator.
  """
  sizes = {}
  outer_key = lambda path: leaves_lib.OUTER + token_table.table_path(outer,
                                                                     path)
  head, embed = loss.head, loss.embed
  if isinstance(head, token_table.TableProjection):
    def factors():
      result = token_table.projection_backward(head, outer, hidden, batch)
      return result.features, result.d_logits
    sizes[outer_key(head.table)] = _nbytes(jax.eval_shape(factors))
  if isinstance(embed, token_table.TableLookup):
    key = outer_key(embed.table)
    if key in sizes or key not in head_reads:
      ids = jax.eval_shape(embed.ids, batch)
      rows = jax.eval_shape(lambda: embed.gather(
          token_table.table_at(outer, embed.table), embed.ids(batch)))
      sizes[key] = sizes.get(key, 0) + _nbytes((ids, rows))
  tables = dict(leaves_lib.keyed(outer, leaves_lib.OUTER))
  return frozenset(key for key, size in sizes.items()
                   if _keeps_factors(tables[key].size, size, count))
