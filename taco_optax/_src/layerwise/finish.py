"""The layer-wise step's end: every leaf's result checked, Adam, the state.

Each piece of the step (the head, the layers, the embedding) returns what it
made keyed by leaf (``leaves.Key``). :func:`finish` checks that every TACO
leaf was updated exactly once and every Adam leaf has exactly one gradient,
each of its leaf's shape, and raises naming the leaves otherwise; then it runs
Adam on the Adam leaves, as ``optax.partition`` would, and packs the new
:func:`taco` state.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from taco_optax._src import routing
from taco_optax._src import transform
from taco_optax._src.layerwise import leaves as leaves_lib
from taco_optax._src.layerwise import winners

Key = leaves_lib.Key


def _shape_problem(name: str, what: str, got: Any, want: Any) -> list[str]:
  if jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(
      lambda x: (x.shape, x.dtype), want):
    return []
  shapes = lambda tree: [(x.shape, str(x.dtype)) for x in jax.tree.leaves(tree)]
  return [f'{name}: its {what} is {shapes(got)}, the leaf\'s is '
          f'{shapes(want)}']


def check(step: leaves_lib.StepLeaves, params: Any,
          updated: dict[Key, leaves_lib.Updated],
          grads: dict[Key, Any]) -> None:
  """Raises, naming the leaves, unless each TACO leaf has one update and
  each Adam leaf one gradient, of their shapes and dtypes."""
  problems = [f'{leaves_lib.name_of(key)}: not a leaf of the params'
              for key in (updated.keys() | grads.keys()) - step.leaves.keys()]
  arrays = dict(leaves_lib.keyed(params, ()))
  for key, leaf in step.leaves.items():
    if leaf.plan is None:
      if key in updated:
        problems.append(f'{leaf.name}: an Adam leaf got a TACO update')
      if key not in grads:
        problems.append(f'{leaf.name}: an Adam leaf got no gradient')
      else:
        problems += _shape_problem(leaf.name, 'gradient', grads[key],
                                   arrays[key])
      continue
    if key in grads:
      problems.append(f'{leaf.name}: a TACO leaf was handed to Adam')
    if key not in updated:
      problems.append(f'{leaf.name}: a TACO leaf was not updated')
      continue
    problems += _shape_problem(leaf.name, 'new value', updated[key].param,
                               arrays[key])
    problems += _shape_problem(leaf.name, 'new history', updated[key].history,
                               leaf.history)
  if problems:
    raise ValueError('the layer-wise step sent results to the wrong leaves:\n'
                     + '\n'.join(f'  {p}' for p in sorted(problems)))


def global_norm(step: leaves_lib.StepLeaves,
                updated: dict[Key, leaves_lib.Updated],
                grads: dict[Key, Any]) -> jax.Array:
  """The whole gradient's norm: the clipping pass's, or from every TACO
  leaf's ``sum(g**2)`` and the Adam leaves' (unclipped) ``grads``, in float32
  as ``optax.global_norm`` of float32 gradients."""
  if step.norm is not None:
    return step.norm
  missing = sorted(leaves_lib.name_of(key) for key, result in updated.items()
                   if result.square_sum is None)
  if missing:
    raise ValueError('the layer-wise step did not measure the gradient of '
                     + ', '.join(missing))
  # mypy: every result has its square_sum here: missing ones raised above.
  terms = [jnp.sum(result.square_sum) for result in updated.values()]  # type: ignore[arg-type]
  terms += [winners.square_sum(g) for g in grads.values()]
  return jnp.sqrt(sum(terms, jnp.zeros((), jnp.float32)))


def finish(step: leaves_lib.StepLeaves, params: Any, opt_state: Any,
           updated: dict[Key, leaves_lib.Updated], grads: dict[Key, Any],
           value: jax.Array) -> tuple[Any, ...]:
  """Adam on the (clipped) Adam leaves' ``grads``, then the step's
  ``(params, opt_state, value)``, and the global gradient norm last when
  ``step.measure``; ``updated`` holds every TACO leaf's."""
  check(step, params, updated, grads)
  norm = global_norm(step, updated, grads) if step.measure else None
  if step.clip is not None:
    grads = {key: step.clip(g) for key, g in grads.items()}
  treedef = jax.tree.structure(params)
  records = list(step.leaves.values())
  new_leaves = [updated[leaf.key].param if leaf.plan is not None else param
                for leaf, (_, param) in zip(records,
                                            leaves_lib.keyed(params, ()))]
  is_adam = lambda leaf: leaf.plan is None
  masked = lambda values: treedef.unflatten(
      [x if is_adam(leaf) else optax.MaskedNode()
       for leaf, x in zip(records, values)])
  adam_updates, adam_state = step.parts.adam.update(
      masked([grads.get(leaf.key) for leaf in records]), step.states.adam,
      masked(new_leaves))
  applied = jax.tree.leaves(optax.apply_updates(masked(new_leaves),
                                                adam_updates),
                            is_leaf=routing.is_masked)
  new_leaves = [a if is_adam(leaf) else x
                for leaf, x, a in zip(records, new_leaves, applied)]
  histories = [updated[leaf.key].history if leaf.plan is not None
               else leaf.history for leaf in records]
  result = (treedef.unflatten(new_leaves),
            _packed(step, opt_state, treedef, histories, adam_state), value)
  return result if norm is None else result + (norm,)


def _packed(step: leaves_lib.StepLeaves, opt_state: Any, treedef: Any,
            histories: list[Any], adam_state: Any) -> Any:
  """The new :func:`taco` state from every leaf's history."""
  states = step.states
  _, learning_rate_state = step.parts.learning_rate.update(
      None, states.learning_rate)
  rounding = (None if states.rounding is None
              else transform.advanced(states.rounding))
  return transform.with_taco_states(opt_state, transform.TacoStates(
      direction=transform.taco_state(treedef, histories),
      learning_rate=learning_rate_state, adam=adam_state, rounding=rounding))
