"""Hard inputs for the column-step kernels and the check against the reference.

Shared by the kernel tests (``test_cpu_kernel.py``, ``test_pallas_kernel.py``):
gradients of one hard kind each, valid stored histories, and one assertion
that a kernel equals ``reference_column_step`` bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from taco_optax._src.kernels import reference as _column_step
from tests.support.bitwise import assert_bitwise_equal

HISTORY_FIELDS = ('values', 'exponents', 'indices', 'finite')
KINDS = ('normal', 'ties', 'zero', 'constant', 'subnormal', 'wide', 'huge',
         'nan', 'inf')


def gradient(rng, shape, kind):
  """Gradient rows of one hard kind (a numpy float32 array)."""
  if kind == 'normal':
    return rng.standard_normal(shape).astype(np.float32)
  if kind == 'ties':  # few distinct magnitudes, both signs, zeros
    levels = np.array([0.0, -0.0, 1.5, -1.5, 0.25, -0.25], np.float32)
    return rng.choice(levels, shape)
  if kind == 'zero':
    return np.where(rng.random(shape) < 0.5, 0.0, -0.0).astype(np.float32)
  if kind == 'constant':
    return np.full(shape, rng.choice([-3.0, 2.0**-20, 7e20]), np.float32)
  if kind == 'subnormal':  # below, at and just above float32's normal range
    scale = rng.choice([1e-45, 1e-40, 1.2e-38, 1e-36])
    return (rng.standard_normal(shape) * scale).astype(np.float32)
  if kind == 'wide':  # 1e-30 .. 1e30 within one row
    exponents = rng.uniform(-30, 30, shape)
    return (rng.choice([-1.0, 1.0], shape) * 10.0**exponents).astype(np.float32)
  if kind == 'huge':  # near float32's largest: the merge may overflow to inf
    return (rng.choice([-1.0, 1.0], shape) * 3.3e38).astype(np.float32)
  if kind not in ('nan', 'inf'):
    raise ValueError(kind)
  grads = rng.standard_normal(shape).astype(np.float32)
  grads[rng.integers(shape[0]), rng.integers(shape[1])] = (
      np.nan if kind == 'nan' else -np.inf)
  return grads


def history(rng, n, m, k, index_dtype=np.int32):
  """A valid stored history: distinct in-range indices, finite FP8 values."""
  indices = np.stack([rng.permutation(m)[:k] for _ in range(n)])
  values = np.clip(rng.standard_normal((n, k)) * 100, -448, 448)
  values[rng.random((n, k)) < 0.2] = 0.0
  exponents = rng.integers(-126, 120, n)
  return (jnp.asarray(values.astype(ml_dtypes.float8_e4m3fn)),
          jnp.asarray(indices.astype(index_dtype)),
          jnp.asarray(exponents.astype(np.int8)))


@functools.lru_cache(maxsize=None)
def jitted(step, update_topk, mu):
  """``step`` under jit; ``mu=None`` means mu is a traced argument."""
  if mu is None:
    return jax.jit(lambda *args: step(*args[:4], args[4], update_topk))
  return jax.jit(lambda *args: step(*args, mu, update_topk))


def check(kernel, grads, values, indices, exponents, mu, update_topk):
  """Asserts ``kernel`` == the reference: all outputs, or if the gradient is
  not finite the kept input history (winners are then meaningless)."""
  static_mu = mu if isinstance(mu, float) else None
  args = (grads, values, indices, exponents)
  if static_mu is None:
    args += (mu,)
  expected = jitted(_column_step.reference_column_step, update_topk,
                    static_mu)(*args)
  actual = jitted(kernel, update_topk, static_mu)(*args)
  fields = _column_step.ColumnStep._fields
  if not bool(expected.finite):
    fields = HISTORY_FIELDS
    assert_bitwise_equal(actual[:3], (values, exponents, indices))
  for field in fields:
    assert_bitwise_equal(getattr(actual, field), getattr(expected, field))
  return expected
