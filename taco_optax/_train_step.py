"""A TACO train step that consumes each layer's gradient as backprop makes it.

``jax.jit(grad -> tx.update -> apply_updates)`` keeps every dense matrix
gradient alive until the optimizer runs (always so when layers are stacked in a
``lax.scan``), and ``scale_by_taco`` returns a dense, mostly-zero update per
matrix. Here the backward pass is written by hand, one layer at a time: each
layer's weight gradient goes through the same history step as the optax path
and the ``<= r`` winners of every column are written into the weight by a
scatter (``_leaf_update``), so only one layer's gradients are alive at once and
no dense update exists. The result equals the plain optax path with
:func:`taco` (tested).

The parameters outside the layers are updated in ``_outer_step`` (after the
head, and after the embedding's backward pass).
"""

from typing import Any, Callable

import jax
import optax

from taco_optax import _alias
from taco_optax import _backward
from taco_optax import _leaf_update
from taco_optax import _outer_step
from taco_optax import _rounding
from taco_optax import _transform
from taco_optax._layered_loss import LayeredLoss

Params = Any
Batch = Any
# step(params, opt_state, batch) -> (params, opt_state, loss)
TrainStep = Callable[[tuple[Params, Params], Any, Batch],
                     tuple[tuple[Params, Params], Any, jax.Array]]


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _flatten(tree: Any) -> list[Any]:
  return jax.tree.leaves(tree, is_leaf=_is_masked)


def train_step(loss: LayeredLoss,
               optimizer: optax.GradientTransformation) -> TrainStep:
  r"""A memory-lean train step for :func:`taco`: gradients die as they appear.

  The step runs the forward pass saving only each layer's input, then a
  hand-written backward pass over the layers in reverse (a ``lax.scan`` for
  stacked layers, a Python loop for unrolled ones). For each layer it takes
  ``jax.vjp`` of that layer alone (so layers are rematerialised, as with
  ``jax.checkpoint``), hands the dense weight gradient of every TACO matrix to
  the same per-column step as :func:`scale_by_taco`, and writes the ``r``
  winners of each column into the weight,

  .. math::
    W_{j, i^*_j} \leftarrow W_{j, i^*_j} - \eta\, s\, \mathrm{sign}(M_{t, j})_{i^*_j},

  inside the loop carry, so with donated ``params`` the weights are updated in
  place and the gradient of layer ``l`` is dead before layer ``l - 1`` starts.
  The parameters outside the layers (``outer``) and every non-TACO leaf (which
  are small) are updated at the end exactly as :func:`taco` does (AdamW).
  Peak memory is about the weights, the state, the saved layer inputs and one
  layer's (plus the outer parameters') gradients. A token table given through
  a :class:`TableLookup` embedding and a :class:`TableProjection` head never
  has a dense gradient: it is formed a block of columns at a time, and a tied
  table is selected in two phases (rows outside the batch's tokens at the
  head, the batch's rows after the layers), so nothing vocabulary-sized
  outlives the head.

  The new params and state equal the plain path ``jax.grad`` ->
  ``optimizer.update`` -> ``optax.apply_updates`` (bit for bit up to the
  floating-point order of the recomputed gradients), and ``optimizer.init``
  makes the state both take. One difference: when a gradient is not finite,
  the optax path sets the whole stacked leaf to NaN, this step only the
  offending layer slices (history is kept in both); neither is a step worth
  keeping.

  Stacked layers need ``weight_dimension_numbers`` that keep the leading layer
  axis a batch axis (e.g. ``TacoDimensionNumbers(1, 2)`` for ``(L, in, out)``
  kernels): by default :func:`taco` only treats rank-2 leaves as matrices.

  Args:
    loss: the model's loss as a :class:`LayeredLoss`.
    optimizer: the transformation :func:`taco` returned for the params pair
      ``(outer, layers)`` (its ``weight_dimension_numbers`` is a tree prefix
      of, or a callable of, that pair), not wrapped in another
      transformation: the step applies its pieces itself.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss)``, to be
    wrapped in ``jax.jit(step, donate_argnums=(0, 1))``.

  Raises:
    ValueError: if ``optimizer`` is not a :func:`taco` transformation.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import taco_optax
    >>> from taco_optax import layerwise
    >>> loss = layerwise.LayeredLoss(
    ...     embed=lambda outer, x: x @ outer['w_in'],
    ...     layer=lambda p, h, x: jnp.tanh(h @ p['w']) + p['b'],
    ...     head=lambda outer, h, x: jnp.mean((h @ outer['w_out']) ** 2))
    >>> outer = {'w_in': jnp.ones((3, 8)), 'w_out': jnp.ones((8, 2))}
    >>> layers = {'w': jnp.ones((4, 8, 8)) / 8, 'b': jnp.zeros((4, 8))}
    >>> matrix = taco_optax.TacoDimensionNumbers()
    >>> dims = ({'w_in': matrix, 'w_out': matrix},
    ...         {'w': taco_optax.TacoDimensionNumbers(1, 2), 'b': None})
    >>> tx = taco_optax.taco(1e-3, weight_dimension_numbers=dims)
    >>> step = jax.jit(layerwise.train_step(loss, tx), donate_argnums=(0, 1))
    >>> params = (outer, layers)
    >>> opt_state = tx.init(params)
    >>> params, opt_state, value = step(params, opt_state, jnp.ones((5, 3)))
    >>> params[1]['w'].shape
    (4, 8, 8)

  References:
    TACO: Ternary Absolute-max Column-wise One-sparse Optimizer for LLM
    Fine-Tuning, 2026 (Section 5, immediate gradient processing).
  """
  return step_from_parts(loss, _alias.parts_of(optimizer))


def step_from_parts(loss: LayeredLoss, parts: _alias.TacoParts) -> TrainStep:
  """:func:`train_step` from a :func:`taco` optimizer's :class:`TacoParts`.

  For callers that lay the same parameters out differently from the tree the
  optimizer was built for (``taco_optax.tunix`` re-lays a model's state as
  ``(outer, layers)``): ``parts.dimension_numbers`` and ``parts.update_scale``
  must then describe the ``(outer, layers)`` pair.
  """

  def step(params, opt_state, batch):
    outer, layers = params
    num_outer = len(jax.tree.leaves(outer))
    plans = parts.plans(params)
    states = _alias.taco_states(opt_state)
    # Per leaf: (values, indices, exponents), MaskedNodes for non-TACO leaves.
    leaf_states = list(zip(*(_flatten(s) for s in states.direction)))
    rounding = _leaf_rounding(parts, states, params)

    def update(i, param, grad, state, plan, after=None, layer=None):
      return _leaf_update.taco_leaf_update(
          param, grad, *state, plan=plan, mu=parts.mu,
          lr_tx=parts.learning_rate, lr_state=states.learning_rate,
          after=after, rounding=rounding(i, layer))

    context = _outer_step.Outer(loss, outer, batch, plans[:num_outer],
                                leaf_states[:num_outer], update, parts,
                                states, rounding)
    run_layer = lambda p, h: loss.layer(p, h, batch)

    # Forward, keeping each layer's input (the only saved activations).
    hidden, layer_inputs = _backward.forward(
        run_layer, loss.embed(outer, batch), layers, loss.scan_layers)
    head = _outer_step.after_head(context, hidden)
    backward = (_backward.scanned if loss.scan_layers
                else _backward.unrolled)
    d_hidden, layer_leaves, layer_states, layer_grads = backward(
        run_layer, layers, plans[num_outer:], layer_inputs, head.d_hidden,
        leaf_states[num_outer:],
        lambda i, *args, **kwargs: update(num_outer + i, *args, **kwargs))
    outer_leaves, outer_states, outer_grads = _outer_step.after_embedding(
        context, head, d_hidden)
    new_leaves, adam_state = _adam(parts, params, plans,
                                   outer_leaves + layer_leaves,
                                   outer_grads + layer_grads, states.adam)
    return (jax.tree.structure(params).unflatten(new_leaves),
            _pack(parts, opt_state, states, outer_states + layer_states,
                  adam_state), head.value)

  return step


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

  def rounding(i, layer=None):
    if states.rounding is None or not _rounding.is_low_precision(
        leaves[i].dtype):
      return None
    key = _rounding.leaf_key(parts.rounding_seed, states.rounding.count, i)
    return _leaf_update.LeafRounding(key, leaves[i].shape, layer)

  return rounding


def _pack(parts, opt_state, states, leaf_states, adam_state):
  """The new :func:`taco` state from the per-leaf TACO states."""
  _, lr_state = parts.learning_rate.update(None, states.learning_rate)
  masked_def = jax.tree.structure(states.direction.values, is_leaf=_is_masked)
  direction = _transform.TacoState(
      *(masked_def.unflatten(field) for field in zip(*leaf_states)))
  rounding = (None if states.rounding is None
              else _rounding.advanced(states.rounding))
  return _alias.with_taco_states(
      opt_state, _alias.TacoStates(direction, lr_state, adam_state, rounding))
