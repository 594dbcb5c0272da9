"""Every parameter leaf of one layer-wise step: one record, keyed by path.

The step's params are a pair ``(outer, layers)``. Each leaf of it travels
through the step as a :class:`Leaf`, found by its :data:`Key` (its key path
in the pair, as ``jax.tree_util.tree_flatten_with_path`` gives it), never by
its position: the backward pass finds a layer's records from that layer's own
tree (:meth:`StepLeaves.of`), every piece of the step returns what it made
keyed the same way (``{key: Updated}`` for TACO leaves, ``{key: gradient}``
for Adam leaves), and ``finish`` checks that each leaf got exactly one result
of the right kind and shape, naming any that did not.
"""

import dataclasses
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax
import numpy as np

from taco_optax._src import kernels
from taco_optax._src import routing
from taco_optax._src import transform
from taco_optax._src.layerwise import token_table
from taco_optax._src.layerwise import weight_update
from taco_optax._src.layerwise import winners

Key = tuple[Any, ...]  # a key path in the params pair (outer, layers)
OUTER: Key = (jax.tree_util.SequenceKey(0),)
LAYERS: Key = (jax.tree_util.SequenceKey(1),)


def name_of(key: Key) -> str:
  """``'layers/3/attn/q_proj/kernel'`` for a key in the pair."""
  part = 'outer' if key[:1] == OUTER else 'layers'
  rest = routing.path_name(key[1:])
  return f'{part}/{rest}' if rest else part


def keyed(tree: Any, prefix: Key) -> Iterator[tuple[Key, Any]]:
  """``(key, leaf)`` of every leaf of ``tree``, a subtree at ``prefix``."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    yield prefix + tuple(path), leaf


class Leaf(NamedTuple):
  """One parameter leaf as the layer-wise step updates it.

  Attributes:
    key: its key path in the params pair.
    index: its position among the pair's leaves: the optax path's order,
      in which the global norm sums and rounding keys are folded.
    plan: its :class:`LeafPlan`; ``None`` for an Adam leaf.
    history: its TACO history (entries ``optax.MaskedNode`` for an Adam
      leaf).
    rounding: its stochastic rounding when it is a 16-bit leaf and ``taco``
      rounds stochastically, else ``None``.
  """
  key: Key
  # A field named like tuple.index (shadowing it), as callers read it.
  index: int  # type: ignore[assignment]
  plan: Optional[transform.LeafPlan]
  history: kernels.History
  rounding: Optional[winners.LeafRounding]

  @property
  def name(self) -> str:
    return name_of(self.key)


class Updated(NamedTuple):
  """A TACO leaf's new value and history (and its gradient's ``sum(g**2)``
  when the step measures the gradient norm)."""
  param: jax.Array
  history: kernels.History
  square_sum: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class StepLeaves:
  """Every leaf's record in one step, and how a TACO leaf is updated.

  Attributes:
    leaves: every :class:`Leaf`, by key, in the pair's leaf order.
    parts: the optimizer's :class:`TacoParts`.
    states: its pieces' states at the start of the step.
    clip: an elementwise transform of every gradient (clipping), or None.
    column_block_elements: ``train_step``'s argument.
    norm: the global gradient norm when the step returns it: the clipping
      pass's norm, or ``None`` while the leaves' ``sum(g**2)`` are summed
      as their gradients appear (``measure``).
    measure: whether the step returns the global gradient norm.
  """
  leaves: dict[Key, Leaf]
  parts: transform.TacoParts
  states: transform.TacoStates
  clip: Optional[Callable[[jax.Array], jax.Array]]
  column_block_elements: int
  norm: Optional[jax.Array] = None
  measure: bool = False

  @property
  def sums_squares(self) -> bool:
    """Whether each leaf's gradient gives its ``sum(g**2)`` (the norm is
    measured and no clipping pass has it already)."""
    return self.measure and self.norm is None

  def of(self, tree: Any, prefix: Key) -> list[Leaf]:
    """The records of ``tree``'s leaves, ``tree`` being the subtree of the
    pair at ``prefix`` (the outer params, one layer, the stacked layers)."""
    found = []
    for key, _ in keyed(tree, prefix):
      if key not in self.leaves:
        raise ValueError(f'the layer-wise step has no leaf {name_of(key)}; '
                         'the params pair changed structure within the step.')
      found.append(self.leaves[key])
    return found

  def update(self, leaf: Leaf, param: jax.Array, grad: Any,
             after: Any = None, whole: bool = True) -> Updated:
    """``leaf``'s TACO update on its (whole) gradient ``grad``.

    ``param`` and ``grad`` are the leaf's (or, with a sliced ``leaf`` and
    ``whole=False``, one layer slice's); ``after``: what its winners are
    ordered after.
    """
    if self.clip is not None:
      grad = (dataclasses.replace(grad, transform=self.clip)
              if isinstance(grad, token_table.TableGradient)
              else self.clip(grad))
    return Updated(*weight_update.taco_leaf_update(
        param, grad, leaf.history, winners.WinnerWrite(
            # mypy: only TACO leaves (plan set) are written.
            plan=leaf.plan, mu=self.parts.mu,  # type: ignore[arg-type]
            learning_rate=self.parts.learning_rate,
            learning_rate_state=self.states.learning_rate,
            block_elements=self.column_block_elements, after=after,
            rounding=leaf.rounding, measure=self.sums_squares,
            whole=whole)))


def step_leaves(parts: transform.TacoParts, params: Any, opt_state: Any,
                clip: Optional[Callable[[jax.Array], jax.Array]],
                column_block_elements: int, *, measure: bool = False,
                norm: Optional[jax.Array] = None) -> StepLeaves:
  """The :class:`StepLeaves` of ``params`` (the pair) and ``opt_state``;
  ``measure`` and ``norm`` as the fields."""
  states = transform.taco_states(opt_state)
  flat = list(keyed(params, ()))
  masked = jax.tree.structure(params, is_leaf=routing.is_masked)
  histories = transform.leaf_histories(states.direction, masked)
  keys = _rounding_keys(parts, states, [x for _, x in flat])
  leaves = {}
  for index, ((key, param), plan, history) in enumerate(
      zip(flat, parts.plans(params), histories)):
    rounding = None
    if keys is not None and transform.is_low_precision(param.dtype):
      rounding = winners.LeafRounding(keys[index], param.shape)
    leaves[key] = Leaf(key, index, plan, history, rounding)
  return StepLeaves(leaves, parts, states, clip, column_block_elements,
                    norm=norm if measure else None, measure=measure)


def _rounding_keys(parts: transform.TacoParts, states: transform.TacoStates,
                   params: list[jax.Array]) -> Optional[jax.Array]:
  """Every leaf's stochastic-rounding key (``(leaves, 2)``), or None.

  The keys the optax path's ``stochastic_rounding`` folds for the same
  leaves (by their index in the optimizer's tree, ``parts.leaf_order`` on a
  re-laid one), drawn only when some leaf is 16-bit and ``taco`` rounds
  stochastically.
  """
  if getattr(states.rounding, 'count', None) is None or not any(
      transform.is_low_precision(x.dtype) for x in params):
    return None
  keys = transform.leaf_keys(parts.rounding_seed, states.rounding.count,
                             len(params))
  if parts.leaf_order is not None:
    keys = keys[np.asarray(parts.leaf_order)]
  return keys


def merged(*results: dict[Key, Any]) -> dict[Key, Any]:
  """The union of the pieces' results; a key in two of them is an error."""
  out: dict[Key, Any] = {}
  for result in results:
    twice = out.keys() & result.keys()
    if twice:
      raise ValueError('the layer-wise step produced two results for '
                       + ', '.join(sorted(map(name_of, twice))))
    out.update(result)
  return out
