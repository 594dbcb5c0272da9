"""The layer-wise step's forward and hand-written backward over the layers.

Both backward passes take each layer's ``jax.vjp`` on its saved input (the
layer is recomputed, as with ``jax.checkpoint``) and hand every TACO weight's
gradient to ``update`` at once, so the gradient dies inside the loop. They
return new values; nothing is written into arguments.
"""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from taco_optax import _leaf
from taco_optax import _leaf_update

# update(leaf, param, grad, state, plan, after=None, layer=None)
#   -> (param, *state); ``leaf`` indexes the leaves of ``layers``, ``layer`` is
#   the slice of a stacked leaf.
LeafUpdate = Callable[..., tuple[jax.Array, ...]]
Plans = list[Optional[_leaf.LeafPlan]]
# layer_backward(layer_params, layer_input, d_output) -> (grads, d_input): one
#   layer's weight gradients and input cotangent (``vjp_backward`` for one
#   batch; ``_accumulation.layer_backward`` for micro-batches).
LayerBackward = Callable[[Any, Any, Any], tuple[Any, Any]]


def vjp_backward(run_layer: Callable[[Any, Any], Any]) -> LayerBackward:
  """The layer's backward pass on one batch: its ``jax.vjp``, recomputed."""
  def backward(layer_params, layer_input, d_output):
    _, layer_vjp = jax.vjp(run_layer, layer_params, layer_input)
    return layer_vjp(d_output)
  return backward


def forward(run_layer: Callable[[Any, Any], Any], hidden: Any, layers: Any,
            scan_layers: bool) -> tuple[Any, Any]:
  """``(output, layer inputs)``: the layers applied, each one's input kept."""
  if scan_layers:
    return jax.lax.scan(lambda h, p: (run_layer(p, h), h), hidden, layers)
  layer_inputs = []
  for layer_params in layers:
    layer_inputs.append(hidden)
    hidden = run_layer(layer_params, hidden)
  return hidden, layer_inputs


def unrolled(layer_backward: LayerBackward, layers: list[Any], plans: Plans,
             layer_inputs, d_hidden, states: list[Any], update: LeafUpdate):
  """Backward over a list of layers; each layer's update is forced in order.

  Args:
    layer_backward: one layer's backward pass (:data:`LayerBackward`).
    layers: the per-layer parameter trees.
    plans: one plan per leaf of ``layers`` (``None``: not a TACO leaf).
    layer_inputs: each layer's saved input.
    d_hidden: the cotangent of the last layer's output.
    states: each leaf's ``(values, indices, exponents)``.
    update: the per-leaf TACO update.

  Returns:
    ``(d_hidden, leaves, states, grads)``: the cotangent of the first layer's
    input, the new leaves and states of ``layers`` (flattened) and the
    gradients of the non-TACO leaves (``None`` for TACO leaves).
  """
  leaves = jax.tree.leaves(layers)
  new_leaves, new_states = list(leaves), list(states)
  grads_out = [None] * len(leaves)
  offsets = [0]
  for layer_params in layers:
    offsets.append(offsets[-1] + len(jax.tree.leaves(layer_params)))
  # The cotangent of the output of the layer after this one: see below.
  previous_d_hidden = d_hidden
  for l in reversed(range(len(layers))):
    # Recompute this layer from inputs that depend on a cotangent: XLA
    # turns optimization barriers into control edges and then CSEs the
    # recomputation with the forward pass, which would keep every layer's
    # activations alive (measured: +1 layer of weights' worth per layer).
    # The cotangent is the one entering the layer above, not this layer's
    # own, so this layer's recomputation can run while the layer above runs
    # its backward pass (XLA:CPU runs independent kernels side by side):
    # one layer's recomputation more alive (the example's default run:
    # 606.8 -> 617.7 MiB compiled, 91.7 -> 95.9 tokens/s; docs/example.md).
    layer_input = jax.tree.map(
        lambda x, after=previous_d_hidden: _leaf_update.data_dependency(
            x, after), layer_inputs[l])
    previous_d_hidden = d_hidden
    grads, d_hidden = layer_backward(layers[l], layer_input, d_hidden)
    updated = None
    for i, grad in enumerate(jax.tree.leaves(grads), start=offsets[l]):
      if plans[i] is None:
        grads_out[i] = grad
        continue
      new_leaves[i], *state = update(i, leaves[i], grad, states[i], plans[i],
                                     after=d_hidden)
      new_states[i] = tuple(state)
      updated = new_leaves[i] if updated is None else updated
    # The next layer's backward waits for this layer's update, so XLA cannot
    # postpone the updates (keeping every gradient alive) to the end.
    if updated is not None:
      d_hidden = jax.tree.map(
          lambda x, u=updated: _leaf_update.data_dependency(x, u), d_hidden)
  return d_hidden, new_leaves, new_states, grads_out


def scanned(layer_backward: LayerBackward, layers: Any, plans: Plans,
            layer_inputs, d_hidden, states: list[Any], update: LeafUpdate):
  """Backward ``lax.scan`` over stacked layers; weights updated in the carry.

  Same arguments and results as :func:`unrolled`, for ``layers`` whose leaves
  have a leading layer axis (and so do ``layer_inputs`` and the states).
  """
  leaves, layer_def = jax.tree.flatten(layers)
  slice_plans = [_leaf_update.drop_leading_axis(p, x.shape)
                 for p, x in zip(plans, leaves)]
  taco_ids = [i for i, p in enumerate(plans) if p is not None]
  adam_ids = [i for i, p in enumerate(plans) if p is None]
  num_layers = leaves[0].shape[0] if leaves else 0
  take = lambda x, l: jax.lax.dynamic_index_in_dim(x, l, keepdims=False)
  put = lambda x, v, l: jax.lax.dynamic_update_index_in_dim(x, v, l, 0)

  def body(carry, xs):
    d_hidden, weights, weight_states = carry
    l, layer_input, adam_params = xs
    layer_leaves = [None] * len(leaves)
    for i, w in zip(taco_ids, weights):
      layer_leaves[i] = take(w, l)
    for i, p in zip(adam_ids, adam_params):
      layer_leaves[i] = p
    grads, d_hidden = layer_backward(layer_def.unflatten(layer_leaves),
                                     layer_input, d_hidden)
    grads = jax.tree.leaves(grads)
    new_weights, new_weight_states = [], []
    for i, weight, state in zip(taco_ids, weights, weight_states):
      new_slice, *new_state = update(
          i, layer_leaves[i], grads[i], tuple(take(s, l) for s in state),
          slice_plans[i], layer=l)
      new_weights.append(put(weight, new_slice, l))
      new_weight_states.append(tuple(put(s, u, l)
                                     for s, u in zip(state, new_state)))
    return ((d_hidden, new_weights, new_weight_states),
            [grads[i] for i in adam_ids])

  carry = (d_hidden, [leaves[i] for i in taco_ids],
           [states[i] for i in taco_ids])
  (d_hidden, weights, weight_states), adam_grads = jax.lax.scan(
      body, carry,
      (jnp.arange(num_layers), layer_inputs, [leaves[i] for i in adam_ids]),
      reverse=True)
  new_leaves, new_states = list(leaves), list(states)
  grads_out = [None] * len(leaves)
  for i, weight, state in zip(taco_ids, weights, weight_states):
    new_leaves[i], new_states[i] = weight, state
  for i, grad in zip(adam_ids, adam_grads):
    grads_out[i] = grad
  return d_hidden, new_leaves, new_states, grads_out
