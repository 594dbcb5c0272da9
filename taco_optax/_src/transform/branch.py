"""TACO's branch of :func:`taco`: direction, learning rate and 16-bit rounding.

The branch is ``chain(scale_by_taco, scale_by_learning_rate,
stochastic_rounding)``. Chained, the rounding hashes and rounds every element
of every 16-bit update, although TACO's update is zero everywhere but at each
column's ``r`` winners and rounding ``p + 0`` gives ``p``: for an ``m x n``
matrix, ``m n`` random draws where ``r n`` decide anything. :func:`taco_branch`
runs the same pieces in one update and, for a 16-bit leaf on one device,
rounds only its winners, with the same random bits (each element's from its
flat index, as ``stochastic_rounding`` draws them): its updates and states are
the chain's bit for bit. A leaf split over a mesh, and every leaf when no
leaf is 16-bit, goes the chain's way.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from taco_optax._src import kernels
from taco_optax._src import routing
from taco_optax._src import sharding
from taco_optax._src.transform import rounding as rounding_lib
from taco_optax._src.transform import scale


def _rounds_winners(param: Any, grad: Any, plan: Any) -> bool:
  """Whether a leaf's 16-bit update is rounded at its winners only."""
  return (plan is not None and not routing.is_masked(param) and grad.size > 0
          and rounding_lib.is_low_precision(param.dtype)
          and sharding.leaf_sharding_of(grad, plan.axes(grad.shape)) is None)


def _winner_update(param: jax.Array, step: kernels.ColumnStep,
                   layout: Any, delta: jax.Array, key: jax.Array
                   ) -> jax.Array:
  """The rounded update of a 16-bit ``param`` whose winners add ``delta``
  (``(N, r)``): ``+0`` elsewhere, all NaN for a non-finite gradient."""
  rows = layout.to_rows(param)
  row_ids = jnp.arange(rows.shape[0], dtype=jnp.int32)[:, None]
  winners = step.winner_indices
  current = jnp.take_along_axis(rows, winners, axis=1)
  bits = rounding_lib.element_bits(key, rounding_lib.flat_index(
      param.shape, layout.element_coords(param.shape, row_ids, winners)))
  rounded = rounding_lib.rounded_update(current, delta, bits)
  dense = scale.one_sparse_rows(winners, rounded, layout.m, param.dtype)
  dense = jnp.where(step.finite, dense, jnp.nan)
  return layout.from_rows(dense, param.shape)


def taco_branch(direction: scale.TacoDirection,
                learning_rate: optax.GradientTransformation,
                rounding: Optional[optax.GradientTransformation],
                rounding_seed: int) -> optax.GradientTransformation:
  """``chain(direction, learning_rate[, rounding])``, rounding only winners.

  Args:
    direction: :func:`scale_by_taco` as it runs in the branch.
    learning_rate: ``optax.scale_by_learning_rate``.
    rounding: :func:`stochastic_rounding` (of ``rounding_seed``), or ``None``
      (the branch is then the chain of the first two).
    rounding_seed: its seed.

  Returns:
    A transformation with the chain's state and updates.
  """
  pieces = (direction.transformation, learning_rate) + (() if rounding is None
                                         else (rounding,))
  chained = optax.chain(*pieces)

  def update_fn(updates, state, params=None):
    if rounding is None or params is None:
      return chained.update(updates, state, params)
    leaves, treedef = jax.tree.flatten(updates, is_leaf=routing.is_masked)
    param_leaves = treedef.flatten_up_to(params)
    plans = iter(direction.plans(updates))
    plan_of = [None if routing.is_masked(g) else next(plans) for g in leaves]
    winners_only = [_rounds_winners(p, g, plan)
                    for p, g, plan in zip(param_leaves, leaves, plan_of)]
    if not any(winners_only):
      return chained.update(updates, state, params)
    direction_state, learning_rate_state, rounding_state = state
    grads_def = jax.tree.structure(updates)
    histories = scale.leaf_histories(direction_state, grads_def)
    # taco()'s update has compared the gradients with params already.
    scale.check_history_shapes(updates, histories, direction.plans(updates),
                               direction.k)
    next_history = iter(histories)
    directions, steps, new_histories = [], {}, []
    for i, (grad, plan) in enumerate(zip(leaves, plan_of)):
      if routing.is_masked(grad):
        continue
      history = next(next_history)
      assert plan is not None  # every unmasked leaf has a plan
      if winners_only[i]:
        layout = plan.local_layout(grad.shape)
        step, history = kernels.history_step(
            layout.to_rows(grad), history, update_topk=plan.update_topk,
            mu=direction.mu, implementation=plan.implementation)
        steps[i] = (step, layout)
        # What the chain's dense direction holds at the winners.
        directions.append((step.winner_signs * plan.scale).astype(grad.dtype))
      else:
        value, history = scale.leaf_direction(grad, history, plan,
                                              direction.mu)
        directions.append(value)
      new_histories.append(history)
    scaled, learning_rate_state = learning_rate.update(directions,
                                                       learning_rate_state)
    keys = rounding_lib.leaf_keys(rounding_seed, rounding_state.count,
                                  len(leaves))
    scaled = iter(scaled)
    out = []
    for i, (grad, param) in enumerate(zip(leaves, param_leaves)):
      if routing.is_masked(grad):
        out.append(grad)
      elif i in steps:
        out.append(_winner_update(param, *steps[i], next(scaled), keys[i]))
      else:
        out.append(rounding_lib.rounded_leaf_update(param, next(scaled),
                                                    keys[i]))
    new_direction = scale.taco_state(grads_def, new_histories)
    return treedef.unflatten(out), (new_direction, learning_rate_state,
                                    rounding_lib.advanced(rounding_state))

  return optax.GradientTransformation(chained.init, update_fn)
