"""Checks of one TACO update against a matrix layout written by hand.

The routing tests of every framework (NNX, Linen, Equinox, traced functions)
build a small model, route it, run one ``taco`` update and check the update
itself with :func:`assert_one_per_input` and :func:`assert_adam_dense`: the
expected axes are written in the test, never read back from the helper.
"""

import math
from typing import Sequence, Union

import numpy as np

Axes = Union[int, Sequence[int]]


def _axes(axes: Axes) -> tuple[int, ...]:
  return (axes,) if isinstance(axes, int) else tuple(axes)


def assert_one_per_input(update, reduction: Axes, output: Axes,
                         learning_rate: float, scale: float | None = None,
                         name: str = 'leaf') -> None:
  """``update`` moves exactly one weight per input feature, by lr * s.

  Args:
    update: one leaf of the update (any array).
    reduction: its input-feature axes (the paper's columns, ``n``).
    output: its output axes (the rows, ``m``); every other axis is a batch
      axis (a stacked layer), checked slice by slice.
    learning_rate: the TACO learning rate of the update.
    scale: the update scale ``s``; ``None`` means ``m / n`` of these axes.
    name: the leaf's name, for the failure message.
  """
  update = np.asarray(update, np.float64)
  reduction, output = _axes(reduction), _axes(output)
  batch = tuple(a for a in range(update.ndim) if a not in reduction + output)
  n = math.prod(update.shape[a] for a in reduction)
  m = math.prod(update.shape[a] for a in output)
  columns = update.transpose(batch + reduction + output).reshape(-1, n, m)
  nonzeros = (columns != 0).sum(axis=-1)
  assert (nonzeros == 1).all(), (
      f'{name}: expected one nonzero per input feature (n={n}, m={m}, '
      f'{columns.shape[0]} matrices); got counts '
      f'{np.unique(nonzeros).tolist()}')
  expected = learning_rate * (m / n if scale is None else scale)
  magnitudes = np.abs(columns).max(axis=-1)
  np.testing.assert_allclose(
      magnitudes, expected, rtol=1e-2,
      err_msg=f'{name}: |update| should be lr * s = {expected:.4g}')


def assert_adam_dense(update, name: str = 'leaf') -> None:
  """``update`` is Adam's: every entry of a nonzero gradient moves."""
  update = np.asarray(update, np.float64)
  assert np.count_nonzero(update) == update.size, (
      f'{name}: expected a dense (Adam) update, got '
      f'{np.count_nonzero(update)} of {update.size} nonzeros')
