"""A TACO train step that consumes each layer's gradient as backprop makes it.

``jax.jit(grad -> tx.update -> apply_updates)`` keeps every dense matrix
gradient alive until the optimizer runs (always so when layers are stacked in a
``lax.scan``), and ``scale_by_taco`` returns a dense, mostly-zero update per
matrix. Here the backward pass is written by hand, one layer at a time: each
layer's weight gradient is fed to the same ``column_step`` as the optax path
and the ``<= r`` winners of every column are written into the weight by a
scatter, so only one layer's gradients are alive at once and no dense update
exists. The result equals the plain optax path with :func:`taco` (tested).
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import optax

from taco_optax import _alias
from taco_optax import _dimension_numbers as dn
from taco_optax import _leaf_update
from taco_optax import _transform

Params = Any
Batch = Any
Hidden = Any


@dataclasses.dataclass(frozen=True)
class LayeredLoss:
  """A loss written as ``embed -> layer x L -> head``.

  The parameters are a pair ``(outer, layers)``: ``outer`` holds everything
  outside the repeated block (embeddings, final norm, LM head); ``layers`` is
  either one tree whose leaves have a leading layer axis (layers stacked for
  ``lax.scan`` / ``nnx.scan``) or a list of per-layer trees (unrolled).

  Attributes:
    embed: ``embed(outer, batch) -> hidden``.
    layer: ``layer(layer_params, hidden, batch) -> hidden``; ``hidden`` is an
      array or a pytree of float arrays.
    head: ``head(outer, hidden, batch) -> loss`` (a scalar).
    scan_layers: ``True`` if ``layers`` is stacked along a leading axis.
    remat: recompute each layer in the backward pass (as ``jax.checkpoint``
      would) in :meth:`__call__`; the layerwise step always does.
  """
  embed: Callable[[Params, Batch], Hidden]
  layer: Callable[[Params, Hidden, Batch], Hidden]
  head: Callable[[Params, Hidden, Batch], jax.Array]
  scan_layers: bool = True
  remat: bool = True

  def __call__(self, params: tuple[Params, Params], batch: Batch) -> jax.Array:
    """The loss, for the plain ``jax.grad`` + optax path."""
    outer, layers = params
    layer = lambda p, h: self.layer(p, h, batch)
    if self.remat:
      layer = jax.checkpoint(layer)
    hidden = self.embed(outer, batch)
    if self.scan_layers:
      hidden, _ = jax.lax.scan(lambda h, p: (layer(p, h), None), hidden,
                               layers)
    else:
      for layer_params in layers:
        hidden = layer(layer_params, hidden)
    return self.head(outer, hidden, batch)


class LayerwiseTrainStep(NamedTuple):
  """What :func:`layerwise_train_step` builds.

  Attributes:
    optimizer: the equivalent :func:`taco` transformation; its ``init`` makes
      the state that ``step`` takes, and it can run the plain optax path on
      the same state.
    step: ``step(params, opt_state, batch) -> (params, opt_state, loss)``,
      to be wrapped in ``jax.jit(step, donate_argnums=(0, 1))``.
  """
  optimizer: optax.GradientTransformation
  step: Callable[[tuple[Params, Params], Any, Batch],
                 tuple[tuple[Params, Params], Any, jax.Array]]


# The labels taco() gives its optax.partition branches.
_TACO, _ADAM = _alias._TACO, _alias._ADAM  # pylint: disable=protected-access


def _default_dimension_numbers(weight_dimension_numbers):
  """taco()'s rule: by default every rank-2 leaf is a TACO matrix."""
  if weight_dimension_numbers is not None:
    return weight_dimension_numbers
  return lambda params: jax.tree.map(
      lambda x: dn.TacoDimensionNumbers() if x.ndim == 2 else None, params)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _flatten(tree: Any) -> list[Any]:
  return jax.tree.leaves(tree, is_leaf=_is_masked)


def _used_inputs(fn: Callable[[Any], Any], tree: Any) -> list[bool]:
  """Which leaves of ``tree`` the traced ``fn(tree)`` reads at all."""
  jaxpr = jax.make_jaxpr(fn)(tree).jaxpr
  read = {v for eqn in jaxpr.eqns for v in eqn.invars
          if isinstance(v, jax_core.Var)}
  read |= {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
  return [v in read for v in jaxpr.invars]


def layerwise_train_step(
    loss: LayeredLoss,
    learning_rate: optax.ScalarOrSchedule,
    k: Optional[int] = 16,
    mu: Union[float, jax.Array] = 0.95,
    *,
    update_topk: Optional[int] = None,
    weight_dimension_numbers: dn.WeightDimNumOrFn | None = None,
    update_scale: _transform.ScaleTree = None,
    values_dtype: Any = None,
    index_dtype: Any = None,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
) -> LayerwiseTrainStep:
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
  layer's (plus the outer parameters') gradients.

  Same hyper-parameters and state as :func:`taco`; the new params and state
  equal the plain path ``jax.grad`` -> ``optimizer.update`` ->
  ``optax.apply_updates`` (bit for bit up to the floating-point order of the
  recomputed gradients). One difference: when a gradient is not finite, the
  optax path sets the whole stacked leaf to NaN, this step only the offending
  layer slices (history is kept in both); neither is a step worth keeping.

  Stacked layers need ``weight_dimension_numbers`` that keep the leading layer
  axis a batch axis (e.g. ``TacoDimensionNumbers(1, 2)`` for ``(L, in, out)``
  kernels): by default :func:`taco` only treats rank-2 leaves as matrices.

  Args:
    loss: the model's loss as a :class:`LayeredLoss`.
    learning_rate: see :func:`taco`.
    k: see :func:`taco`.
    mu: see :func:`taco`.
    update_topk: see :func:`taco`.
    weight_dimension_numbers: see :func:`taco`; a tree prefix of, or a callable
      of, the params pair ``(outer, layers)``.
    update_scale: see :func:`taco`.
    values_dtype: see :func:`taco`.
    index_dtype: see :func:`taco`.
    adam_learning_rate: see :func:`taco`.
    adam_b1: see :func:`taco`.
    adam_b2: see :func:`taco`.
    adam_eps: see :func:`taco`.
    adam_eps_root: see :func:`taco`.
    adam_weight_decay: see :func:`taco`.

  Returns:
    A :class:`LayerwiseTrainStep` ``(optimizer, step)``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import taco_optax
    >>> loss = taco_optax.LayeredLoss(
    ...     embed=lambda outer, x: x @ outer['w_in'],
    ...     layer=lambda p, h, x: jnp.tanh(h @ p['w']) + p['b'],
    ...     head=lambda outer, h, x: jnp.mean((h @ outer['w_out']) ** 2))
    >>> outer = {'w_in': jnp.ones((3, 8)), 'w_out': jnp.ones((8, 2))}
    >>> layers = {'w': jnp.ones((4, 8, 8)) / 8, 'b': jnp.zeros((4, 8))}
    >>> matrix = taco_optax.TacoDimensionNumbers()
    >>> dims = ({'w_in': matrix, 'w_out': matrix},
    ...         {'w': taco_optax.TacoDimensionNumbers(1, 2), 'b': None})
    >>> train = taco_optax.layerwise_train_step(
    ...     loss, learning_rate=1e-3, weight_dimension_numbers=dims)
    >>> params = (outer, layers)
    >>> opt_state = train.optimizer.init(params)
    >>> step = jax.jit(train.step, donate_argnums=(0, 1))
    >>> params, opt_state, value = step(params, opt_state, jnp.ones((5, 3)))
    >>> params[1]['w'].shape
    (4, 8, 8)

  References:
    TACO: Ternary Absolute-max Column-wise One-sparse Optimizer for LLM
    Fine-Tuning, 2026 (Section 5, immediate gradient processing).
  """
  optimizer = _alias.taco(
      learning_rate, k, mu, update_topk=update_topk,
      weight_dimension_numbers=weight_dimension_numbers,
      update_scale=update_scale, values_dtype=values_dtype,
      index_dtype=index_dtype, adam_learning_rate=adam_learning_rate,
      adam_b1=adam_b1, adam_b2=adam_b2, adam_eps=adam_eps,
      adam_eps_root=adam_eps_root, adam_weight_decay=adam_weight_decay)
  # The same pieces taco() chains, applied by hand.
  lr_tx = optax.scale_by_learning_rate(learning_rate)
  adam_tx = _alias._adam(  # pylint: disable=protected-access
      learning_rate if adam_learning_rate is None else adam_learning_rate,
      adam_b1, adam_b2, adam_eps, adam_eps_root, adam_weight_decay)
  update_topk = 1 if update_topk is None else update_topk

  def leaf_plans(params) -> list[_leaf_update.LeafPlan]:
    leaves = jax.tree.leaves(params)
    dims = dn.leaf_dimension_numbers(
        _default_dimension_numbers(weight_dimension_numbers), params)
    scales = _transform._leaf_scales(update_scale, params, len(leaves))  # pylint: disable=protected-access
    plans = []
    for leaf, dim, scale in zip(leaves, dims, scales):
      if dim is None:
        plans.append(_leaf_update.LeafPlan(None, 0.0))
        continue
      layout = dn.matrix_layout(leaf.shape, dim)
      plans.append(_leaf_update.LeafPlan(layout, layout.m / layout.n
                             if scale is None else scale, dim))
    return plans

  def step(params, opt_state, batch):
    outer, layers = params
    plans = leaf_plans(params)
    num_outer = len(jax.tree.leaves(outer))
    taco_state, lr_state = opt_state.inner_states[_TACO].inner_state
    state_leaves = [_flatten(s) for s in taco_state]  # values, indices, exps

    def taco_update(param, grad, index, plan, after=None):
      return _leaf_update.taco_leaf_update(
          param, grad, *(s[index] for s in state_leaves), plan, mu,
          update_topk, lr_tx, lr_state, after)

    # Forward, keeping each layer's input (the only saved activations).
    hidden = loss.embed(outer, batch)
    run_layer = lambda p, h: loss.layer(p, h, batch)
    if loss.scan_layers:
      hidden_out, layer_inputs = jax.lax.scan(
          lambda h, p: (run_layer(p, h), h), hidden, layers)
    else:
      layer_inputs = []
      hidden_out = hidden
      for layer_params in layers:
        layer_inputs.append(hidden_out)
        hidden_out = run_layer(layer_params, hidden_out)
    value, head_vjp = jax.vjp(lambda o, h: loss.head(o, h, batch), outer,
                              hidden_out)
    outer_grads, d_hidden = head_vjp(jnp.ones_like(value))

    outer_leaves, outer_def = jax.tree.flatten(outer)
    new_outer_leaves = list(outer_leaves)
    outer_grad_leaves = jax.tree.leaves(outer_grads)
    new_state = [list(s) for s in state_leaves]
    # A TACO matrix the embedding does not use (an untied LM head) has its
    # whole gradient now: update it before the layers, so that gradient dies.
    embed_uses = _used_inputs(lambda o: loss.embed(o, batch), outer)
    early = [i for i in range(num_outer)
             if plans[i].layout is not None and not embed_uses[i]]
    for i in early:
      new_outer_leaves[i], *updated = taco_update(
          outer_leaves[i], outer_grad_leaves[i], i, plans[i])
      for s, u in zip(new_state, updated):
        s[i] = u
      d_hidden = jax.tree.map(
          lambda x, i=i: _leaf_update.data_dependency(x, new_outer_leaves[i]),
          d_hidden)

    layer_leaves, layer_def = jax.tree.flatten(layers)
    layer_plans = plans[num_outer:]
    new_layer_leaves = list(layer_leaves)
    layer_grads = [None] * len(layer_leaves)  # non-TACO leaves only

    if loss.scan_layers:
      d_hidden, new_layer_leaves, layer_grads = _scanned_backward(
          run_layer, layer_leaves, layer_def, layer_plans, layer_inputs,
          d_hidden, [s[num_outer:] for s in state_leaves],
          lambda *a: _leaf_update.taco_leaf_update(*a, mu, update_topk, lr_tx,
                                                   lr_state),
          new_state, num_outer)
    else:
      d_hidden = _unrolled_backward(
          run_layer, layers, layer_def, layer_plans, layer_inputs, d_hidden,
          taco_update, new_layer_leaves, layer_grads, new_state, num_outer)

    _, embed_vjp = jax.vjp(lambda o: loss.embed(o, batch), outer)
    (embed_grads,) = embed_vjp(d_hidden)
    outer_grad_leaves = [
        g if i in early else g + e for i, (g, e) in enumerate(
            zip(outer_grad_leaves, jax.tree.leaves(embed_grads)))]
    for i, (param, grad) in enumerate(zip(outer_leaves, outer_grad_leaves)):
      if plans[i].layout is not None and i not in early:
        new_outer_leaves[i], *updated = taco_update(param, grad, i, plans[i])
        for s, u in zip(new_state, updated):
          s[i] = u

    # AdamW on the non-TACO leaves, as optax.partition would run it.
    all_leaves = new_outer_leaves + new_layer_leaves
    grads = outer_grad_leaves + layer_grads
    is_adam = [p.layout is None for p in plans]
    mask = lambda xs: [x if a else optax.MaskedNode()
                       for x, a in zip(xs, is_adam)]
    params_def = jax.tree.structure(params)
    adam_state = opt_state.inner_states[_ADAM].inner_state
    adam_updates, adam_state = adam_tx.update(
        params_def.unflatten(mask(grads)), adam_state,
        params_def.unflatten(mask(all_leaves)))
    updated = optax.apply_updates(params_def.unflatten(mask(all_leaves)),
                                  adam_updates)
    all_leaves = [u if a else p for p, u, a in
                  zip(all_leaves, _flatten(updated), is_adam)]

    _, lr_state = lr_tx.update(None, lr_state)
    masked_def = jax.tree.structure(taco_state.values, is_leaf=_is_masked)
    taco_state = _transform.TacoState(*(masked_def.unflatten(s)
                                        for s in new_state))
    opt_state = opt_state._replace(inner_states={
        _TACO: opt_state.inner_states[_TACO]._replace(
            inner_state=(taco_state, lr_state)),
        _ADAM: opt_state.inner_states[_ADAM]._replace(
            inner_state=adam_state),
    })
    new_params = params_def.unflatten(all_leaves)
    return new_params, opt_state, value

  return LayerwiseTrainStep(optimizer, step)


def _unrolled_backward(run_layer, layers, layer_def, layer_plans,
                       layer_inputs, d_hidden, taco_update, new_layer_leaves,
                       layer_grads, new_state, num_outer):
  """Backward over a list of layers; each layer's update is forced in order."""
  offsets = [0]
  for layer_params in layers:
    offsets.append(offsets[-1] + len(jax.tree.leaves(layer_params)))
  del layer_def
  for l in reversed(range(len(layers))):
    # Recompute this layer from inputs that depend on the cotangent: XLA
    # turns optimization barriers into control edges and then CSEs the
    # recomputation with the forward pass, which would keep every layer's
    # activations alive (measured: +1 layer of weights' worth per layer).
    layer_params = layers[l]
    layer_input = jax.tree.map(
        lambda x: _leaf_update.data_dependency(x, d_hidden), layer_inputs[l])
    _, layer_vjp = jax.vjp(run_layer, layer_params, layer_input)
    grads, d_hidden = layer_vjp(d_hidden)
    updated_leaves = []
    for j, (param, grad) in enumerate(zip(jax.tree.leaves(layer_params),
                                          jax.tree.leaves(grads))):
      i = offsets[l] + j
      plan = layer_plans[i]
      if plan.layout is None:
        layer_grads[i] = grad
        new_layer_leaves[i] = param
        continue
      new_layer_leaves[i], *updated = taco_update(param, grad, num_outer + i,
                                                  plan, after=d_hidden)
      for s, u in zip(new_state, updated):
        s[num_outer + i] = u
      updated_leaves.append(i)
    # The next layer's backward waits for this layer's update, so XLA cannot
    # postpone the updates (keeping every gradient alive) to the end.
    if updated_leaves:
      first_updated = new_layer_leaves[updated_leaves[0]]
      d_hidden = jax.tree.map(
          lambda x: _leaf_update.data_dependency(x, first_updated), d_hidden)
  return d_hidden


def _scanned_backward(run_layer, layer_leaves, layer_def, layer_plans,
                      layer_inputs, d_hidden, layer_state, leaf_update,
                      new_state, num_outer):
  """Backward ``lax.scan`` over stacked layers; weights updated in the carry."""
  slice_plans = [_leaf_update.drop_leading_axis(p, x.shape)
                 for p, x in zip(layer_plans, layer_leaves)]
  taco_ids = [i for i, p in enumerate(layer_plans) if p.layout is not None]
  adam_ids = [i for i, p in enumerate(layer_plans) if p.layout is None]
  num_layers = layer_leaves[0].shape[0] if layer_leaves else 0
  take = lambda x, l: jax.lax.dynamic_index_in_dim(x, l, keepdims=False)
  put = lambda x, v, l: jax.lax.dynamic_update_index_in_dim(x, v, l, 0)

  def body(carry, xs):
    d_hidden, weights, state = carry
    l, layer_input, adam_params = xs
    leaves = [None] * len(layer_leaves)
    for i, w in zip(taco_ids, weights):
      leaves[i] = take(w, l)
    for i, p in zip(adam_ids, adam_params):
      leaves[i] = p
    _, layer_vjp = jax.vjp(run_layer, layer_def.unflatten(leaves),
                           layer_input)
    grads, d_hidden = layer_vjp(d_hidden)
    grads = jax.tree.leaves(grads)
    new_weights, new_state = [], [list(s) for s in state]
    for n, i in enumerate(taco_ids):
      new_slice, *updated = leaf_update(
          leaves[i], grads[i], *(take(s[n], l) for s in state),
          slice_plans[i])
      new_weights.append(put(weights[n], new_slice, l))
      for s, u in zip(new_state, updated):
        s[n] = put(s[n], u, l)
    return (d_hidden, new_weights, new_state), [grads[i] for i in adam_ids]

  weights = [layer_leaves[i] for i in taco_ids]
  state = [[s[i] for i in taco_ids] for s in layer_state]
  adam_params = [layer_leaves[i] for i in adam_ids]
  (d_hidden, weights, state), adam_grads = jax.lax.scan(
      body, (d_hidden, weights, state),
      (jnp.arange(num_layers), layer_inputs, adam_params), reverse=True)
  new_leaves = list(layer_leaves)
  layer_grads = [None] * len(layer_leaves)
  for n, i in enumerate(taco_ids):
    new_leaves[i] = weights[n]
    for s, u in zip(new_state, state):
      s[num_outer + i] = u[n]
  for n, i in enumerate(adam_ids):
    layer_grads[i] = adam_grads[n]
  return d_hidden, new_leaves, layer_grads
