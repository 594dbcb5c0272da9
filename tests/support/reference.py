"""A plain-numpy TACO, from the paper's rule, to test the JAX code against.

Layout: one matrix at a time in the paper's orientation, ``G`` of shape
``(m, n)`` (rows x columns). The sparse history of column ``j`` is a list of
``k`` (row, value) pairs. Values are stored like the library stores them (a
power-of-two per-column scale, then a cast to ``values_dtype``) so the two can
be compared bit for bit; ``values_dtype=np.float32`` gives the paper's rule
with a full-precision history.
"""

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass
class History:
  values: np.ndarray     # (k, n) in values_dtype
  indices: np.ndarray    # (k, n) int
  exponents: np.ndarray  # (n,) int


def init(m, n, k, values_dtype=ml_dtypes.float8_e4m3fn):
  k = min(k, m)
  return History(np.zeros((k, n), values_dtype),
                 np.tile(np.arange(k)[:, None], (1, n)),
                 np.zeros((n,), np.int64))


def _store(column_values, values_dtype):
  """Power-of-two scale putting max |v| in [2**7, 2**8), then the cast."""
  amax = np.abs(column_values[0])
  exponent = int(np.frexp(np.float32(amax))[1]) - 8
  exponent = min(max(exponent, -126), 119)
  scaled = column_values.astype(np.float64) * 2.0 ** (-exponent)
  limit = float(ml_dtypes.finfo(values_dtype).max)
  scaled = np.clip(scaled.astype(np.float32), -limit, limit)
  return scaled.astype(values_dtype), exponent


def step(grad, history, mu, r=1, scale=None, values_dtype=None):
  """One TACO step. Returns (direction (m, n) float32, new history).

  A gradient holding NaN or Inf gives an all-NaN direction and leaves the
  history as it was (the documented rule).
  """
  m, n = grad.shape
  values_dtype = values_dtype or history.values.dtype
  k = history.values.shape[0]
  scale = m / n if scale is None else scale
  if not np.isfinite(grad).all():
    return np.full((m, n), np.nan, np.float32), history
  mu32 = np.float32(mu)
  direction = np.zeros((m, n), np.float32)
  new = History(np.zeros_like(history.values), np.zeros_like(history.indices),
                np.zeros_like(history.exponents))
  for j in range(n):
    column = np.float32(1 - mu) * grad[:, j].astype(np.float32)
    previous = (history.values[:, j].astype(np.float32)
                * np.float32(2.0 ** history.exponents[j]))
    for slot in range(k):
      column[history.indices[slot, j]] += mu32 * previous[slot]
    # Largest |.| first; ties to the lowest row index (stable sort).
    order = np.argsort(-np.abs(column), kind='stable')
    for row in order[:r]:
      direction[row, j] = scale * np.sign(column[row])
    kept = order[:k]
    new.values[:, j], new.exponents[j] = _store(column[kept], values_dtype)
    new.indices[:, j] = kept
  return direction, new


def candidates(grad, history, mu):
  """The dense candidates mu*M_{t-1} + (1-mu)*G in float64, shape (m, n)."""
  m, n = grad.shape
  dense = np.zeros((m, n))
  for j in range(n):
    dense[history.indices[:, j], j] = (
        history.values[:, j].astype(np.float64) * 2.0 ** history.exponents[j])
  return (1 - mu) * grad.astype(np.float64) + mu * dense


def float64_winners(grads, k, mu):
  """Winner rows of the paper's rule with an exact (float64) sparse history.

  No storage rounding at all: ``M_t = H_k(mu M_{t-1} + (1 - mu) G_t)`` with
  ``M`` kept as a dense float64 array holding ``k`` nonzeros per column.

  Args:
    grads: a list of ``(m, n)`` gradients (paper layout).
    k: entries kept per column.
    mu: EMA decay.

  Returns:
    ``(steps, n)`` int array: the row of the largest-magnitude entry of each
    column of ``M_t`` (ties to the lowest row).
  """
  m, n = grads[0].shape
  history = np.zeros((m, n))
  columns = np.arange(n)
  winners = []
  for grad in grads:
    merged = mu * history + (1 - mu) * grad.astype(np.float64)
    order = np.argsort(-np.abs(merged), axis=0, kind='stable')
    winners.append(order[0])
    history = np.zeros((m, n))
    kept = order[:min(k, m)]
    history[kept, columns] = merged[kept, columns]
  return np.stack(winners)
