"""The fast and the long tier of a parametrised test, marked at the test.

A plain ``python -m pytest`` runs the fast tier (``-m 'not long'``); ``python
-m pytest -m long`` the rest, and CI both. A matrix over model families,
layouts or dtypes whose cases exercise one code path each keeps its first
case (or the ones it names) in the fast tier and marks the others ``long``,
so the fast tier still runs every path once::

  @pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))

Stacked axes each keep their first value fast, so the fast tier runs the case
of every axis's first value.
"""

from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import pytest


def first_fast(values: Iterable[Any],
               fast: Sequence[Any] | None = None) -> list[Any]:
  """``values`` for ``pytest.mark.parametrize``, all but some marked ``long``.

  Args:
    values: the cases; a tuple is one case of several arguments.
    fast: the cases kept in the fast tier; ``None``: the first one.

  Returns:
    The cases in their order, the fast ones as given and the others as
    ``pytest.param(..., marks=pytest.mark.long)``.

  Raises:
    ValueError: if ``fast`` names a case that is not among ``values`` (a
      renamed case would otherwise silently leave the fast tier).
  """
  values = list(values)
  kept = values[:1] if fast is None else list(fast)
  missing = [case for case in kept if case not in values]
  if missing or not kept:
    raise ValueError(f'fast cases {missing or kept} are not among {values}')
  return [case if case in kept else
          pytest.param(*(case if isinstance(case, tuple) else (case,)),
                       marks=pytest.mark.long)
          for case in values]
