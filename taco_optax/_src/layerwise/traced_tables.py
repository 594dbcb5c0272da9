"""A plain loss's token tables, read from its jaxpr.

A decoder reads its ``[vocab, d]`` token table as a row lookup before the
blocks and, tied, as the projection after them (an untied head reads its own
``[d, vocab]`` kernel there). :func:`find_tables` recognises both reads in
the program :mod:`traced_loss` splits, so the plain loss's ``embed`` and
``head`` become the :class:`TableLookup` and :class:`TableProjection` a
hand-split loss would give, and the layer-wise step never forms the tables'
dense gradients.

What is recognised (anything else is read as an ordinary leaf, densely):

* a lookup: the table, through dtype casts, is the operand of a ``gather``
  of whole rows (``table[ids]``, ``jnp.take(table, ids, axis=0)``,
  ``nnx.Embed``, ``nn.Embed``) whose ids come from the batch alone;
* a projection: the table, through dtype casts and a transpose, is the right
  operand of a ``dot_general`` that contracts its ``d`` axis with the
  features' last axis (``x @ table.T``, ``nnx.Embed.attend``, a head kernel
  ``x @ kernel``), and what follows the logits reads no parameter.

The table may be read by nothing else; of several lookups (a position table
beside the token table) the largest table is taken.
"""

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from taco_optax._src import routing
from taco_optax._src.layerwise import program as program_lib
from taco_optax._src.layerwise import token_table

_internals = routing.jaxpr_internals
_UNARY = ('convert_element_type', 'transpose')


class Tables(NamedTuple):
  """The ``embed`` and ``head`` found, each ``None`` where the plain slice is
  kept."""
  embed: Optional[token_table.TableLookup]
  head: Optional[token_table.TableProjection]


class _Use(NamedTuple):
  ops: tuple[Any, ...]  # unary equations from the table to the use
  eqn: Any              # the gather or dot_general
  position: int         # the table's operand position in it


def _vars(values: Sequence[Any]) -> set[Any]:
  return {v for v in values if not _internals.is_literal(v)}


def needed(eqns: Sequence[Any], targets: Sequence[Any],
           given: Sequence[Any] = ()) -> list[Any]:
  """The equations of ``eqns`` (in order) that ``targets`` need, not going
  past the values ``given``."""
  stop = _vars(given)
  wanted = _vars(targets) - stop
  chosen = []
  for eqn in reversed(eqns):
    if any(v in wanted for v in eqn.outvars):
      chosen.append(eqn)
      wanted.update(_vars(eqn.invars) - stop)
  return chosen[::-1]


def _free(eqns: Sequence[Any]) -> set[Any]:
  made = {v for e in eqns for v in e.outvars}
  return {v for e in eqns for v in _vars(e.invars) if v not in made}


def _uses(program: program_lib.Program, var: Any, ops=()) -> list[_Use]:
  """Every read of ``var``, followed through casts and transposes."""
  uses = []
  for index in sorted(program.readers.get(var, set()), key=str):
    if index == 'output':
      return []
    eqn = program.jaxpr.eqns[index]
    if _internals.primitive(eqn) in _UNARY and len(eqn.invars) == 1:
      more = _uses(program, eqn.outvars[0], ops + (eqn,))
      if not more:
        return []
      uses += more
    else:
      uses += [_Use(ops, eqn, q) for q, v in enumerate(eqn.invars)
               if v is var]
  return uses


def _apply_ops(ops: Sequence[Any], table: jax.Array) -> jax.Array:
  for op in ops:
    table = _internals.bind_like(op, [table])[0]
  return table


def _row_gather(use: _Use, program: program_lib.Program) -> Optional[int]:
  """How many index components the gather of whole rows of ``use`` takes:
  1 (``table[ids]``: the row), 2 (a vmapped ``table[i]``, as
  ``eqx.nn.Embedding`` gives: the row and a column start that clipping pins
  to 0 for whole rows), or ``None`` for any other gather."""
  eqn = use.eqn
  if _internals.primitive(eqn) != 'gather' or use.position != 0 or any(
      _internals.primitive(op) == 'transpose' for op in use.ops):
    return None
  offset, collapsed, starts = _internals.gather_numbers(eqn)
  operand, ids = eqn.invars[0].aval, eqn.invars[1]
  out = eqn.outvars[0].aval
  if (operand.ndim != 2 or not offset or offset[-1] != out.ndim - 1
      or 1 in collapsed or _internals.gather_batching_dims(eqn)
      or _internals.slice_sizes(eqn) != (1, operand.shape[1])
      or _internals.is_literal(ids) or ids in program.depends):
    return None
  if starts == (0,) and ids.aval.shape[-1:] == (1,):
    return 1
  if (starts == (0, 1) and ids.aval.shape[-1:] == (2,)
      and _internals.gather_mode(eqn) == 'CLIP'):
    return 2
  return None


def _lookup(program: program_lib.Program, prefix: Sequence[Any],
            head_eqns: Sequence[Any], leaf: int, slot: int, use: _Use,
            outer_leaves: Sequence[int], targets: Sequence[Any],
            components: int) -> Optional[token_table.TableLookup]:
  gather, rows = use.eqn, use.eqn.outvars[0]
  ids_var = gather.invars[1]
  apply_eqns = needed(prefix, targets, given=[rows])
  table_eqns = {id(e) for e in (*use.ops, gather)}
  if program.param_vars[leaf] in _free(apply_eqns) or any(
      id(e) in table_eqns for e in (*apply_eqns, *head_eqns)):
    return None  # the rest of the loss reads the table besides the lookup
  ids_of = program.function(needed(prefix, [ids_var]), (), (), [ids_var])
  apply_of = program.function(apply_eqns, outer_leaves, [rows], targets)

  def ids(batch):
    return ids_of((), jax.tree.leaves(batch))[0][..., 0]

  def apply(outer, looked_up, batch):
    return tuple(apply_of(outer, jax.tree.leaves(batch), [looked_up]))

  def take(table, row_ids):
    table = _apply_ops(use.ops, table)
    index = row_ids[..., None]
    if components == 2:  # the column start: 0, as clipping made it
      index = jnp.concatenate([index, jnp.zeros_like(index)], -1)
    return _internals.bind_like(gather, [table, index],
                                slice_sizes=(1, table.shape[1]))[0]
  return token_table.TableLookup((slot,), ids, apply, take)


def _projection(program: program_lib.Program, head_eqns: Sequence[Any],
                leaf: int, slot: int, use: _Use, outer_leaves: Sequence[int],
                hidden: Sequence[Any], outvars: Sequence[Any]
                ) -> Optional[token_table.TableProjection]:
  dot = use.eqn
  if _internals.primitive(dot) != 'dot_general' or use.position != 1:
    return None
  (lhs, rhs), batch_axes = _internals.dot_dimension_numbers(dot)
  features, logits = dot.invars[0], dot.outvars[0]
  if (any(batch_axes) or len(rhs) != 1 or dot.invars[1].aval.ndim != 2
      or lhs != (features.aval.ndim - 1,)):
    return None
  axis = rhs[0]
  for op in reversed(use.ops):  # the d axis among the table's own axes
    if _internals.primitive(op) == 'transpose':
      axis = _internals.permutation(op)[axis]
  table_var = program.param_vars[leaf]
  feature_eqns = needed(head_eqns, [features])
  loss_eqns = needed(head_eqns, outvars, given=[logits])
  if (table_var in _free(feature_eqns) or dot in feature_eqns
      or _free(loss_eqns) & (set(program.param_vars) | _vars(hidden))):
    return None
  features_of = program.function(feature_eqns, outer_leaves, hidden,
                                 [features])
  loss_of = program.function(loss_eqns, (), [logits], outvars)
  contracted = rhs[0]

  def project(x, table):
    numbers = (((x.ndim - 1,), (contracted,)), ((), ()))
    return _internals.bind_like(dot, [x, _apply_ops(use.ops, table)],
                                dimension_numbers=numbers)[0]

  return token_table.TableProjection(
      (slot,),
      features=lambda outer, h, batch: features_of(
          outer, jax.tree.leaves(batch), h)[0],
      loss=lambda z, batch: loss_of((), jax.tree.leaves(batch), [z])[0],
      project=project, table_axis=axis)


def find_tables(program: program_lib.Program, outer_leaves: Sequence[int],
                first: int, last: int, targets: Sequence[Any],
                head_eqns: Sequence[Any], hidden: Sequence[Any],
                outvars: Sequence[Any]) -> Tables:
  """The lookup before block ``first`` and the projection after block
  ``last`` (equation indices) of a table among ``outer_leaves``.

  ``targets`` are the values the first block reads, ``head_eqns`` what runs
  after the blocks (with what it recomputes of the first part), ``hidden``
  the last block's results and ``outvars`` the loss.
  """
  prefix = list(program.jaxpr.eqns[:first])
  lookups: list[tuple[int, token_table.TableLookup]] = []
  heads: list[tuple[int, token_table.TableProjection]] = []
  for slot, leaf in enumerate(outer_leaves):
    var = program.param_vars[leaf]
    if getattr(var.aval, 'ndim', 0) != 2:
      continue
    uses = _uses(program, var)
    index = {id(e): i for i, e in enumerate(program.jaxpr.eqns)}
    before = [u for u in uses if index[id(u.eqn)] < first]
    after = [u for u in uses if index[id(u.eqn)] > last]
    if not uses or len(before) > 1 or len(after) > 1 or len(
        before) + len(after) != len(uses):
      continue
    lookup = head = None
    if before:
      components = _row_gather(before[0], program)
      if components is None:
        continue
      lookup = _lookup(program, prefix, head_eqns, leaf, slot, before[0],
                       outer_leaves, targets, components)
      if lookup is None:
        continue
    if after:
      head = _projection(program, head_eqns, leaf, slot, after[0],
                         outer_leaves, hidden, outvars)
      if head is None:
        continue
    size = var.aval.size
    if lookup is not None:
      lookups.append((size, lookup))
    if head is not None:
      heads.append((size, head))
  return Tables(_largest(lookups), _largest(heads))


def _largest(found: list[tuple[int, Any]]) -> Any:
  return max(found, key=lambda x: x[0])[1] if found else None
