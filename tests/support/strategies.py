"""Hypothesis strategies for gradients with TACO's hard cases.

The arrays themselves are drawn (not a seed), so a failure shrinks to a small
matrix with few distinct values. Cases that are easy to get wrong in a
selection rule are made common: exact ties in magnitude (values from a small
set), zeros and all-zero columns, NaN/Inf, float32 subnormals and magnitudes
anywhere from ``2**-80`` to ``2**80``.
"""

from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import numpy as np

# Mantissas from a small set make exact ties in magnitude frequent.
_TIED = st.sampled_from([0.0, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0, 3.0, -3.0])
# Exact powers of two times a coarse mantissa, spread over 2**-20 .. 2**10,
# so that after scaling by 2**[-80, 80] every float32 product the step forms
# stays in the normal range (XLA flushes subnormal results to zero; numpy does
# not, so a bitwise reference comparison must stay clear of them).
_SPREAD = st.builds(
    lambda sign, mantissa, exponent: float(sign * mantissa * 2.0**exponent),
    st.sampled_from([1.0, -1.0]),
    st.sampled_from([0.0, 1.0, 1.125, 1.25, 1.5, 1.875]),
    st.integers(-20, 10))
_ANY = st.floats(-1e3, 1e3, width=32, allow_nan=False, allow_infinity=False,
                 allow_subnormal=False).filter(
                     lambda x: x == 0 or abs(x) > 1e-6)
_NORMAL_MIN = float(np.finfo(np.float32).smallest_normal)
SUBNORMAL = st.floats(-_NORMAL_MIN, _NORMAL_MIN, width=32, exclude_min=True,
                      exclude_max=True, allow_subnormal=True)
NONFINITE = st.sampled_from([np.nan, np.inf, -np.inf])


@st.composite
def gradients(draw, shape, max_log2_scale=80, nonfinite=False):
  """A float32 gradient of ``shape`` whose last axis holds a column's rows.

  Args:
    draw: hypothesis' draw.
    shape: the array shape; the last axis is the ``m`` entries of one column
      (a Flax ``(n, m)`` kernel, possibly with leading batch axes).
    max_log2_scale: the whole array is multiplied by ``2**p`` with
      ``|p| <= max_log2_scale`` (exact: a power of two).
    nonfinite: whether a NaN/Inf may be placed at one drawn position.

  Returns:
    A ``numpy`` float32 array.
  """
  elements = draw(st.sampled_from([_TIED, _SPREAD, _ANY]))
  values = draw(hnp.arrays(np.float32, shape, elements=elements))
  if draw(st.booleans()):  # some columns entirely zero
    zero_columns = draw(hnp.arrays(np.bool_, shape[:-1]))
    values[zero_columns] = 0.0
  power = draw(st.integers(-max_log2_scale, max_log2_scale))
  values = (values * np.float32(2.0**power)).astype(np.float32)
  if nonfinite and draw(st.booleans()):
    flat = draw(st.integers(0, values.size - 1))
    values.reshape(-1)[flat] = draw(NONFINITE)
  return values


@st.composite
def gradient_sequences(draw, shape, steps, nonfinite=False):
  """``steps`` gradients of one ``shape``, each drawn by :func:`gradients`."""
  return [draw(gradients(shape, nonfinite=nonfinite)) for _ in range(steps)]


@st.composite
def subnormal_gradients(draw, shape):
  """Gradients whose entries are float32 subnormals or zero."""
  return draw(hnp.arrays(np.float32, shape, elements=SUBNORMAL))
