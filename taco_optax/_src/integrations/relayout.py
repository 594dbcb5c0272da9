"""The same parameters in two tree layouts, and every state built from them.

An ``nnx.Optimizer`` holds its state in the layout of the model's parameter
``State``; the layer-wise step wants the same leaves as an ``(outer,
layers)`` pair. :class:`Relayout` moves a tree, and every parameter-shaped
subtree of an optax state (moments, TACO histories, ``MaskedNode`` trees of
``optax.partition``), from one layout to the other by a permutation of
leaves: no leaf is copied or changed, so a state restored from a checkpoint
of one layout runs in the other.
"""

import dataclasses
from typing import Any, Callable

import jax

from taco_optax._src import transform


def _structure(tree: Any) -> Any:
  return jax.tree.structure(tree, is_leaf=transform.is_masked)


@dataclasses.dataclass(frozen=True)
class Relayout:
  """A permutation of a tree's leaves into another tree structure.

  Attributes:
    source: the source layout's structure (``MaskedNode`` counted as leaves).
    target: the target layout's structure.
    order: ``order[j]`` is the source leaf that is target leaf ``j``.
  """
  source: Any
  target: Any
  order: tuple[int, ...]

  @classmethod
  def of(cls, tree: Any, split: Callable[[Any], Any]) -> 'Relayout':
    """The relayout that ``split`` (a structural rearrangement) makes.

    ``split`` must only pick subtrees of its argument (no arithmetic): it is
    applied to a tree of leaf numbers to read the permutation.
    """
    source = _structure(tree)
    numbered = source.unflatten(range(source.num_leaves))
    moved = split(numbered)
    order = tuple(jax.tree.leaves(moved))
    if sorted(order) != list(range(source.num_leaves)):
      raise ValueError('split must use every leaf of the tree exactly once.')
    return cls(source, jax.tree.structure(moved), order)

  def forward(self, tree: Any) -> Any:
    """``tree`` (source layout) in the target layout."""
    leaves = jax.tree.leaves(tree, is_leaf=transform.is_masked)
    return self.target.unflatten([leaves[i] for i in self.order])

  def backward(self, tree: Any) -> Any:
    """``tree`` (target layout) back in the source layout."""
    leaves = jax.tree.leaves(tree, is_leaf=transform.is_masked)
    out = [None] * len(leaves)
    for j, i in enumerate(self.order):
      out[i] = leaves[j]
    return self.source.unflatten(out)

  def forward_state(self, state: Any) -> Any:
    """Every source-shaped subtree of an optax ``state`` moved to target."""
    return self._move(state, self.source, self.forward)

  def backward_state(self, state: Any) -> Any:
    """Every target-shaped subtree of ``state`` moved back to source."""
    return self._move(state, self.target, self.backward)

  @staticmethod
  def _move(state, structure, move):
    def shaped(x):
      return transform.is_masked(x) or (
          not _is_leaf_value(x) and _structure(x) == structure)
    return jax.tree.map(
        lambda x: x if transform.is_masked(x) or _is_leaf_value(x) else move(x),
        state, is_leaf=shaped)


def _is_leaf_value(x: Any) -> bool:
  """An array or scalar (a state's counters), not a tree of them."""
  return jax.tree.structure(x) == jax.tree.structure(0)
