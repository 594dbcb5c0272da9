"""The layer-wise step's forward and hand-written backward over the layers.

Both backward passes take each layer's ``jax.vjp`` on its saved input (the
layer is recomputed, as with ``jax.checkpoint``) and hand every TACO weight's
gradient to its update at once, so the gradient dies inside the loop. They
return what they made, keyed by leaf: ``{key: Updated}`` for the TACO
leaves, ``{key: gradient}`` for the Adam leaves.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp

from taco_optax._src import kernels
from taco_optax._src import sharding
from taco_optax._src.layerwise import leaves as leaves_lib
from taco_optax._src.layerwise import ordering
from taco_optax._src.layerwise import winners

# layer_backward(layer_params, layer_input, d_output) -> (grads, d_input): one
#   layer's weight gradients and input cotangent (``vjp_backward`` for one
#   batch; ``accumulation.layer_backward`` for micro-batches).
LayerBackward = Callable[[Any, Any, Any], tuple[Any, Any]]
Key = leaves_lib.Key


def vjp_backward(run_layer: Callable[[Any, Any], Any]) -> LayerBackward:
  """The layer's backward pass on one batch: its ``jax.vjp``, recomputed.

  A nested ``jax.jit`` (so is the forward's layer, :func:`forward`): layers of
  one structure and shapes are traced and lowered once, not once per layer
  (on 30 unrolled SmolLM2 layers the step's tracing falls from 2.7 s to
  1.3 s). XLA inlines the calls before it optimises: the compiled program,
  its memory and its bits are the same.
  """
  @jax.jit
  def backward(layer_params, layer_input, d_output):
    _, layer_vjp = jax.vjp(run_layer, layer_params, layer_input)
    return layer_vjp(d_output)
  return backward


def forward(run_layer: Callable[[Any, Any], Any], hidden: Any, layers: Any,
            scan_layers: bool) -> tuple[Any, Any]:
  """``(output, layer inputs)``: the layers applied, each one's input kept."""
  if scan_layers:
    return jax.lax.scan(lambda h, p: (run_layer(p, h), h), hidden, layers)
  run_layer = jax.jit(run_layer)  # traced once (see vjp_backward)
  layer_inputs = []
  previous = hidden
  for layer_params in layers:
    layer_inputs.append(hidden)
    # A weight split over a mesh is gathered whole for its use, and XLA
    # issues every gather as early as it can, which keeps every layer's
    # whole weights alive through the forward. Reading the shards after the
    # previous layer's input lets one layer's gather run ahead (the one in
    # use and the next), no more.
    layer_params = ordering.ordered_after_if_sharded(layer_params, previous)
    previous = hidden
    hidden = run_layer(layer_params, hidden)
  return hidden, layer_inputs


def layer_leaves(step: leaves_lib.StepLeaves, layers: list[Any],
                 layer: int) -> list[leaves_lib.Leaf]:
  """The records of unrolled layer ``layer``'s leaves."""
  return step.of(layers[layer],
                 leaves_lib.LAYERS + (jax.tree_util.SequenceKey(layer),))


def unrolled(layer_backward: LayerBackward, layers: list[Any],
             step: leaves_lib.StepLeaves, layer_inputs: list[Any],
             d_hidden: Any):
  """Backward over a list of layers; each layer's update is forced in order.

  Args:
    layer_backward: one layer's backward pass (:data:`LayerBackward`).
    layers: the per-layer parameter trees.
    step: the step's leaf records.
    layer_inputs: each layer's saved input.
    d_hidden: the cotangent of the last layer's output.

  Returns:
    ``(d_hidden, updated, grads)``: the cotangent of the first layer's
    input, ``{key: Updated}`` of the layers' TACO leaves and ``{key:
    gradient}`` of their Adam leaves.
  """
  updated: dict[Key, Any] = {}
  grads: dict[Key, Any] = {}
  # The cotangent of the output of the layer after this one: see below.
  previous_d_hidden = d_hidden
  for l in reversed(range(len(layers))):
    # Recompute this layer from inputs that depend on a cotangent: XLA
    # turns optimization barriers into control edges and then CSEs the
    # recomputation with the forward pass, which would keep every layer's
    # activations alive. The cotangent is the one entering the layer above,
    # not this layer's own, so this layer's recomputation can run while the
    # layer above runs its backward pass (XLA:CPU runs independent kernels
    # side by side), at the cost of one layer's recomputation more alive
    # (docs/measured/performance_log.md, "Whole train steps").
    layer_input = ordering.ordered_after(layer_inputs[l], previous_d_hidden)
    # A weight split over a mesh is gathered whole for its use; the same
    # gather in the forward and here would be merged by XLA, keeping every
    # layer's whole weights alive from the forward to here. Reading the
    # shards after a cotangent makes this gather its own.
    layer_params = ordering.ordered_after_if_sharded(layers[l],
                                                     previous_d_hidden)
    previous_d_hidden = d_hidden
    layer_grads, d_hidden = layer_backward(layer_params, layer_input,
                                           d_hidden)
    written = []
    for leaf, param, grad in zip(layer_leaves(step, layers, l),
                                 jax.tree.leaves(layers[l]),
                                 jax.tree.leaves(layer_grads)):
      if leaf.plan is None:
        grads = leaves_lib.merged(grads, {leaf.key: grad})
        continue
      result = step.update(leaf, param, grad, after=d_hidden)
      updated = leaves_lib.merged(updated, {leaf.key: result})
      written.append(result.param)
    # The next layer's backward waits for this layer's update, so XLA cannot
    # postpone the updates (keeping every gradient alive) to the end. On a
    # mesh it waits for every update of the layer: XLA otherwise combines the
    # gradients' reductions of every layer into one at the end, keeping them
    # all alive (on one device waiting for one is enough, and waiting for
    # all made XLA:CPU keep more: docs/measured/mesh_memory.md).
    if any(sharding.explicit_sharding(p) is not None for p in written):
      d_hidden = ordering.ordered_after_all(d_hidden, written)
    elif written:
      d_hidden = ordering.ordered_after(d_hidden, written[0])
  return d_hidden, updated, grads


def _layer_slice(leaf: leaves_lib.Leaf, layer: jax.Array,
                 shape: tuple[int, ...]) -> leaves_lib.Leaf:
  """The record of slice ``x[layer]`` of a stacked TACO leaf."""
  take = lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)
  rounding = (None if leaf.rounding is None
              else leaf.rounding._replace(layer=layer))
  return leaf._replace(plan=winners.drop_leading_axis(leaf.plan, shape),
                       history=kernels.History(*map(take, leaf.history)),
                       rounding=rounding)


def scanned(layer_backward: LayerBackward, layers: Any,
            step: leaves_lib.StepLeaves, layer_inputs: Any, d_hidden: Any):
  """Backward ``lax.scan`` over stacked layers; weights updated in the carry.

  Same arguments and results as :func:`unrolled`, for ``layers`` whose leaves
  have a leading layer axis (and so do ``layer_inputs`` and the histories).
  """
  records = step.of(layers, leaves_lib.LAYERS)
  params, layer_def = jax.tree.flatten(layers)
  taco = [(leaf, p) for leaf, p in zip(records, params)
          if leaf.plan is not None]
  adam = [(leaf, p) for leaf, p in zip(records, params) if leaf.plan is None]
  num_layers = params[0].shape[0] if params else 0
  take = lambda x, l: jax.lax.dynamic_index_in_dim(x, l, keepdims=False)
  put = lambda x, v, l: jax.lax.dynamic_update_index_in_dim(x, v, l, 0)

  def body(carry, xs):
    d_hidden, weights, histories, squares = carry
    l, layer_input, adam_params = xs
    layer_params = {leaf.key: take(w, l) for (leaf, _), w in zip(taco,
                                                                   weights)}
    layer_params.update((leaf.key, p) for (leaf, _), p in zip(adam,
                                                              adam_params))
    layer_grads, d_hidden = layer_backward(
        layer_def.unflatten([layer_params[leaf.key] for leaf in records]),
        layer_input, d_hidden)
    grad_of = dict(zip((leaf.key for leaf in records),
                       jax.tree.leaves(layer_grads)))
    new_weights, new_histories, new_squares = [], [], []
    for (leaf, whole), weight, history, total in zip(taco, weights, histories,
                                                     squares):
      sliced = _layer_slice(leaf._replace(history=history), l, whole.shape)
      result = step.update(sliced, layer_params[leaf.key], grad_of[leaf.key],
                           whole=False)
      new_weights.append(put(weight, result.param, l))
      new_histories.append(kernels.History(*(
          put(s, u, l) for s, u in zip(history, result.history))))
      new_squares.append(total if result.square_sum is None
                         else total + result.square_sum)
    return ((d_hidden, new_weights, new_histories, new_squares),
            [grad_of[leaf.key] for leaf, _ in adam])

  carry = (d_hidden, [p for _, p in taco], [leaf.history for leaf, _ in taco],
           [jnp.zeros((), jnp.float32) for _ in taco])
  (d_hidden, weights, histories, squares), adam_grads = jax.lax.scan(
      body, carry, (jnp.arange(num_layers), layer_inputs,
                    [p for _, p in adam]), reverse=True)
  updated = {leaf.key: leaves_lib.Updated(
      w, h, s if step.sums_squares else None)
             for (leaf, _), w, h, s in zip(taco, weights, histories, squares)}
  grads = {leaf.key: g for (leaf, _), g in zip(adam, adam_grads)}
  return d_hidden, updated, grads
