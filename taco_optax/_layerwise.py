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
"""

from typing import Any, Callable, NamedTuple

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import optax

from taco_optax import _alias
from taco_optax import _backward
from taco_optax import _leaf
from taco_optax import _leaf_update
from taco_optax import _table_update
from taco_optax import _token_table
from taco_optax import _transform
from taco_optax._layered_loss import LayeredLoss

Params = Any
Batch = Any


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


def _sum_grads(a, b):
  if a is None or b is None:
    return b if a is None else a
  return a + b


def _refuse_table_reads(fn: Callable[[Any], Any], outer: Any, path,
                        what: str) -> None:
  """Raises if ``fn(outer)`` reads the token table at ``path``."""
  if _used_inputs(fn, outer)[_token_table.leaf_index(outer, path)]:
    raise ValueError(
        f'{what} reads the token table; its gradient would be missed. Read '
        'the table only through the lookup and the projection.')


def _head_backward(head, outer, hidden, batch):
  """``(value, outer grads, d_hidden, {leaf: TableGradient})`` of the head.
  """
  if isinstance(head, _token_table.TableProjection):
    _refuse_table_reads(lambda o: head.features(o, hidden, batch), outer,
                        head.table, 'TableProjection.features')
    value, grads, d_hidden, index, table = _token_table.head_backward(
        head, outer, hidden, batch)
    return value, grads, d_hidden, {index: table}
  value, head_vjp = jax.vjp(lambda o, h: head(o, h, batch), outer, hidden)
  outer_grads, d_hidden = head_vjp(jnp.ones_like(value))
  return value, jax.tree.leaves(outer_grads), d_hidden, {}


def _embed_backward(embed, outer, batch, d_hidden):
  """``(outer grads, {leaf: (ids, d_rows)})`` of the embedding."""
  if isinstance(embed, _token_table.TableLookup):
    rows = embed.gather(_token_table.table_at(outer, embed.table),
                        embed.ids(batch))
    _refuse_table_reads(lambda o: embed.apply(o, rows, batch), outer,
                        embed.table, 'TableLookup.apply')
    grads, index, ids, d_rows = _token_table.embed_backward(embed, outer,
                                                            batch)(d_hidden)
    return grads, {index: (ids, d_rows)}
  _, embed_vjp = jax.vjp(lambda o: embed(o, batch), outer)
  (grads,) = embed_vjp(d_hidden)
  return jax.tree.leaves(grads), {}


def _tied_table(loss, outer, tables, batch):
  """``(leaf, ids)`` of a table that the lookup and the projection share."""
  if not isinstance(loss.embed, _token_table.TableLookup):
    return None
  index = _token_table.leaf_index(outer, loss.embed.table)
  return (index, loss.embed.ids(batch)) if index in tables else None


def layerwise_train_step(loss: LayeredLoss, *taco_args: Any,
                         **taco_kwargs: Any) -> LayerwiseTrainStep:
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

  Takes the arguments of :func:`taco` after ``loss`` and builds the same
  transformation (:func:`taco_parts`); the new params and state
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
    *taco_args: the positional arguments of :func:`taco` (``learning_rate``,
      ``k``, ``mu``).
    **taco_kwargs: its keyword arguments; ``weight_dimension_numbers`` is a
      tree prefix of, or a callable of, the params pair ``(outer, layers)``.

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
  optimizer = _alias.taco(*taco_args, **taco_kwargs)
  parts = _alias.taco_parts(*taco_args, **taco_kwargs)
  update_topk = 1 if parts.update_topk is None else parts.update_topk

  def step(params, opt_state, batch):
    outer, layers = params
    plans = _leaf.leaf_plans(params, parts.dimension_numbers,
                             parts.update_scale, update_topk)
    num_outer = len(jax.tree.leaves(outer))
    states = _alias.taco_states(opt_state)
    # Per leaf: (values, indices, exponents), MaskedNodes for non-TACO leaves.
    leaf_states = list(zip(*(_flatten(s) for s in states.direction)))

    def update(param, grad, state, plan, after=None):
      return _leaf_update.taco_leaf_update(
          param, grad, *state, plan=plan, mu=parts.mu,
          lr_tx=parts.learning_rate, lr_state=states.learning_rate,
          after=after)

    # Forward, keeping each layer's input (the only saved activations).
    run_layer = lambda p, h: loss.layer(p, h, batch)
    hidden_out, layer_inputs = _backward.forward(
        run_layer, loss.embed(outer, batch), layers, loss.scan_layers)
    value, outer_grads, d_hidden, tables = _head_backward(loss.head, outer,
                                                          hidden_out, batch)
    outer_leaves = jax.tree.leaves(outer)
    new_leaves = list(jax.tree.leaves(params))
    new_states = list(leaf_states)

    def update_outer(i, grad):
      new_leaves[i], *new_state = update(outer_leaves[i], grad,
                                         leaf_states[i], plans[i])
      new_states[i] = tuple(new_state)

    # A TACO matrix the embedding does not use (an untied LM head) has its
    # whole gradient now: update it before the layers, so that gradient dies.
    embed_uses = _used_inputs(lambda o: loss.embed(o, batch), outer)
    early = [i for i in range(num_outer)
             if plans[i] is not None and not embed_uses[i]]
    for i in early:
      update_outer(i, tables.get(i, outer_grads[i]))
      d_hidden = jax.tree.map(
          lambda x, i=i: _leaf_update.data_dependency(x, new_leaves[i]),
          d_hidden)

    # A tied table: select among the rows outside the batch's tokens now, so
    # the logits' cotangent dies before the layers (_table_update).
    tied = _tied_table(loss, outer, tables, batch)
    two_phase = tied is not None and plans[tied[0]] is not None
    if two_phase:
      i, ids = tied
      two_phase = _table_update.applies(outer_leaves[i], tables[i], plans[i],
                                        ids, leaf_states[i][0].shape[-2])
    if two_phase:
      kept = _table_update.head_phase(tables.pop(i), ids, outer_leaves[i],
                                      leaf_states[i], plans[i], parts.mu)
      d_hidden = jax.tree.map(
          lambda x: _leaf_update.data_dependency(x, kept[2].values), d_hidden)

    backward = (_backward.scanned if loss.scan_layers
                else _backward.unrolled)
    d_hidden, layer_leaves, layer_states, layer_grads = backward(
        run_layer, layers, plans[num_outer:], layer_inputs, d_hidden,
        leaf_states[num_outer:], update)
    new_leaves[num_outer:] = layer_leaves
    new_states[num_outer:] = layer_states

    embed_grads, lookups = _embed_backward(loss.embed, outer, batch,
                                           d_hidden)
    for i, (ids, d_rows) in lookups.items():
      if two_phase and i == tied[0]:
        new_leaves[i], *state = _table_update.update(
            outer_leaves[i], kept, loss.embed.gather, d_rows, leaf_states[i],
            plans[i], parts.mu, parts.learning_rate, states.learning_rate)
        new_states[i] = tuple(state)
        continue
      table = _token_table.lookup_gradient(loss.embed, outer_leaves[i], ids,
                                           d_rows)
      tables[i] = table.plus(tables.get(i) if i not in early else None)
    outer_grads = [_sum_grads(g, e) if i not in early else g
                   for i, (g, e) in enumerate(zip(outer_grads, embed_grads))]
    for i in range(num_outer):
      if i in tables and (plans[i] is None or i not in early):
        outer_grads[i] = tables[i] if plans[i] is not None else (
            tables[i].dense())
      if plans[i] is not None and i not in early and not (
          two_phase and i == tied[0]):
        update_outer(i, outer_grads[i])

    # Adam on the non-TACO leaves, as optax.partition would run it.
    is_adam = [plan is None for plan in plans]
    mask = lambda xs: jax.tree.structure(params).unflatten(
        [x if a else optax.MaskedNode() for x, a in zip(xs, is_adam)])
    adam_updates, adam_state = parts.adam.update(
        mask(outer_grads + layer_grads), states.adam, mask(new_leaves))
    adam_params = _flatten(optax.apply_updates(mask(new_leaves),
                                               adam_updates))
    new_leaves = [u if a else p
                  for p, u, a in zip(new_leaves, adam_params, is_adam)]

    _, lr_state = parts.learning_rate.update(None, states.learning_rate)
    masked_def = jax.tree.structure(states.direction.values,
                                    is_leaf=_is_masked)
    direction_state = _transform.TacoState(
        *(masked_def.unflatten(field) for field in zip(*new_states)))
    opt_state = _alias.with_taco_states(
        opt_state, _alias.TacoStates(direction_state, lr_state, adam_state))
    return (jax.tree.structure(params).unflatten(new_leaves), opt_state,
            value)

  return LayerwiseTrainStep(optimizer, step)
