"""A loss's jaxpr as the layer-wise step reads it: who reads each value,
what depends on the parameters, and slices of it run as functions."""

import dataclasses
from typing import Any, Callable, Sequence

from taco_optax._src import routing

_internals = routing.jaxpr_internals


@dataclasses.dataclass
class Program:
  """A loss's jaxpr, its inputs the parameters' leaves then the batch's.

  Attributes:
    jaxpr: the loss's (open) jaxpr.
    consts: the values of its constants.
    num_params: how many of its inputs are parameter leaves.
    param_names: each parameter leaf's path, for messages.
  """
  jaxpr: Any
  consts: list[Any]
  num_params: int
  param_names: list[str]

  def __post_init__(self) -> None:
    jaxpr = self.jaxpr
    self.param_vars = list(jaxpr.invars[:self.num_params])
    self.batch_vars = list(jaxpr.invars[self.num_params:])
    self.param_index = {v: i for i, v in enumerate(self.param_vars)}
    self.produced_by = {v: i for i, e in enumerate(jaxpr.eqns)
                        for v in e.outvars
                        if not _internals.is_dropped(v)}
    self.readers: dict[Any, set] = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.invars:
        if not _internals.is_literal(v):
          self.readers.setdefault(v, set()).add(i)
    for v in jaxpr.outvars:
      if not _internals.is_literal(v):
        self.readers.setdefault(v, set()).add('output')
    self.depends = set(self.param_vars)
    for eqn in jaxpr.eqns:
      if any(v in self.depends for v in eqn.invars
             if not _internals.is_literal(v)):
        self.depends.update(eqn.outvars)

  def slice(self, targets: Sequence[Any], stop: int) -> list[Any]:
    """The equations among the first ``stop`` that ``targets`` need."""
    needed = {v for v in targets if not _internals.is_literal(v)}
    chosen = []
    for i in range(stop - 1, -1, -1):
      eqn = self.jaxpr.eqns[i]
      if any(v in needed for v in eqn.outvars):
        chosen.append(eqn)
        needed.update(v for v in eqn.invars
                      if not _internals.is_literal(v))
    return chosen[::-1]

  def function(self, eqns: Sequence[Any], params: Sequence[int],
               extra: Sequence[Any], outvars: Sequence[Any]) -> Callable:
    """``f(params leaves, batch leaves, extra values) -> [outvars]``."""
    invars = [*self.jaxpr.constvars, *(self.param_vars[i] for i in params),
              *self.batch_vars, *extra]
    run = _internals.function_of(eqns, invars, outvars)
    consts = self.consts
    return lambda p, b, x=(): run(*consts, *p, *b, *x)
