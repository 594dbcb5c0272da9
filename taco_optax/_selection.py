"""Per-column selection and the dynamically scaled FP8 history codec.

Everything here works on "rows": a 2-D array of shape ``(N, m)`` whose row ``i``
is one of the paper's columns (all ``m`` entries that compete for that column's
winner). A stack of ``B`` matrices with ``n`` columns each is ``N = B * n``
rows. Keeping selection 2-D with the candidate axis last is what XLA's fast
GPU TopK kernel requires (rank <= 2, last axis).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Per-row FP8 scale exponent: the row's largest |value| is mapped into
# [2**7, 2**8), well inside float8_e4m3fn's finite range (max 448), so the
# cast never overflows (ml_dtypes turns |x| >~ 465 into NaN rather than
# saturating) and entries down to 2**-17 of the row maximum stay nonzero.
_MANTISSA_TARGET = 8
# Clamp so that 2.0**exponent is a normal float32 and fits in int8.
_MIN_EXPONENT = -126
_MAX_EXPONENT = 119
EXPONENT_DTYPE = jnp.int8


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
  """Adds ``values[i, s]`` to ``dense[i, indices[i, s]]``; indices unique per row."""
  rows = jnp.arange(dense.shape[0], dtype=jnp.int32)[:, None]
  return dense.at[rows, indices.astype(jnp.int32)].add(
      values.astype(dense.dtype), unique_indices=True, mode='promise_in_bounds')


def one_sparse_rows(indices: jax.Array, signs: jax.Array, m: int,
                    dtype: jnp.dtype) -> jax.Array:
  """A dense ``(N, m)`` array with ``signs[i, s]`` at ``indices[i, s]``, else 0.

  Built with comparisons rather than a scatter so that XLA writes it in one
  fused elementwise pass.
  """
  positions = jax.lax.broadcasted_iota(jnp.int32, (indices.shape[0], m), 1)
  dense = jnp.zeros((indices.shape[0], m), dtype)
  for slot in range(indices.shape[1]):
    hit = positions == indices[:, slot:slot + 1].astype(jnp.int32)
    dense = jnp.where(hit, signs[:, slot:slot + 1].astype(dtype), dense)
  return dense


class EncodedRows(NamedTuple):
  values: jax.Array     # (N, k), storage dtype (float8_e4m3fn by default)
  exponents: jax.Array  # (N,), int8: value = stored * 2**exponent


def encode(values: jax.Array, dtype: jnp.dtype) -> EncodedRows:
  """Stores float32 ``(N, k)`` rows in ``dtype`` with a power-of-two row scale.

  The scale is a power of two, so multiplying every input by ``2**p`` changes
  only the exponents, never the stored values (barring float32 under/overflow).
  Rows must be sorted by decreasing magnitude (``values[:, 0]`` is the max).
  """
  _, exponent = jnp.frexp(jnp.abs(values[:, 0]))
  exponent = jnp.clip(exponent - _MANTISSA_TARGET, _MIN_EXPONENT,
                      _MAX_EXPONENT).astype(EXPONENT_DTYPE)
  scaled = values * _pow2(-exponent.astype(jnp.int32))[:, None]
  limit = float(jnp.finfo(dtype).max)
  stored = jnp.clip(scaled, -limit, limit).astype(dtype)
  return EncodedRows(stored, exponent)


def decode(encoded: EncodedRows) -> jax.Array:
  """Float32 ``(N, k)`` values of an :class:`EncodedRows`."""
  scale = _pow2(encoded.exponents.astype(jnp.int32))
  return encoded.values.astype(jnp.float32) * scale[:, None]


def _pow2(exponent: jax.Array) -> jax.Array:
  return jnp.ldexp(jnp.ones(exponent.shape, jnp.float32), exponent)
