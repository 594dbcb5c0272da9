"""A tied token table's TACO step in two phases; the logits' cotangent dies.

The tied table's gradient is the projection's share (``d_logits^T features``,
formed a block of columns at a time from the logits' cotangent) plus the
lookup's share, which backprop reaches only after every layer. Keeping the
logits' cotangent until then costs ``positions x vocab`` floats through the
whole backward pass (``docs/measured/memory.md`` measures it). But the lookup
only touches the table's rows of the batch's tokens, so:

1. at the head (:func:`select_outside`): per column, the candidates of every
   row outside the batch's tokens are final; keep their top ``max(k, r)``
   (values and token indices) and the projection's gradient at the batch's
   tokens;
2. after the layers (:func:`merge_batch_tokens`): form the candidates of the
   batch's tokens from both shares, merge them with the kept ones in
   ``lax.top_k``'s order (magnitude, then lower row) and finish the step as
   the column step does.

The arithmetic of every candidate is the reference column step's, so the
result equals the one-pass step on the summed gradient (tested bit for bit).
"""

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from taco_optax._src import kernels
from taco_optax._src import sharding
from taco_optax._src import transform
from taco_optax._src.layerwise import token_table
from taco_optax._src.layerwise import winners


class HeadCandidates(NamedTuple):
  """What :func:`select_outside` keeps of the projection's share.

  Attributes:
    values: ``(n, K)`` float32 top candidates of tokens outside the batch's
      tokens, ``K = max(k, r)``, sorted as ``lax.top_k``.
    indices: ``(n, K)`` int32 their tokens.
    inside: ``(n, U)`` the projection's gradient at the batch's tokens
      (:func:`batch_tokens`), in the table's dtype.
    finite: ``()`` whether the projection's gradient is finite everywhere.
    square_sum: ``()`` float32 ``sum(g**2)`` of the projection's gradient
      outside the batch's tokens (the whole gradient there), or ``None``
      when not measured.
  """
  values: jax.Array
  indices: jax.Array
  inside: jax.Array
  finite: jax.Array
  square_sum: Optional[jax.Array] = None


def batch_tokens(ids: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
  """``(tokens, inverse)``: the distinct looked-up tokens (padded with
  ``vocab``, which matches nothing) and each id's position among them."""
  flat = ids.reshape(-1)
  tokens, inverse = jnp.unique(flat, size=flat.size, fill_value=vocab,
                             return_inverse=True)
  return tokens.astype(jnp.int32), inverse.reshape(ids.shape)


def select_outside(gradient: token_table.TableGradient, tokens: jax.Array,
                   history: kernels.History, plan: transform.LeafPlan, mu,
                   chunk: int, measure: bool = False) -> HeadCandidates:
  """Phase 1, a block of ``chunk`` columns at a time (``plan``'s columns lie
  along ``gradient.axis``); ``measure``: also the ``square_sum``."""
  values, indices, exponents = history
  vocab = gradient.shape[1 - gradient.axis]
  keep = max(values.shape[-2], plan.update_topk)
  excluded = jnp.zeros((vocab,), bool).at[tokens].set(True, mode='drop')
  n = gradient.shape[gradient.axis]

  def body(carry, start):
    finite, square_sum = carry
    grads = gradient.columns(start, chunk)  # (chunk, m)
    if measure:
      square_sum = square_sum + winners.square_sum(
          jnp.where(excluded, jnp.zeros((), grads.dtype), grads))
    columns = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk, -1)
    candidates = kernels.merged_candidates(
        grads.astype(jnp.float32), kernels.history_rows(columns(values)),
        kernels.history_rows(columns(indices)), columns(exponents), mu)
    magnitude = jnp.where(excluded, -1.0, jnp.abs(candidates))
    _, top = jax.lax.top_k(magnitude, keep)
    inside = jnp.take(grads, jnp.minimum(tokens, vocab - 1), axis=1)
    return (finite & jnp.all(jnp.isfinite(grads)), square_sum), (
        jnp.take_along_axis(candidates, top, -1), top, inside)

  (finite, square_sum), (top_values, top_indices, inside) = jax.lax.scan(
      body, (jnp.array(True), jnp.zeros((), jnp.float32)),
      jnp.arange(0, n, chunk, dtype=jnp.int32))
  merge = lambda x: x.reshape((n,) + x.shape[2:])
  return HeadCandidates(merge(top_values), merge(top_indices),
                        merge(inside), finite,
                        square_sum if measure else None)


def merge_batch_tokens(outside: HeadCandidates, tokens: jax.Array,
                       lookup_grads: jax.Array, history: kernels.History,
                       plan: transform.LeafPlan,
                       mu) -> kernels.ColumnStep:
  """Phase 2: the batch's tokens' candidates, merged with ``outside``.

  Args:
    outside: phase 1's result.
    tokens: ``(U,)`` the batch's distinct tokens (:func:`batch_tokens`).
    lookup_grads: ``(n, U)`` the lookup's gradient at those tokens.
    history: the table's history.
    plan: the table's plan.
    mu: EMA decay.

  Returns:
    The :class:`ColumnStep` on the table's ``n`` columns.
  """
  values, indices, exponents = (kernels.history_rows(history.values),
                                kernels.history_rows(history.indices),
                                history.exponents)
  k = values.shape[-1]
  vocab = plan.layout.m
  grads = (lookup_grads + outside.inside).astype(jnp.float32)
  finite = outside.finite & jnp.all(jnp.isfinite(grads))
  scaled = (1 - mu) * grads  # (n, U)
  previous = mu * kernels.decode_history(values, exponents)
  # Each history entry's place among the batch's tokens (ascending, the
  # padding last), scattered into the (n, U) candidates: n x k writes. (An
  # (n, k, U) comparison would be 4 n k U bytes, 151 MiB at 576 columns,
  # k = 16 and 8 x 512 tokens.)
  place = jnp.minimum(jnp.searchsorted(tokens, indices, method='scan'),
                      tokens.size - 1)
  place = jnp.where(tokens[place] == indices, place, tokens.size)  # dropped
  columns = jnp.arange(indices.shape[0], dtype=jnp.int32)[:, None]
  held = jnp.zeros(scaled.shape, previous.dtype).at[columns, place].add(
      previous, mode='drop')
  matched = jnp.zeros(scaled.shape, bool).at[columns, place].set(
      True, mode='drop')
  candidates = jnp.where(matched, scaled + held, scaled)
  # The batch's best k per column, in lax.top_k's order (magnitude, then
  # lower token: ``tokens`` ascend); padding (token ``vocab``) ranks last.
  valid = tokens < vocab
  _, best = jax.lax.top_k(jnp.where(valid, jnp.abs(candidates), -1.0),
                          min(k, tokens.size))
  # Each list holds the top of its rows in the same order, so the top k of
  # their union is the top k of all: a sort of k + max(k, r) per column,
  # not of every batch token (docs/measured/performance_log.md, "Whole
  # train steps").
  all_values = jnp.concatenate(
      [outside.values, jnp.take_along_axis(candidates, best, -1)], -1)
  all_tokens = jnp.concatenate([outside.indices, tokens[best]], -1)
  order = jnp.where(
      jnp.concatenate([jnp.ones_like(outside.values, bool), valid[best]], -1),
      -jnp.abs(all_values), jnp.inf)
  _, top_tokens, top_values = jax.lax.sort((order, all_tokens, all_values),
                                           dimension=-1, num_keys=2)
  return kernels.step_from_top_k(
      top_values[:, :k], top_tokens[:, :k], finite, values, indices,
      exponents, plan.update_topk)


def applies(param: jax.Array, gradient: token_table.TableGradient,
            plan: transform.LeafPlan, ids: jax.Array, k: int,
            block_elements: int) -> bool:
  """Whether the two phases can run for this table (``k`` history entries
  per column) on this device."""
  if sharding.leaf_sharding_of(param, plan.axes(param.shape)) is not None:
    return False
  layout = plan.local_layout(param.shape)
  # Phase 1 must find max(k, r) tokens outside the batch's.
  return (winners.column_chunk(layout, block_elements) is not None
          and param.ndim == 2
          and gradient.axis == winners.column_axis(layout)
          and layout.m >= ids.size + max(k, plan.update_topk))


class HeadPhase(NamedTuple):
  """Phase 1's result, kept for phase 2 (:func:`head_phase`).

  Attributes:
    tokens: ``(U,)`` the batch's distinct tokens (:func:`batch_tokens`).
    inverse: each looked-up id's position among them.
    outside: :func:`select_outside`'s candidates.
  """
  tokens: jax.Array
  inverse: jax.Array
  outside: HeadCandidates


def head_phase(gradient: token_table.TableGradient, ids: jax.Array,
               param: jax.Array, history: kernels.History,
               write: winners.WinnerWrite) -> HeadPhase:
  """Phase 1 for a table: what phase 2 needs of the projection's share."""
  tokens, inverse = batch_tokens(ids, write.plan.layout.m)
  chunk = winners.column_chunk(write.plan.local_layout(param.shape),
                               write.block_elements)
  return HeadPhase(tokens, inverse, select_outside(
      # mypy: two phases run only where applies() found a column chunk,
      # and measure implies phase 1 measured.
      gradient, tokens, history, write.plan, write.mu, chunk,  # type: ignore[arg-type]
      measure=write.measure))


def update(param: jax.Array, phase: HeadPhase,
           gather: Callable[[jax.Array, jax.Array], jax.Array],
           d_rows: jax.Array, history: kernels.History,
           write: winners.WinnerWrite
           ) -> tuple[jax.Array, kernels.History, Optional[jax.Array]]:
  """Phase 2 and the winners written into ``param`` (the table).

  Args:
    param: the table.
    phase: :func:`head_phase`'s result.
    gather: the lookup's ``gather(table, ids)``.
    d_rows: the cotangent of the looked-up tokens.
    history: the table's history.
    write: how its winners are written (``write.after`` is not used).

  Returns:
    ``(param, history, square_sum)``: updated, and with ``write.measure``
    the whole gradient's float32 ``sum(g**2)`` (else ``None``).
  """
  plan = write.plan
  axis = winners.column_axis(plan.layout)
  compact = jnp.zeros((phase.tokens.size, param.shape[axis]), param.dtype)
  _, gather_vjp = jax.vjp(lambda table: gather(table, phase.inverse), compact)
  (lookup_grads,) = gather_vjp(d_rows)  # (U, n): the lookup's share
  step = merge_batch_tokens(phase.outside, phase.tokens, lookup_grads.T,
                            history, plan, write.mu)
  square_sum = None
  if write.measure:  # the batch's tokens' rows: both shares, summed
    inside = lookup_grads.T + phase.outside.inside
    # mypy: two phases run only where applies() found a column chunk, and
    # measure implies phase 1 measured.
    square_sum = phase.outside.square_sum + winners.square_sum(jnp.where(  # type: ignore[operator]
        phase.tokens < plan.layout.m, inside, jnp.zeros((), inside.dtype)))
  delta = winners.winner_delta(step, param.dtype, write._replace(after=None))
  columns = jnp.arange(param.shape[axis], dtype=jnp.int32)[:, None]
  where = ((step.winner_indices, columns) if axis == 1
           else (columns, step.winner_indices))
  bits = None if write.rounding is None else transform.element_bits(
      write.rounding.key, transform.flat_index(param.shape, list(where)))
  param = winners.scatter_add(param, where, delta, dropping=False, bits=bits)
  return (jnp.where(step.finite, param, jnp.nan),
          kernels.History(
              kernels.stored_history(step.values, history.values.shape),
              kernels.stored_history(step.indices, history.indices.shape),
              step.exponents), square_sum)
