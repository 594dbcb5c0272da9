"""The FP8 history codec: ``k`` values per row with a power-of-two row scale.

A row is one of the paper's columns (see ``reference``). FP8 E4M3 has a
narrow range (largest finite 448, smallest subnormal 2**-9), while fine-tuning
gradients are often 1e-4 to 1e-8 per entry: a raw cast would underflow to zero
and silently lose the history. Each row is therefore stored as FP8 values
times ``2**exponent`` with one ``int8`` exponent per row.
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


class History(NamedTuple):
  """One leaf's stored TACO history, in its ``batch + (k, n)`` layout.

  Attributes:
    values: ``batch + (k, n)`` values in the storage dtype, in units of
      ``2**exponents``.
    indices: ``batch + (k, n)`` their row indices.
    exponents: ``batch + (n,)`` ``int8`` power-of-two scale of each column.
  """
  values: jax.Array
  indices: jax.Array
  exponents: jax.Array


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


def decode_history(values: jax.Array, exponents: jax.Array) -> jax.Array:
  """Float32 ``(N, k)`` history of stored ``values`` and their ``exponents``."""
  return decode(EncodedRows(values, exponents))


def _pow2(exponent: jax.Array) -> jax.Array:
  return jnp.ldexp(jnp.ones(exponent.shape, jnp.float32), exponent)
