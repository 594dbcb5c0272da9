"""The layer-wise step's parameters outside the layers: head, then embedding.

Each TACO leaf outside the layers has one role, fixed per step
(:class:`OuterRoles`): *early* (not read by the embedding: updated right
after the head, so its gradient dies first), the *two-phase* tied token table
(``tied_table``), or *late* (updated after the embedding's backward).
:func:`after_head` runs the head's backward pass and the updates that can run
then; :func:`after_embedding` the embedding's backward pass and the rest.
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp

from taco_optax._src.layerwise import leaves as leaves_lib
from taco_optax._src.layerwise import ordering
from taco_optax._src.layerwise import tied_table
from taco_optax._src.layerwise import token_table
from taco_optax._src.layerwise import winners
from taco_optax._src.layerwise.layered_loss import LayeredLoss

Key = leaves_lib.Key
Params = Any
Batch = Any


def read_keys(fn: Callable[[Any], Any], outer: Params) -> frozenset[Key]:
  """The keys of the outer leaves that the traced ``fn(outer)`` reads."""
  jaxpr = jax.make_jaxpr(fn)(outer).jaxpr
  read = {v for eqn in jaxpr.eqns for v in eqn.invars
          if isinstance(v, jax_core.Var)}
  read |= {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
  return frozenset(key for (key, _), v in zip(
      leaves_lib.keyed(outer, leaves_lib.OUTER), jaxpr.invars) if v in read)


def refuse_table_reads(fn: Callable[[Any], Any], outer: Params,
                       table: token_table.Path, what: str) -> None:
  """Raises if ``fn(outer)`` reads the token table at path ``table``."""
  key = leaves_lib.OUTER + token_table.table_path(outer, table)
  if key in read_keys(fn, outer):
    raise ValueError(
        f'{what} reads the token table; its gradient would be missed. Read '
        'the table only through the lookup and the projection.')


def head_gradients(head: Callable[..., jax.Array], outer: Params,
                   hidden: Any, batch: Batch):
  """``(value, grads, d_hidden)`` of the head: ``grads`` by key, a
  ``TableGradient`` at a :class:`TableProjection`'s table."""
  if isinstance(head, token_table.TableProjection):
    refuse_table_reads(lambda o: head.features(o, hidden, batch), outer,
                       head.table, 'TableProjection.features')
    result = token_table.projection_backward(head, outer, hidden, batch)
    grads = {leaves_lib.OUTER + path: g for path, g in result.grads.items()}
    grads[leaves_lib.OUTER + result.table] = result.gradient
    return result.value, grads, result.d_hidden
  value, head_vjp = jax.vjp(lambda o, h: head(o, h, batch), outer, hidden)
  outer_grads, d_hidden = head_vjp(jnp.ones_like(value))
  return (value, dict(leaves_lib.keyed(outer_grads, leaves_lib.OUTER)),
          d_hidden)


class Lookups(NamedTuple):
  """The embedding's backward pass (:func:`embed_gradients`).

  Attributes:
    grads: each outer leaf's gradient by key (not the looked-up table's).
    tables: ``{key: (ids, d_rows)}`` of a :class:`TableLookup`'s table.
  """
  grads: dict[Key, Any]
  tables: dict[Key, tuple[jax.Array, jax.Array]]


def embed_gradients(embed: Callable[..., Any], outer: Params, batch: Batch,
                    d_hidden: Any) -> Lookups:
  """The embedding's backward pass from ``d_hidden``."""
  if isinstance(embed, token_table.TableLookup):
    rows = embed.gather(token_table.table_at(outer, embed.table),
                        embed.ids(batch))
    refuse_table_reads(lambda o: embed.apply(o, rows, batch), outer,
                       embed.table, 'TableLookup.apply')
    result = token_table.lookup_backward(embed, outer, batch)(d_hidden)
    return Lookups(
        {leaves_lib.OUTER + path: g for path, g in result.grads.items()},
        {leaves_lib.OUTER + result.table: (result.ids, result.d_rows)})
  _, embed_vjp = jax.vjp(lambda o: embed(o, batch), outer)
  (grads,) = embed_vjp(d_hidden)
  return Lookups(dict(leaves_lib.keyed(grads, leaves_lib.OUTER)), {})


class OuterRoles(NamedTuple):
  """When each TACO leaf outside the layers is updated in one step.

  Attributes:
    early: leaves the embedding does not read (an untied LM head): their
      whole gradient exists after the head, so they are updated then.
    two_phase: the tied token table selected in two phases, or ``None``.
    late: every other TACO leaf: updated after the embedding's backward.
  """
  early: tuple[Key, ...]
  two_phase: Optional[Key]
  late: tuple[Key, ...]


def outer_roles(loss: LayeredLoss, step: leaves_lib.StepLeaves,
                outer: Params, head_grads: dict[Key, Any], batch: Batch,
                two_phase_allowed: bool = True) -> OuterRoles:
  """Each outer TACO leaf's role.

  ``head_grads`` are the head's gradients (a ``TableGradient`` at a
  projected table); ``two_phase_allowed=False`` (clipped gradients: phase 1
  would select from the projection's share before the clipped sum exists)
  makes a tied table late.
  """
  embed_reads = read_keys(lambda o: loss.embed(o, batch), outer)
  params = dict(leaves_lib.keyed(outer, leaves_lib.OUTER))
  taco = [leaf for leaf in step.of(outer, leaves_lib.OUTER)
          if leaf.plan is not None]
  early = tuple(leaf.key for leaf in taco if leaf.key not in embed_reads)
  two_phase = None
  if two_phase_allowed and isinstance(loss.embed, token_table.TableLookup):
    key = leaves_lib.OUTER + token_table.table_path(outer, loss.embed.table)
    leaf = step.leaves[key]
    gradient = head_grads.get(key)
    if (isinstance(gradient, token_table.TableGradient)
        and leaf.plan is not None and tied_table.applies(
            params[key], gradient, leaf.plan, loss.embed.ids(batch),
            leaf.history.values.shape[-2], step.column_block_elements)):
      two_phase = key
  late = tuple(leaf.key for leaf in taco
               if leaf.key not in early and leaf.key != two_phase)
  return OuterRoles(early, two_phase, late)


def update_early(step: leaves_lib.StepLeaves, outer: Params,
                 early: tuple[Key, ...], grad_of: Callable[[Key], Any],
                 d_hidden: Any) -> tuple[dict[Key, leaves_lib.Updated], Any]:
  """``(updated, d_hidden)``: the ``early`` leaves updated, ``d_hidden``
  ordered after each, so their gradients die before the layers' backward.

  ``grad_of(key)`` is the leaf's whole gradient.
  """
  params = dict(leaves_lib.keyed(outer, leaves_lib.OUTER))
  updated = {}
  for key in early:
    updated[key] = step.update(step.leaves[key], params[key], grad_of(key))
    d_hidden = ordering.ordered_after(d_hidden, updated[key].param)
  return updated, d_hidden


class Head(NamedTuple):
  """The head's backward pass and the outer updates that ran after it.

  Attributes:
    value: the loss.
    d_hidden: the cotangent of the last layer's output (ordered after the
      updates).
    grads: the head's gradient of each outer leaf not yet updated, by key
      (a ``TableGradient`` at a projected table).
    roles: each outer TACO leaf's role.
    updated: the early leaves' updates.
    phase: phase 1 of the two-phase table, or ``None``.
  """
  value: jax.Array
  d_hidden: Any
  grads: dict[Key, Any]
  roles: OuterRoles
  updated: dict[Key, leaves_lib.Updated]
  phase: Optional[tied_table.HeadPhase]


def table_write(step: leaves_lib.StepLeaves,
                leaf: leaves_lib.Leaf) -> winners.WinnerWrite:
  """How the tied table's winners are written."""
  return winners.WinnerWrite(
      # mypy: a two-phase table (phase set) has a TableLookup embed and a plan.
      plan=leaf.plan, mu=step.parts.mu,  # type: ignore[arg-type]
      learning_rate=step.parts.learning_rate,
      learning_rate_state=step.states.learning_rate,
      block_elements=step.column_block_elements, rounding=leaf.rounding,
      measure=step.sums_squares)


def after_head(loss: LayeredLoss, step: leaves_lib.StepLeaves, outer: Params,
               batch: Batch, hidden: Any,
               two_phase_allowed: bool = True) -> Head:
  """The head's backward pass, the early leaves and a tied table's phase 1."""
  value, grads, d_hidden = head_gradients(loss.head, outer, hidden, batch)
  roles = outer_roles(loss, step, outer, grads, batch, two_phase_allowed)
  # An untied LM head has its whole gradient now: update it before the
  # layers, so that gradient dies.
  updated, d_hidden = update_early(step, outer, roles.early, grads.get,
                                   d_hidden)
  grads = {key: g for key, g in grads.items() if key not in roles.early}
  phase = None
  if roles.two_phase is not None:
    # Select among the rows outside the batch's tokens now, so the logits'
    # cotangent dies before the layers.
    key = roles.two_phase
    leaf = step.leaves[key]
    phase = tied_table.head_phase(
        # mypy: a two-phase table (phase set) has a TableLookup embed
        # and a plan.
        grads.pop(key), loss.embed.ids(batch),  # type: ignore[attr-defined]
        dict(leaves_lib.keyed(outer, leaves_lib.OUTER))[key], leaf.history,
        table_write(step, leaf))
    d_hidden = ordering.ordered_after(d_hidden, phase.outside.values)
  return Head(value, d_hidden, grads, roles, updated, phase)


def after_embedding(loss: LayeredLoss, step: leaves_lib.StepLeaves,
                    outer: Params, batch: Batch, head: Head, d_hidden: Any
                    ) -> tuple[dict[Key, leaves_lib.Updated], dict[Key, Any]]:
  """The embedding's backward pass and every remaining outer update.

  Returns:
    ``(updated, grads)``: every outer TACO leaf's update (the head's early
    ones included) and every outer Adam leaf's gradient, by key.
  """
  params = dict(leaves_lib.keyed(outer, leaves_lib.OUTER))
  lookups = embed_gradients(loss.embed, outer, batch, d_hidden)
  updated = dict(head.updated)
  grads = {key: _sum_grads(head.grads.get(key), lookups.grads.get(key))
           for key in params if key not in head.updated}
  for key, (ids, d_rows) in lookups.tables.items():
    leaf = step.leaves[key]
    if key == head.roles.two_phase:
      updated[key] = leaves_lib.Updated(*tied_table.update(
          # mypy: a two-phase table (phase set) has a TableLookup
          # embed and a plan.
          params[key], head.phase, loss.embed.gather, d_rows, leaf.history,  # type: ignore[arg-type,attr-defined]
          table_write(step, leaf)))
      del grads[key]
      continue
    # mypy: lookups.tables has entries only for a TableLookup embed.
    table = token_table.lookup_gradient(loss.embed, params[key], ids, d_rows)  # type: ignore[arg-type]
    projected = head.grads.get(key)
    grads[key] = table.plus(
        projected if isinstance(projected, token_table.TableGradient)
        else None)
  for key, grad in grads.items():
    if (isinstance(grad, token_table.TableGradient)
        and step.leaves[key].plan is None):
      grads[key] = grad.dense()
  for key in head.roles.late:
    updated[key] = step.update(step.leaves[key], params[key], grads.pop(key))
  return updated, grads


def _sum_grads(a, b):
  if a is None or b is None:
    return b if a is None else a
  # A projected table that goes to Adam (no TACO plan) beside the lookup's
  # gradient of it (zeros when the embedding does not read it): dense.
  dense = lambda g: g.dense() if isinstance(g, token_table.TableGradient) else g
  return dense(a) + dense(b)
