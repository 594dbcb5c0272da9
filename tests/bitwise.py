"""Bit-for-bit comparison of pytrees (dtype, shape and bytes per leaf)."""

import jax
import numpy as np


def assert_bitwise_equal(actual, expected):
  """Fails unless both trees have the same structure and identical bytes."""
  actual_leaves, actual_def = jax.tree.flatten(actual)
  expected_leaves, expected_def = jax.tree.flatten(expected)
  assert actual_def == expected_def
  for a, e in zip(actual_leaves, expected_leaves):
    a, e = np.asarray(a), np.asarray(e)
    assert (a.dtype, a.shape) == (e.dtype, e.shape)
    assert a.tobytes() == e.tobytes()
