"""``--measure-landed``: the share of a run's updates that changed a weight.

A 16-bit weight changes only when its update survives rounding: rounded to
nearest, a bfloat16 weight of 0.02 keeps its value under any step below 6e-5.
Per step this counts the elements the optimizer moves in exact arithmetic
(*moved*) and those of them whose stored value changed (*landed*), in two
groups: the leaves TACO treats as matrices and the rest (norm scales and
biases, Adam's leaves in TACO), whatever the optimizer.

* optax path: *moved* are the nonzero entries of the same step's update
  computed again on float32 copies of the gradients and parameters (a second
  ``tx.update`` whose state is dropped; float32 parameters round nothing);
  *landed* those of them whose parameter changed.
* layer-wise TACO step (no dense update exists): a TACO step moves ``r``
  entries of each column of every matrix and Adam every element of the other
  leaves, whenever the learning rate is not 0 (*moved*, counted from the
  shapes); *landed* the entries that changed.

It costs time and memory (the optax path runs the update twice; the
layer-wise step keeps the old parameters through the step to compare), so it
runs only when asked.
"""

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

GROUPS = ('matrices', 'vectors')


def _groups(params: Any, dimension_numbers: Callable) -> list[str]:
  """Each leaf's group: a TACO matrix or not."""
  treedef = jax.tree.structure(params)
  return [GROUPS[0] if dims is not None else GROUPS[1]
          for dims in treedef.flatten_up_to(dimension_numbers(params))]


def _by_group(groups: list[str], landed: list[jax.Array],
              moved: list[Any]) -> dict[str, jax.Array]:
  """``{group: [landed, moved]}`` summed over each group's leaves."""
  totals = {group: jnp.zeros((2,), jnp.float32) for group in GROUPS}
  for group, landed_here, moved_here in zip(groups, landed, moved):
    totals[group] += jnp.stack([landed_here, moved_here]).astype(jnp.float32)
  return totals


def _changed(before: Any, after: Any) -> list[jax.Array]:
  return [new != old for old, new in zip(jax.tree.leaves(before),
                                         jax.tree.leaves(after))]


def float32_updates(tx: optax.GradientTransformation, grads: Any,
                    opt_state: Any, params: Any, **extra_args) -> Any:
  """The step's updates as exact float32 arithmetic would apply them."""
  wide = lambda tree: jax.tree.map(
      lambda x: x.astype(jnp.float32)
      if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
  updates, _ = tx.update(wide(grads), opt_state, wide(params), **extra_args)
  return updates


def optax_counts(before: Any, after: Any, exact_updates: Any,
                 dimension_numbers: Callable) -> dict[str, jax.Array]:
  """One optax step's ``{group: [landed, moved]}``.

  Args:
    before: the parameters before the step.
    after: the parameters after it.
    exact_updates: :func:`float32_updates` of the step.
    dimension_numbers: params -> tree of TACO dimension numbers or ``None``.
  """
  moving = [update != 0 for update in jax.tree.leaves(exact_updates)]
  landed = [(changed & mask).sum() for changed, mask in
            zip(_changed(before, after), moving)]
  return _by_group(_groups(before, dimension_numbers), landed,
                   [mask.sum() for mask in moving])


def layerwise_moves(params: Any, dimension_numbers: Callable,
                    update_topk: int) -> dict[str, int]:
  """Elements a layer-wise TACO step moves per group (learning rate not 0):
  ``columns x r`` of each TACO matrix, every element of the other leaves."""
  treedef = jax.tree.structure(params)
  moves = {group: 0 for group in GROUPS}
  for leaf, dims in zip(jax.tree.leaves(params),
                        treedef.flatten_up_to(dimension_numbers(params))):
    if dims is None:
      moves[GROUPS[1]] += math.prod(leaf.shape)
      continue
    output = dims.output_axis
    output = (output,) if isinstance(output, int) else output
    rows = math.prod(leaf.shape[axis] for axis in output)
    moves[GROUPS[0]] += math.prod(leaf.shape) // rows * update_topk
  return moves


def changed_counts(before: Any, after: Any,
                   dimension_numbers: Callable) -> dict[str, jax.Array]:
  """``{group: [changed entries, 0]}`` of one step (moved counted apart)."""
  changed = [mask.sum() for mask in _changed(before, after)]
  return _by_group(_groups(before, dimension_numbers), changed,
                   [0] * len(changed))


class LandedCounts:
  """A run's landed and moved updates per group, carried over a resume.

  Args:
    totals: :meth:`totals` of the steps before a resume; ``None``: none.
  """

  def __init__(self, totals: Optional[dict] = None):
    totals = totals or {}
    self._totals = {group: [float(x) for x in totals.get(group, (0, 0))]
                    for group in GROUPS}

  def add(self, counts: dict[str, Any],
          moved: Optional[dict[str, int]] = None) -> None:
    """Adds one step's ``{group: [landed, moved]}``; ``moved`` replaces the
    moved counts (the layer-wise step's, counted from the shapes)."""
    for group in GROUPS:
      landed, moved_here = (float(x) for x in counts[group])
      self._totals[group][0] += landed
      self._totals[group][1] += moved_here if moved is None else moved[group]

  def totals(self) -> dict[str, list[float]]:
    """What a checkpoint keeps."""
    return {group: list(pair) for group, pair in self._totals.items()}

  def shares(self) -> dict[str, dict[str, float]]:
    """``{group: {'landed', 'moved', 'share'}}``; share ``None`` if none
    moved."""
    return {group: {'landed': landed, 'moved': moved,
                    'share': landed / moved if moved else None}
            for group, (landed, moved) in self._totals.items()}


class Measurement(NamedTuple):
  """What ``--measure-landed`` needs, and where its counts go.

  Attributes:
    dimension_numbers: params -> tree of TACO dimension numbers or ``None``
      (the groups; the layer-wise step's moves).
    update_topk: TACO's ``r``.
    schedule: the learning rate (a layer-wise step at rate 0 moves nothing).
    counts: the run's totals.
  """
  dimension_numbers: Callable
  update_topk: int
  schedule: optax.Schedule
  counts: LandedCounts


def summary(shares: Optional[dict]) -> str:
  """``'matrices 97.1%, vectors 1.3%'``, or how to measure it."""
  if shares is None:
    return 'not measured (--measure-landed)'
  return ', '.join(
      f'{group} ' + ('n/a' if entry['share'] is None
                     else f'{100 * entry["share"]:.1f}%')
      for group, entry in shares.items())
