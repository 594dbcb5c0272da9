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

Each TACO leaf outside the layers has one role, fixed per step
(:class:`_OuterRoles`): *early* (not read by the embedding: updated right
after the head, so its gradient dies first), the *two-phase* tied token table
(``_table_update``), or *late* (updated after the embedding's backward).
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import optax

from taco_optax import _alias
from taco_optax import _backward
from taco_optax import _leaf_update
from taco_optax import _table_update
from taco_optax import _token_table
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


def _used_inputs(fn: Callable[[Any], Any], tree: Any) -> list[bool]:
  """Which leaves of ``tree`` the traced ``fn(tree)`` reads at all."""
  jaxpr = jax.make_jaxpr(fn)(tree).jaxpr
  read = {v for eqn in jaxpr.eqns for v in eqn.invars
          if isinstance(v, jax_core.Var)}
  read |= {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
  return [v in read for v in jaxpr.invars]


def _ordered_after(tree: Any, after: Any) -> Any:
  """``tree`` made to depend on ``after`` (see ``data_dependency``)."""
  return jax.tree.map(lambda x: _leaf_update.data_dependency(x, after), tree)


def _refuse_table_reads(fn: Callable[[Any], Any], outer: Any, path,
                        what: str) -> None:
  """Raises if ``fn(outer)`` reads the token table at ``path``."""
  if _used_inputs(fn, outer)[_token_table.leaf_index(outer, path)]:
    raise ValueError(
        f'{what} reads the token table; its gradient would be missed. Read '
        'the table only through the lookup and the projection.')


def _head_backward(head, outer, hidden, batch):
  """``(value, outer grads, d_hidden, {leaf: TableGradient})`` of the head."""
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


class _OuterRoles(NamedTuple):
  """When each TACO leaf outside the layers is updated in one step.

  Attributes:
    early: leaves the embedding does not read (an untied LM head): their
      whole gradient exists after the head, so they are updated then.
    two_phase: the tied token table selected in two phases, or ``None``.
    late: every other TACO leaf: updated after the embedding's backward.
  """
  early: tuple[int, ...]
  two_phase: Optional[int]
  late: tuple[int, ...]


def _outer_roles(loss: LayeredLoss, outer, plans, tables, states, batch
                 ) -> _OuterRoles:
  """Each outer TACO leaf's role (``plans``/``states`` are the outer ones)."""
  embed_reads = _used_inputs(lambda o: loss.embed(o, batch), outer)
  taco = [i for i, plan in enumerate(plans) if plan is not None]
  early = tuple(i for i in taco if not embed_reads[i])
  two_phase = None
  if isinstance(loss.embed, _token_table.TableLookup):
    i = _token_table.leaf_index(outer, loss.embed.table)
    if (i in tables and plans[i] is not None and _table_update.applies(
        jax.tree.leaves(outer)[i], tables[i], plans[i],
        loss.embed.ids(batch), states[i][0].shape[-2])):
      two_phase = i
  late = tuple(i for i in taco if i not in early and i != two_phase)
  return _OuterRoles(early, two_phase, late)


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
  parts = _alias.parts_of(optimizer)

  def step(params, opt_state, batch):
    outer, layers = params
    num_outer = len(jax.tree.leaves(outer))
    plans = parts.plans(params)
    states = _alias.taco_states(opt_state)
    # Per leaf: (values, indices, exponents), MaskedNodes for non-TACO leaves.
    leaf_states = list(zip(*(_flatten(s) for s in states.direction)))

    def update(param, grad, state, plan, after=None):
      return _leaf_update.taco_leaf_update(
          param, grad, *state, plan=plan, mu=parts.mu,
          lr_tx=parts.learning_rate, lr_state=states.learning_rate,
          after=after)

    context = _Outer(loss, outer, batch, plans[:num_outer],
                     leaf_states[:num_outer], update, parts, states)
    run_layer = lambda p, h: loss.layer(p, h, batch)

    # Forward, keeping each layer's input (the only saved activations).
    hidden, layer_inputs = _backward.forward(
        run_layer, loss.embed(outer, batch), layers, loss.scan_layers)
    head = _after_head(context, hidden)
    backward = (_backward.scanned if loss.scan_layers
                else _backward.unrolled)
    d_hidden, layer_leaves, layer_states, layer_grads = backward(
        run_layer, layers, plans[num_outer:], layer_inputs, head.d_hidden,
        leaf_states[num_outer:], update)
    outer_leaves, outer_states, outer_grads = _after_embedding(
        context, head, d_hidden)
    new_leaves, adam_state = _adam(parts, params, plans,
                                   outer_leaves + layer_leaves,
                                   outer_grads + layer_grads, states.adam)
    return (jax.tree.structure(params).unflatten(new_leaves),
            _pack(parts, opt_state, states, outer_states + layer_states,
                  adam_state), head.value)

  return step


class _Outer(NamedTuple):
  """What the outer parameters' updates read in one step."""
  loss: LayeredLoss
  outer: Params
  batch: Batch
  plans: list[Any]
  states: list[Any]
  update: Callable[..., tuple[jax.Array, ...]]
  parts: _alias.TacoParts
  opt_states: _alias.TacoStates

  @property
  def leaves(self) -> list[jax.Array]:
    return jax.tree.leaves(self.outer)


class _Head(NamedTuple):
  """The head's backward pass and the outer updates that ran after it.

  Attributes:
    value: the loss.
    d_hidden: the cotangent of the last layer's output (ordered after the
      updates).
    grads: the head's gradient of each outer leaf (``None`` at a table).
    tables: ``{leaf: TableGradient}`` of the tables still to update.
    roles: each outer TACO leaf's role.
    updated: ``{leaf: (param, *state)}`` of the early leaves.
    kept: phase 1 of the two-phase table (``_table_update.head_phase``).
  """
  value: jax.Array
  d_hidden: Any
  grads: list[Any]
  tables: dict[int, Any]
  roles: _OuterRoles
  updated: dict[int, tuple[jax.Array, ...]]
  kept: Any


def _after_head(context: _Outer, hidden: Any) -> _Head:
  """The head's backward pass, the early leaves and a tied table's phase 1."""
  loss, outer, batch = context.loss, context.outer, context.batch
  value, grads, d_hidden, tables = _head_backward(loss.head, outer, hidden,
                                                  batch)
  roles = _outer_roles(loss, outer, context.plans, tables, context.states,
                       batch)
  tables = dict(tables)
  updated, kept, leaves = {}, None, context.leaves
  # An untied LM head has its whole gradient now: update it before the
  # layers, so that gradient dies.
  for i in roles.early:
    grad = tables.pop(i) if i in tables else grads[i]
    updated[i] = context.update(leaves[i], grad, context.states[i],
                                context.plans[i])
    d_hidden = _ordered_after(d_hidden, updated[i][0])
  i = roles.two_phase
  if i is not None:
    # Select among the rows outside the batch's tokens now, so the logits'
    # cotangent dies before the layers.
    kept = _table_update.head_phase(
        tables.pop(i), loss.embed.ids(batch), leaves[i], context.states[i],
        context.plans[i], context.parts.mu)
    d_hidden = _ordered_after(d_hidden, kept[2].values)
  return _Head(value, d_hidden, grads, tables, roles, updated, kept)


def _after_embedding(context: _Outer, head: _Head, d_hidden: Any):
  """The embedding's backward pass and every remaining outer update.

  Returns:
    ``(leaves, states, grads)`` of the outer leaves: the new leaves and TACO
    states, and the gradients of the Adam leaves (``None`` for TACO leaves).
  """
  embed_grads, lookups = _embed_backward(context.loss.embed, context.outer,
                                         context.batch, d_hidden)
  leaves, tables, updated = context.leaves, dict(head.tables), dict(
      head.updated)
  for i, (ids, d_rows) in lookups.items():
    if i == head.roles.two_phase:
      updated[i] = _table_update.update(
          leaves[i], head.kept, context.loss.embed.gather, d_rows,
          context.states[i], context.plans[i], context.parts.mu,
          context.parts.learning_rate, context.opt_states.learning_rate)
    else:
      table = _token_table.lookup_gradient(context.loss.embed, leaves[i],
                                           ids, d_rows)
      tables[i] = table.plus(tables.get(i))
  grads = [g if i in head.roles.early else _sum_grads(g, e)
           for i, (g, e) in enumerate(zip(head.grads, embed_grads))]
  for i, table in tables.items():
    grads[i] = table if context.plans[i] is not None else table.dense()
  for i in head.roles.late:
    updated[i] = context.update(leaves[i], grads[i], context.states[i],
                                context.plans[i])
  new_leaves = [updated[i][0] if i in updated else x
                for i, x in enumerate(leaves)]
  new_states = [tuple(updated[i][1:]) if i in updated else s
                for i, s in enumerate(context.states)]
  return new_leaves, new_states, [g if plan is None else None
                                  for g, plan in zip(grads, context.plans)]


def _sum_grads(a, b):
  if a is None or b is None:
    return b if a is None else a
  return a + b


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


def _pack(parts, opt_state, states, leaf_states, adam_state):
  """The new :func:`taco` state from the per-leaf TACO states."""
  _, lr_state = parts.learning_rate.update(None, states.learning_rate)
  masked_def = jax.tree.structure(states.direction.values, is_leaf=_is_masked)
  direction = _transform.TacoState(
      *(masked_def.unflatten(field) for field in zip(*leaf_states)))
  return _alias.with_taco_states(
      opt_state, _alias.TacoStates(direction, lr_state, adam_state))
