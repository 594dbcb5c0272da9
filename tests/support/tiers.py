"""The fast and the long tier of a parametrised test, marked at the test.

A plain ``python -m pytest`` runs the fast tier (``-m 'not long'``); ``python
-m pytest -m long`` the rest, and CI both. A matrix over model families,
layouts or dtypes whose cases exercise one code path each keeps its first
case (or the ones it names) in the fast tier and marks the others ``long``,
so the fast tier still runs every path once::

  @pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))

Stacked axes each keep their first value fast, so the fast tier runs the case
of every axis's first value.

A long case whose outcome differs between jax versions (a float-order bound
measured on each) is named in ``jax_versions``: it is marked so, and CI runs
it on the floor stack as well as the newest (``.ci/run``).
"""

from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import pytest


def first_fast(values: Iterable[Any],
               fast: Sequence[Any] | None = None,
               jax_versions: Sequence[Any] = ()) -> list[Any]:
  """``values`` for ``pytest.mark.parametrize``, all but some marked ``long``.

  Args:
    values: the cases; a tuple is one case of several arguments.
    fast: the cases kept in the fast tier; ``None``: the first one.
    jax_versions: long cases also marked ``jax_versions``.

  Returns:
    The cases in their order, the fast ones as given and the others as
    ``pytest.param(..., marks=pytest.mark.long)`` (and ``jax_versions``).

  Raises:
    ValueError: if ``fast`` or ``jax_versions`` names a case that is not
      among ``values`` (a renamed case would otherwise silently leave its
      tier), or ``jax_versions`` a fast one (the fast tier runs on every
      stack already).
  """
  values = list(values)
  kept = values[:1] if fast is None else list(fast)
  missing = [case for case in [*kept, *jax_versions] if case not in values]
  if missing or not kept:
    raise ValueError(f'fast cases {missing or kept} are not among {values}')
  if any(case in kept for case in jax_versions):
    raise ValueError(f'jax_versions {list(jax_versions)} names a fast case '
                     f'of {kept}')

  def long(case):
    marks = [pytest.mark.long]
    if case in jax_versions:
      marks.append(pytest.mark.jax_versions)
    return pytest.param(*(case if isinstance(case, tuple) else (case,)),
                        marks=marks)

  return [case if case in kept else long(case) for case in values]
