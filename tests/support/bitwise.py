"""Bit-for-bit comparison of pytrees (dtype, shape and bytes per leaf)."""

import jax
import numpy as np


def assert_bitwise_equal(actual, expected):
  """Fails unless both trees have the same structure and identical bytes.

  The message names every differing leaf by its path and counts the
  differing elements, so a failure says where (float8 leaves included).
  """
  actual_leaves, actual_def = jax.tree_util.tree_flatten_with_path(actual)
  expected_leaves, expected_def = jax.tree.flatten(expected)
  assert jax.tree.structure(actual) == expected_def, (actual_def,
                                                      expected_def)
  differing = []
  for (path, a), e in zip(actual_leaves, expected_leaves):
    a, e = np.asarray(a), np.asarray(e)
    name = jax.tree_util.keystr(path)
    assert (a.dtype, a.shape) == (e.dtype, e.shape), (name, a.dtype, a.shape,
                                                      e.dtype, e.shape)
    if a.tobytes() != e.tobytes():
      bits = lambda x: x.reshape(-1).view(np.uint8).reshape(x.size, -1)
      count = int((bits(a) != bits(e)).any(axis=1).sum()) if a.size else 0
      differing.append(f'{name}: {count} of {a.size} elements differ')
  assert not differing, '\n'.join(differing)
