"""What every leaf's update reads in one layer-wise step, and the step's end.

:func:`leaves` gathers, once per step, each leaf's plan, TACO state and
rounding and the per-leaf update (:class:`Leaves`); :func:`finish` runs Adam
on the non-TACO leaves, as ``optax.partition`` would, and packs the new
:func:`taco` state.
"""

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import optax

from taco_optax._src import transform
from taco_optax._src.layerwise import weight_update
from taco_optax._src.layerwise import token_table


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _flatten(tree: Any) -> list[Any]:
  return jax.tree.leaves(tree, is_leaf=_is_masked)


class Leaves(NamedTuple):
  """What every leaf's update reads in one step."""
  num_outer: int
  plans: list[Any]
  states: transform.TacoStates
  leaf_states: list[Any]  # (values, indices, exponents); MaskedNode: Adam
  rounding: Callable[..., Any]
  update: Callable[..., tuple[jax.Array, ...]]


def leaves(parts, params, opt_state, clip=None) -> Leaves:
  """The step's :class:`Leaves` of ``params`` and ``opt_state``.

  ``clip``: an elementwise transform of every gradient (clipping), or None.
  """
  plans = parts.plans(params)
  states = transform.taco_states(opt_state)
  leaf_states = list(zip(*(_flatten(s) for s in states.direction)))
  rounding = _leaf_rounding(parts, states, params)

  def update(i, param, grad, state, plan, after=None, layer=None):
    if clip is not None:
      grad = (dataclasses.replace(grad, transform=clip)
              if isinstance(grad, token_table.TableGradient) else clip(grad))
    return weight_update.taco_leaf_update(
        param, grad, *state, plan=plan, mu=parts.mu,
        lr_tx=parts.learning_rate, lr_state=states.learning_rate,
        after=after, rounding=rounding(i, layer))

  return Leaves(len(jax.tree.leaves(params[0])), plans, states, leaf_states,
                rounding, update)


def finish(parts, params, opt_state, ctx, clip, leaves, grads, leaf_states,
           value):
  """Adam on the (clipped) non-TACO gradients, then the new params and state.

  ``leaves`` and ``leaf_states`` are every leaf's new value and TACO state
  (``grads``: the gradients of the Adam leaves, ``None`` at TACO leaves);
  returns the step's ``(params, opt_state, value)``.
  """
  if clip is not None:
    grads = [None if g is None else clip(g) for g in grads]
  new_leaves, adam_state = _adam(parts, params, ctx.plans, leaves, grads,
                                 ctx.states.adam)
  return (jax.tree.structure(params).unflatten(new_leaves),
          _pack(parts, opt_state, ctx.states, leaf_states, adam_state), value)


def _adam(parts, params, plans, leaves, grads, adam_state):
  """Adam on the non-TACO leaves, as ``optax.partition`` would run it."""
  is_adam = [plan is None for plan in plans]
  mask = lambda xs: jax.tree.structure(params).unflatten(
      [x if a else optax.MaskedNode() for x, a in zip(xs, is_adam)])
  updates, adam_state = parts.adam.update(mask(grads), adam_state,
                                          mask(leaves))
  updated = _flatten(optax.apply_updates(mask(leaves), updates))
  return ([u if a else p for p, u, a in zip(leaves, updated, is_adam)],
          adam_state)


def _leaf_rounding(parts, states, params):
  """``rounding(leaf, layer=None)``: the leaf's ``LeafRounding``, or None.

  Set for the 16-bit leaves when ``taco`` rounds stochastically; the key is
  the one the optax path's ``stochastic_rounding`` folds for the leaf.
  """
  leaves = jax.tree.leaves(params)
  keys = None
  if states.rounding is not None and any(
      transform.is_low_precision(x.dtype) for x in leaves):
    keys = transform.leaf_keys(parts.rounding_seed, states.rounding.count,
                               len(leaves))

  def rounding(i, layer=None):
    if keys is None or not transform.is_low_precision(leaves[i].dtype):
      return None
    return weight_update.LeafRounding(keys[i], leaves[i].shape, layer)

  return rounding


def _pack(parts, opt_state, states, leaf_states, adam_state):
  """The new :func:`taco` state from the per-leaf TACO states."""
  _, lr_state = parts.learning_rate.update(None, states.learning_rate)
  masked_def = jax.tree.structure(states.direction.values, is_leaf=_is_masked)
  direction = transform.TacoState(
      *(masked_def.unflatten(field) for field in zip(*leaf_states)))
  rounding = (None if states.rounding is None
              else transform.advanced(states.rounding))
  return transform.with_taco_states(
      opt_state, transform.TacoStates(direction, lr_state, adam_state, rounding))
