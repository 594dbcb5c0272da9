"""The head-gradient share one TACO row follows (issue 33's diagnostic)."""

import numpy as np
import pytest

from benchmarks import label_rows


def test_two_classes_follow_exactly_half():
  rng = np.random.default_rng(0)
  grad = np.zeros((10, 6))
  row = rng.normal(size=6)
  grad[3], grad[7] = row, -row  # p - y sums to zero over the candidates
  grad[5] = 100.0  # an input token's row: not a label row, not counted
  assert label_rows.head_share(grad, np.array([3, 7])) == pytest.approx(0.5)


def test_the_share_is_one_over_c_when_rows_are_equal_and_one_when_one_leads():
  grad = np.zeros((8, 4))
  grad[[0, 2, 4, 6]] = [[1.0, -2.0, 0.0, 3.0]] * 4
  labels = np.array([0, 2, 4, 6])
  # The third column has no label gradient and is left out.
  assert label_rows.head_share(grad, labels) == pytest.approx(0.25)
  grad[2] *= 100
  assert label_rows.head_share(grad, labels) == pytest.approx(100 / 103)


def test_moved_rows_name_the_changed_row_per_column_or_minus_one():
  before = np.zeros((5, 3))
  after = before.copy()
  after[4, 0] = 1.0
  after[1, 2] = -1.0
  np.testing.assert_array_equal(label_rows.moved_rows(before, after),
                                [4, -1, 1])
