"""A routing helper's overrides, by path pattern, and its one refusal.

Every helper that reads TACO's axes from a framework's modules takes
``overrides={pattern: TacoDimensionNumbers or None}`` (``fnmatch`` patterns
over ``'/'``-joined parameter paths, the first match winning) and, when some
parameters' axes cannot be told, raises one ``ValueError`` naming all of them
and every pattern that matched nothing. Needs nothing beyond jax.
"""

import fnmatch
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

import jax

from taco_optax._src.routing import dimension_numbers as dn


def matching(name: str, overrides: Mapping[str, Any]) -> Optional[str]:
  """The first pattern of ``overrides`` that ``name`` matches, if any."""
  return next((pattern for pattern in overrides
               if fnmatch.fnmatchcase(name, pattern)), None)


def override_entry(pattern: str, value: Any) -> Any:
  """An override's value as a dimension-numbers entry that says so."""
  if value is None or isinstance(value, dn.ToAdam):
    return dn.ToAdam(f'override {pattern!r}')
  return dn.decided(value, f'override {pattern!r}')


def refusal(helper: str, refused: Sequence[str], unused: Sequence[str],
            example: str) -> str:
  """The message naming every refused parameter and unmatched pattern.

  Args:
    helper: the public function, ``'taco_optax.linen.dimension_numbers'``.
    refused: one line per parameter: ``'  path: shape (4, 8), reason'``.
    unused: override patterns that matched no parameter.
    example: a call of ``helper`` with an override, for the fix.
  """
  lines = [f'{helper} cannot tell the TACO axes of {len(refused)} '
           'parameter(s):', *refused,
           f'Say them by hand, e.g. {example} (patterns as fnmatch over '
           "'/'-joined paths; None sends a parameter to Adam)."
           ] if refused else []
  if unused:
    lines.append(f'These override patterns match no parameter: {list(unused)}.')
  return '\n'.join(lines)


class Overrides:
  """One helper call's overrides: which patterns matched, what was refused.

  A helper asks :meth:`entry` first for every parameter, notes what its rules
  cannot tell (:meth:`refuse`) or do not know (:meth:`unknown`), and ends
  with :meth:`finish`, which raises once for everything refused and every
  pattern that matched nothing, and logs the unknown ones once.
  """

  def __init__(self, helper: str, overrides: Mapping[str, Any],
               example: str):
    self.helper, self.example = helper, example
    self.patterns = dict(overrides or {})
    self.used: set[str] = set()
    self.refused: list[str] = []
    self.unknowns: list[str] = []

  def entry(self, name: str) -> tuple[Any, ...]:
    """``(entry,)`` if an override names ``name``, else ``()``."""
    pattern = matching(name, self.patterns)
    if pattern is None:
      return ()
    self.used.add(pattern)
    return (override_entry(pattern, self.patterns[pattern]),)

  def refuse(self, line: str) -> None:
    """A parameter no rule reads: ``'  path: shape (4, 8), reason'``."""
    self.refused.append(line)

  def unknown(self, name: str) -> None:
    """A matrix of a module without a rule, sent to Adam."""
    self.unknowns.append(name)

  def entries(self, tree: Any,
              decide: Callable[[str, tuple[Any, ...], Any], Any],
              is_leaf: Optional[Callable[[Any], bool]] = None) -> Any:
    """``tree`` with each leaf's entry: an override's where one names it,
    else ``decide(name, path, leaf)`` (which notes refusals and unknowns);
    then :meth:`finish`."""
    def entry(path, leaf):
      name = dn.path_name(path)
      override = self.entry(name)
      return override[0] if override else decide(name, path, leaf)

    found = jax.tree_util.tree_map_with_path(entry, tree, is_leaf=is_leaf)
    self.finish()
    return found

  def finish(self) -> None:
    """Raises for what was refused and unmatched; logs the unknown."""
    unused = [p for p in self.patterns if p not in self.used]
    if self.refused or unused:
      raise ValueError(refusal(self.helper, self.refused, unused,
                               self.example))
    if self.unknowns:
      logging.getLogger('taco_optax').warning(
          '%s: %d parameter(s) of rank >= 2 go to Adam, as no rule reads '
          'their axes from their module: %s. If they are matrices, give '
          'their axes in overrides={path pattern: '
          'TacoDimensionNumbers(reduction_axis, output_axis)}.', self.helper,
          len(self.unknowns), ', '.join(self.unknowns))
