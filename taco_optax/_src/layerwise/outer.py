"""The layer-wise step's parameters outside the layers: head, then embedding.

Each TACO leaf outside the layers has one role, fixed per step
(:class:`OuterRoles`): *early* (not read by the embedding: updated right
after the head, so its gradient dies first), the *two-phase* tied token table
(``_table_update``), or *late* (updated after the embedding's backward).
:func:`after_head` runs the head's backward pass and the updates that can run
then; :func:`after_embedding` the embedding's backward pass and the rest.
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp

from taco_optax._src import transform
from taco_optax._src.layerwise import weight_update
from taco_optax._src.layerwise import tied_table
from taco_optax._src.layerwise import token_table
from taco_optax._src.layerwise.layered_loss import LayeredLoss

Params = Any
Batch = Any


def used_inputs(fn: Callable[[Any], Any], tree: Any) -> list[bool]:
  """Which leaves of ``tree`` the traced ``fn(tree)`` reads at all."""
  jaxpr = jax.make_jaxpr(fn)(tree).jaxpr
  read = {v for eqn in jaxpr.eqns for v in eqn.invars
          if isinstance(v, jax_core.Var)}
  read |= {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
  return [v in read for v in jaxpr.invars]


def _ordered_after(tree: Any, after: Any) -> Any:
  """``tree`` made to depend on ``after`` (see ``data_dependency``)."""
  return jax.tree.map(lambda x: weight_update.data_dependency(x, after), tree)


def refuse_table_reads(fn: Callable[[Any], Any], outer: Any, path,
                        what: str) -> None:
  """Raises if ``fn(outer)`` reads the token table at ``path``."""
  if used_inputs(fn, outer)[token_table.leaf_index(outer, path)]:
    raise ValueError(
        f'{what} reads the token table; its gradient would be missed. Read '
        'the table only through the lookup and the projection.')


def _head_backward(head, outer, hidden, batch):
  """``(value, outer grads, d_hidden, {leaf: TableGradient})`` of the head."""
  if isinstance(head, token_table.TableProjection):
    refuse_table_reads(lambda o: head.features(o, hidden, batch), outer,
                        head.table, 'TableProjection.features')
    value, grads, d_hidden, index, table = token_table.head_backward(
        head, outer, hidden, batch)
    return value, grads, d_hidden, {index: table}
  value, head_vjp = jax.vjp(lambda o, h: head(o, h, batch), outer, hidden)
  outer_grads, d_hidden = head_vjp(jnp.ones_like(value))
  return value, jax.tree.leaves(outer_grads), d_hidden, {}


def _embed_backward(embed, outer, batch, d_hidden):
  """``(outer grads, {leaf: (ids, d_rows)})`` of the embedding."""
  if isinstance(embed, token_table.TableLookup):
    rows = embed.gather(token_table.table_at(outer, embed.table),
                        embed.ids(batch))
    refuse_table_reads(lambda o: embed.apply(o, rows, batch), outer,
                        embed.table, 'TableLookup.apply')
    grads, index, ids, d_rows = token_table.embed_backward(embed, outer,
                                                            batch)(d_hidden)
    return grads, {index: (ids, d_rows)}
  _, embed_vjp = jax.vjp(lambda o: embed(o, batch), outer)
  (grads,) = embed_vjp(d_hidden)
  return jax.tree.leaves(grads), {}


class OuterRoles(NamedTuple):
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


def outer_roles(loss: LayeredLoss, outer, plans, tables, states, batch,
                two_phase_allowed: bool = True) -> OuterRoles:
  """Each outer TACO leaf's role (``plans``/``states`` are the outer ones).

  ``two_phase_allowed=False`` (clipped gradients: phase 1 would select from
  the projection's share before the clipped sum exists) makes a tied table
  late.
  """
  embed_reads = used_inputs(lambda o: loss.embed(o, batch), outer)
  taco = [i for i, plan in enumerate(plans) if plan is not None]
  early = tuple(i for i in taco if not embed_reads[i])
  two_phase = None
  if two_phase_allowed and isinstance(loss.embed, token_table.TableLookup):
    i = token_table.leaf_index(outer, loss.embed.table)
    if (i in tables and plans[i] is not None and tied_table.applies(
        jax.tree.leaves(outer)[i], tables[i], plans[i],
        loss.embed.ids(batch), states[i][0].shape[-2])):
      two_phase = i
  late = tuple(i for i in taco if i not in early and i != two_phase)
  return OuterRoles(early, two_phase, late)


class Outer(NamedTuple):
  """What the outer parameters' updates read in one step."""
  loss: LayeredLoss
  outer: Params
  batch: Batch
  plans: list[Any]
  states: list[Any]
  update: Callable[..., tuple[jax.Array, ...]]
  parts: transform.TacoParts
  opt_states: transform.TacoStates
  rounding: Callable[..., Optional[weight_update.LeafRounding]]
  two_phase_allowed: bool = True

  @property
  def leaves(self) -> list[jax.Array]:
    return jax.tree.leaves(self.outer)


class Head(NamedTuple):
  """The head's backward pass and the outer updates that ran after it.

  Attributes:
    value: the loss.
    d_hidden: the cotangent of the last layer's output (ordered after the
      updates).
    grads: the head's gradient of each outer leaf (``None`` at a table).
    tables: ``{leaf: TableGradient}`` of the tables still to update.
    roles: each outer TACO leaf's role.
    updated: ``{leaf: (param, *state)}`` of the early leaves.
    kept: phase 1 of the two-phase table (``tied_table.head_phase``).
  """
  value: jax.Array
  d_hidden: Any
  grads: list[Any]
  tables: dict[int, Any]
  roles: OuterRoles
  updated: dict[int, tuple[jax.Array, ...]]
  kept: Any


def update_early(update, leaves, states, plans, early, grad_of, d_hidden):
  """``(updated, d_hidden)``: the ``early`` leaves updated, ``d_hidden``
  ordered after each, so their gradients die before the layers' backward.

  ``grad_of(i)`` is leaf ``i``'s whole gradient; ``updated`` maps each early
  leaf to its ``(param, *state)``.
  """
  updated = {}
  for i in early:
    updated[i] = update(i, leaves[i], grad_of(i), states[i], plans[i])
    d_hidden = _ordered_after(d_hidden, updated[i][0])
  return updated, d_hidden


def after_head(context: Outer, hidden: Any) -> Head:
  """The head's backward pass, the early leaves and a tied table's phase 1."""
  loss, outer, batch = context.loss, context.outer, context.batch
  value, grads, d_hidden, tables = _head_backward(loss.head, outer, hidden,
                                                  batch)
  roles = outer_roles(loss, outer, context.plans, tables, context.states,
                      batch, context.two_phase_allowed)
  tables = dict(tables)
  kept, leaves = None, context.leaves
  # An untied LM head has its whole gradient now: update it before the
  # layers, so that gradient dies.
  updated, d_hidden = update_early(
      context.update, leaves, context.states, context.plans, roles.early,
      lambda i: tables.pop(i) if i in tables else grads[i], d_hidden)
  i = roles.two_phase
  if i is not None:
    # Select among the rows outside the batch's tokens now, so the logits'
    # cotangent dies before the layers.
    kept = tied_table.head_phase(
        tables.pop(i), loss.embed.ids(batch), leaves[i], context.states[i],
        context.plans[i], context.parts.mu)
    d_hidden = _ordered_after(d_hidden, kept[2].values)
  return Head(value, d_hidden, grads, tables, roles, updated, kept)


def after_embedding(context: Outer, head: Head, d_hidden: Any):
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
      updated[i] = tied_table.update(
          leaves[i], head.kept, context.loss.embed.gather, d_rows,
          context.states[i], context.plans[i], context.parts.mu,
          context.parts.learning_rate, context.opt_states.learning_rate,
          context.rounding(i))
    else:
      table = token_table.lookup_gradient(context.loss.embed, leaves[i],
                                           ids, d_rows)
      tables[i] = table.plus(tables.get(i))
  grads = [g if i in head.roles.early else _sum_grads(g, e)
           for i, (g, e) in enumerate(zip(head.grads, embed_grads))]
  for i, table in tables.items():
    grads[i] = table if context.plans[i] is not None else table.dense()
  for i in head.roles.late:
    updated[i] = context.update(i, leaves[i], grads[i], context.states[i],
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
