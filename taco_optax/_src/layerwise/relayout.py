"""The same parameters in two tree layouts, every state built from them, and
the layer-wise step run on one layout for the other.

An ``nnx.Optimizer`` holds its state in the layout of the model's parameter
``State``; the layer-wise step wants the same leaves as an ``(outer,
layers)`` pair. :class:`Relayout` moves a tree, and every parameter-shaped
subtree of an optax state (moments, TACO histories, ``MaskedNode`` trees of
``optax.partition``), from one layout to the other by a permutation of
leaves: no leaf is copied or changed, so a state restored from a checkpoint
of one layout runs in the other. :func:`pair_parts` moves an optimizer's
per-leaf routing the same way (and the leaf index stochastic rounding keys
a leaf's bits by), and :func:`traced_step` runs the layer-wise
step of a plain loss (its blocks read by ``traced_loss``) on the user's tree.
"""

import dataclasses
from typing import Any, Callable, Optional

import jax
import optax

from taco_optax._src import routing
from taco_optax._src import transform
from taco_optax._src.layerwise import traced_loss


def _structure(tree: Any) -> Any:
  return jax.tree.structure(tree, is_leaf=routing.is_masked)


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
    leaves = jax.tree.leaves(tree, is_leaf=routing.is_masked)
    return self.target.unflatten([leaves[i] for i in self.order])

  def backward(self, tree: Any) -> Any:
    """``tree`` (target layout) back in the source layout."""
    leaves = jax.tree.leaves(tree, is_leaf=routing.is_masked)
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
      return routing.is_masked(x) or (
          not _is_leaf_value(x) and _structure(x) == structure)
    return jax.tree.map(
        lambda x: x if routing.is_masked(x) or _is_leaf_value(x) else move(x),
        state, is_leaf=shaped)


def _is_leaf_value(x: Any) -> bool:
  """An array or scalar (a state's counters), not a tree of them."""
  return jax.tree.structure(x) == jax.tree.structure(0)


def pair_parts(parts: transform.TacoParts, params: Any,
               relayout: Any) -> transform.TacoParts:
  """``parts`` of an optimizer built for ``params``, for its relayout.

  The dimension numbers and update scales are read per leaf of ``params``
  (the tree the optimizer was built for) and moved with the leaves.
  """
  dims = routing.leaf_dimension_numbers(parts.dimension_numbers, params)
  scales = transform.leaf_scales(parts.update_scale, params)
  pair_dims = relayout.target.unflatten([dims[i] for i in relayout.order])
  pair_scales = relayout.target.unflatten(
      [scales[i] for i in relayout.order])
  return parts._replace(dimension_numbers=lambda _: pair_dims,
                        update_scale=pair_scales,
                        adam=_on_source(parts.adam, relayout),
                        leaf_order=relayout.order)


def _on_source(tx: optax.GradientTransformation,
               relayout: Relayout) -> optax.GradientTransformation:
  """``tx`` (built for the source layout) taking and giving target-layout
  trees: run on the source layout, so its per-leaf randomness (stochastic
  rounding's bits, keyed by a leaf's index) is the optax path's."""

  def init_fn(params):
    return relayout.forward_state(tx.init(relayout.backward(params)))

  def update_fn(updates, state, params=None):
    updates, state = tx.update(
        relayout.backward(updates), relayout.backward_state(state),
        None if params is None else relayout.backward(params))
    return relayout.forward(updates), relayout.forward_state(state)

  return optax.GradientTransformation(init_fn, update_fn)


def traced_step(loss_fn: Callable[[Any, Any], jax.Array],
                parts: transform.TacoParts,
                make_step: Callable[..., Any],
                accumulation_steps: Optional[int]) -> Callable:
  """``step(params, opt_state, batch)`` on the user's tree: the loss's blocks
  read on the first call's shapes, the pair's step from ``make_step(loss,
  parts)``, params and every parameter-shaped subtree of the state re-laid
  there and back (no leaf copied)."""

  def step(params, opt_state, batch):
    one_batch = (batch if accumulation_steps is None else jax.tree.map(
        lambda x: x[0], batch))
    # Boxed parameters (Flax NNX Variables) are stepped as their values: a
    # state's masked leaves are unboxed (routing.without_masked_boxes), so
    # only the values give the params' and the state's subtrees one
    # structure. Boxes hold one array each: the leaves keep their order.
    pure_params = routing.unboxed(params)
    pure_state = routing.unboxed(opt_state)
    traced = traced_loss.layered_loss_of(loss_fn, params, one_batch)
    relayout = Relayout.of(pure_params, traced.split)
    pair_step = make_step(traced.loss, pair_parts(parts, params, relayout))
    new_params, new_state, *rest = pair_step(
        relayout.forward(pure_params), relayout.forward_state(pure_state),
        batch)
    return (_reboxed(params, relayout.backward(new_params)),
            _reboxed(opt_state, relayout.backward_state(new_state)), *rest)

  return step


def _reboxed(like: Any, values: Any) -> Any:
  """``values`` (``routing.unboxed`` of a tree like ``like``) in ``like``'s
  boxes."""
  return jax.tree.structure(like).unflatten(jax.tree.leaves(values))
