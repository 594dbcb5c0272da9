"""TACO's step on a leaf's rows: merge the history, select, encode, pick.

Everything here works on "rows": a 2-D array of shape ``(N, m)`` whose row ``i``
is one of the paper's columns (all ``m`` entries that compete for that column's
winner). A stack of ``B`` matrices with ``n`` columns each is ``N = B * n``
rows. Keeping selection 2-D with the candidate axis last is what XLA's fast
GPU TopK kernel requires (rank <= 2, last axis).

:func:`reference_column_step` is the step in plain ``jax.numpy``. Callers go
through ``dispatch.column_step``, the one place that may run a fused kernel
instead on one device; on a mesh the caller hands in a :class:`Selection` whose
merge and top-k work across devices.
"""

from typing import Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from taco_optax._src.kernels import codec


class ColumnStep(NamedTuple):
  """The result of one TACO step on the rows ``(N, m)`` of a parameter.

  Attributes:
    values: ``(N, k)`` new history values in the storage dtype, sorted by
      decreasing magnitude, in units of ``2**exponents``.
    exponents: ``(N,)`` ``int8`` power-of-two scale of each row.
    indices: ``(N, k)`` row index of each history value (the history's index
      dtype).
    winner_indices: ``(N, r)`` ``int32`` rows that receive a sign.
    winner_signs: ``(N, r)`` ``float32`` signs in ``{-1, 0, +1}``.
    finite: ``()`` bool, whether the whole gradient was finite. When it is
      not, ``values``, ``exponents`` and ``indices`` equal the input history
      and the winners are meaningless (callers emit a NaN update).
  """
  values: jax.Array
  exponents: jax.Array
  indices: jax.Array
  winner_indices: jax.Array
  winner_signs: jax.Array
  finite: jax.Array


def column_topk(candidates: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The ``k`` largest-magnitude entries of every row, with their signs.

  Ties in magnitude go to the lower index (the order of ``lax.top_k``); the
  result is deterministic.

  Args:
    candidates: ``(N, m)`` float32.
    k: how many entries to keep per row, ``1 <= k <= m``.

  Returns:
    ``(values, indices)``, each ``(N, k)``, sorted by decreasing magnitude;
    ``values`` keep their sign, ``indices`` are int32 positions in ``[0, m)``.
  """
  _, indices = jax.lax.top_k(jnp.abs(candidates), k)
  values = jnp.take_along_axis(candidates, indices, axis=-1)
  return values, indices


def scatter_add_rows(dense: jax.Array, indices: jax.Array,
                     values: jax.Array) -> jax.Array:
  """Adds ``values[i, s]`` to ``dense[i, indices[i, s]]`` (indices unique per
  row)."""
  rows = jnp.arange(dense.shape[0], dtype=jnp.int32)[:, None]
  return dense.at[rows, indices.astype(jnp.int32)].add(
      values.astype(dense.dtype), unique_indices=True, mode='promise_in_bounds')


class Selection(NamedTuple):
  """How a leaf's candidates are formed and ranked.

  The single-device :data:`SINGLE_DEVICE`; on a mesh, ``sharded_step.selection``
  returns one whose functions work on this device's slice of every row (with
  global row indices) and combine results across devices.

  Attributes:
    add_history: ``(dense, indices, values) -> dense`` adds the decayed
      history ``values`` at row positions ``indices``.
    topk: ``(candidates, k) -> (values, indices)``, as :func:`column_topk`.
    all_finite: ``finite -> finite`` over the whole leaf.
  """
  add_history: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
  topk: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]
  all_finite: Callable[[jax.Array], jax.Array]


SINGLE_DEVICE = Selection(scatter_add_rows, column_topk, lambda finite: finite)


def reference_column_step(grad_rows: jax.Array, values: jax.Array,
                          indices: jax.Array, exponents: jax.Array,
                          mu: Union[float, jax.Array], update_topk: int,
                          selection: Selection = SINGLE_DEVICE) -> ColumnStep:
  """One TACO step on rows in plain ``jax.numpy``: the oracle of the kernels.

  .. math::
    M_t = \\mathcal{H}_k(\\mu M_{t-1} + (1 - \\mu) G_t)

  where unretained entries of :math:`M_{t-1}` count as zero; the winners are
  the ``r`` largest-magnitude entries of each row of :math:`M_t`.

  Args:
    grad_rows: ``(N, m)`` gradient, one row per paper column.
    values: ``(N, k)`` stored history values, ``k <= m``.
    indices: ``(N, k)`` their row indices (distinct within a row).
    exponents: ``(N,)`` their power-of-two scales.
    mu: EMA decay in ``[0, 1)``.
    update_topk: ``r``, signs emitted per row, ``1 <= r <= k``.
    selection: how candidates are merged and ranked (:data:`SINGLE_DEVICE`,
      or a mesh's, where ``grad_rows`` is this device's ``(N, m_local)`` slice
      and row indices, in and out, are global).

  Returns:
    A :class:`ColumnStep`.
  """
  k = values.shape[-1]
  grads = grad_rows.astype(jnp.float32)
  candidates = merged_candidates(grads, values, indices, exponents, mu,
                                 selection.add_history)
  top_values, top_indices = selection.topk(candidates, max(k, update_topk))
  # Keep XLA from fusing the selection into its consumers and recomputing it.
  top_values, top_indices = jax.lax.optimization_barrier(
      (top_values, top_indices))
  finite = selection.all_finite(jnp.all(jnp.isfinite(grads)))
  return step_from_top_k(top_values[:, :k], top_indices[:, :k], finite,
                         values, indices, exponents, update_topk)


def merged_candidates(grads: jax.Array, values: jax.Array, indices: jax.Array,
                      exponents: jax.Array, mu: Union[float, jax.Array],
                      add_history=scatter_add_rows) -> jax.Array:
  """``mu * M_{t-1} + (1 - mu) * G_t`` on rows: every entry's candidate.

  Args:
    grads: ``(N, m)`` float32 gradient rows.
    values, indices, exponents: the stored history of those rows.
    mu: EMA decay.
    add_history: how the decayed history is added (``Selection``'s).
  """
  previous = codec.decode_history(values, exponents)
  return add_history((1 - mu) * grads, indices, mu * previous)


def step_from_top_k(top_values: jax.Array, top_indices: jax.Array,
                    finite: jax.Array, values: jax.Array, indices: jax.Array,
                    exponents: jax.Array, update_topk: int) -> ColumnStep:
  """The step's end from each row's top ``k`` (sorted, ``k >= r``).

  Encodes the new history, keeps the input history (``values``, ``indices``,
  ``exponents``) when the gradient was not ``finite``, and takes the top
  ``r`` as winners.
  """
  history = codec.encode(top_values, values.dtype)
  keep = lambda new, old: jnp.where(finite, new, old)
  return ColumnStep(
      values=keep(history.values, values),
      exponents=keep(history.exponents, exponents),
      indices=keep(top_indices.astype(indices.dtype), indices),
      winner_indices=top_indices[:, :update_topk],
      winner_signs=jnp.sign(top_values[:, :update_topk]),
      finite=finite)


def decay_folds_away(mu: Union[float, jax.Array]) -> bool:
  """Whether XLA simplifies the reference's ``(1 - mu) * g`` to ``g``.

  For a Python ``mu`` whose ``1 - mu`` rounds to 1 in float32 (``mu = 0``)
  the multiply is folded, so the reference keeps subnormal gradients that the
  multiply would flush; kernels hand such steps to the reference.
  """
  return (isinstance(mu, (int, float, np.number))
          and np.float32(1 - mu) == 1)

