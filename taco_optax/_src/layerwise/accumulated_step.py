"""The layer-wise step on ``A`` micro-batches, layer-major (``accumulation``).

The outer leaves take the roles of :func:`outer.outer_roles` (no two-phase
table: the head's share of a tied table is accumulated whole): the early
ones are updated once the head's mean gradient is complete, the late ones
after the embedding's pass.
"""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from taco_optax._src import transform
from taco_optax._src.layerwise import accumulation
from taco_optax._src.layerwise import backward
from taco_optax._src.layerwise import clipping
from taco_optax._src.layerwise import finish
from taco_optax._src.layerwise import leaves as leaves_lib
from taco_optax._src.layerwise import micro_batch_table
from taco_optax._src.layerwise import ordering
from taco_optax._src.layerwise import outer as outer_lib
from taco_optax._src.layerwise.layered_loss import LayeredLoss

Key = leaves_lib.Key


def _mean_as(grad: Any, like: jax.Array, taco: bool = True) -> Any:
  """An accumulated mean (``None``: the leaf is read by nothing) in the
  leaf's dtype; a table's mean kept as factors stays so for a TACO leaf
  (its update forms it a block of columns at a time)."""
  if grad is None:
    return jnp.zeros_like(like)
  if isinstance(grad, micro_batch_table.MeanGradient):
    return grad if taco else grad.dense()
  return grad.astype(like.dtype)


def _layers(loss: LayeredLoss, step: leaves_lib.StepLeaves, layers: Any,
            layer_inputs: Any, d_hidden: Any, batches: Any):
  backward_pass = backward.scanned if loss.scan_layers else backward.unrolled
  return backward_pass(accumulation.layer_backward(loss.layer, batches),
                       layers, step, layer_inputs, d_hidden)


def accumulated_step(loss: LayeredLoss, parts: transform.TacoParts,
                     steps: int, clip_global_norm: Optional[float],
                     column_block_elements: int,
                     one_batch: Callable[..., Any],
                     with_grad_norm: bool = False) -> Callable[..., Any]:
  """The step on ``steps`` micro-batches; ``one_batch`` is the step on one
  batch, which ``steps == 1`` runs (and its memory)."""

  def step_fn(params, opt_state, batches):
    accumulation.check_micro_batches(batches, steps)
    if steps == 1:
      return one_batch(params, opt_state,
                       jax.tree.map(lambda x: x[0], batches))
    outer, layers = params
    first = jax.tree.map(lambda x: x[0], batches)
    embed_reads = outer_lib.read_keys(lambda o: loss.embed(o, first), outer)
    # Forward over the micro-batches, keeping each one's layer inputs.
    hidden, layer_inputs = backward.forward(
        accumulation.layer_forward(loss.layer, batches),
        accumulation.embed_forward(loss.embed, outer, batches), layers,
        loss.scan_layers)
    first_hidden = jax.tree.map(lambda x: x[0], hidden)
    head_reads = outer_lib.read_keys(
        lambda o: loss.head(o, first_hidden, first), outer)
    # A token table whose micro-batches' factors are smaller than its
    # float32 accumulator keeps them instead (micro_batch_table).
    factors = micro_batch_table.kept_as_factors(
        loss, outer, first_hidden, first, steps, head_reads)
    value, head_means, d_hidden = accumulation.head_means(
        loss.head, outer, hidden, batches, head_reads, column_block_elements,
        factors)
    clip = norm = None
    if clip_global_norm is not None:
      norm = clipping.accumulated_norm(
          loss, params, layer_inputs, d_hidden, batches, embed_reads,
          head_means, column_block_elements, factors)
      clip = clipping.clipper(norm, clip_global_norm)
      d_hidden = ordering.ordered_after(d_hidden, norm)
    step = leaves_lib.step_leaves(parts, params, opt_state, clip,
                                  column_block_elements,
                                  measure=with_grad_norm, norm=norm)
    roles = outer_lib.outer_roles(loss, step, outer, {}, first,
                                  two_phase_allowed=False)
    arrays = dict(leaves_lib.keyed(outer, leaves_lib.OUTER))
    # Each early leaf's mean dies with its update.
    early_grad = lambda key: _mean_as(head_means.pop(key, None), arrays[key])
    early, d_hidden = outer_lib.update_early(step, outer, roles.early,
                                             early_grad, d_hidden)
    d_hidden, layer_updates, layer_grads = _layers(
        loss, step, layers, layer_inputs, d_hidden, batches)
    means = accumulation.embed_means(loss.embed, outer, d_hidden, batches,
                                     embed_reads, head_means,
                                     column_block_elements, factors)
    grads = {key: _mean_as(means.get(key), x,
                           step.leaves[key].plan is not None)
             for key, x in arrays.items() if key not in early}
    late = {key: step.update(step.leaves[key], arrays[key], grads.pop(key))
            for key in roles.late}
    return finish.finish(step, params, opt_state,
                         leaves_lib.merged(early, late, layer_updates),
                         leaves_lib.merged(grads, layer_grads), value)

  return step_fn
