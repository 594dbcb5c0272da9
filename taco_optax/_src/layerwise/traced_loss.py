"""A plain loss's blocks, read from its jaxpr: the loss as a LayeredLoss.

``loss_fn(params, batch) -> scalar``, written for ``jax.grad`` in any
framework, carries its blocks in its program when each is rematerialised:
the jaxpr of such a loss shows every block as one top-level ``checkpoint``
equation (``jax.checkpoint``, ``nnx.remat``, ``nn.remat``,
``eqx.filter_checkpoint``), or the stacked layers as one ``scan`` whose body
is rematerialised (``nnx.scan``, ``nn.scan``, ``jax.lax.scan``).
:func:`layered_loss_of` reads them:

* what runs before the first block plays ``embed``: it returns the values the
  first block reads that depend on the parameters (the hidden state);
* each block plays ``layer``, on its own parameters (every leaf it reads,
  read by nothing else), the hidden state and values that depend on the batch
  alone (a mask, positions), which each layer recomputes from the batch;
* what runs after the last block plays ``head``, on the last block's results
  (and, recomputed, anything of the first part it reads).

The parameters are re-laid as the pair ``(outer, layers)`` that
:class:`LayeredLoss` reads by a permutation of their leaves
(:class:`Relayout`): ``outer`` is a tuple of the leaves no block reads,
``layers`` a list of one tuple per block (unrolled) or one tuple of stacked
leaves (a scan).
"""

from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from taco_optax._src import routing
from taco_optax._src.layerwise import program as program_lib
from taco_optax._src.layerwise import traced_tables
from taco_optax._src.layerwise.layered_loss import LayeredLoss

_internals = routing.jaxpr_internals

_HOW_TO_MARK = (
    'Mark each block for recomputation: jax.checkpoint (or jax.remat) on a '
    'block\'s function, nnx.remat, nn.remat or eqx.filter_checkpoint per '
    'block, or stack the layers in one nnx.scan / nn.scan / jax.lax.scan '
    'whose body is rematerialised.')


class TracedLoss(NamedTuple):
  """A plain loss as :class:`LayeredLoss`, and where its leaves went.

  Attributes:
    loss: the loss as ``embed -> layer x L -> head``.
    split: ``split(params) -> (outer, layers)``, the user's parameters
      re-laid as the pair (it only picks leaves: :meth:`Relayout.of`).
    num_blocks: the blocks read from the program (a scan's length).
  """
  loss: LayeredLoss
  split: Callable[[Any], Any]
  num_blocks: int


def _abstract(tree: Any) -> Any:
  def shape_of(x):
    if not hasattr(x, 'shape') or not hasattr(x, 'dtype'):
      return x
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype,
        weak_type=bool(getattr(getattr(x, 'aval', None), 'weak_type', False)))
  return jax.tree.map(shape_of, tree)


def _contains_remat(jaxpr: Any) -> bool:
  for eqn in _internals.open_jaxpr(jaxpr).eqns:
    if _internals.is_remat(eqn):
      return True
    if _internals.primitive(eqn) in _internals.CALLS and _contains_remat(
        _internals.called_jaxpr(eqn)):
      return True
  return False


def _is_block(eqn: Any) -> bool:
  if _internals.is_remat(eqn):
    return True
  return (_internals.primitive(eqn) == 'scan'
          and _contains_remat(eqn.params['jaxpr']))


def _no_blocks(eqns: Sequence[Any]) -> ValueError:
  names = [_internals.primitive(e) for e in eqns]
  nested = [n for e, n in zip(eqns, names) if n in _internals.CALLS
            and _contains_remat(_internals.called_jaxpr(e))]
  where = (f' The blocks sit inside a {nested[0]!r} call, which the step '
           'does not open: call them at the top level of loss_fn.'
           if nested else '')
  shown = ', '.join(names[:12]) + (', ...' if len(names) > 12 else '')
  return ValueError(
      'The layer-wise step found no blocks in loss_fn: its program has no '
      'top-level rematerialised block (its equations: '
      f'{shown}).{where} {_HOW_TO_MARK}')


def _param_only_in(program: program_lib.Program, var: Any, block: int) -> None:
  readers = program.readers.get(var, set())
  if readers != {block}:
    name = program.param_names[program.param_index[var]]
    raise ValueError(
        f'The parameter {name} is read by a block and elsewhere in loss_fn '
        '(another block, or outside the blocks): the layer-wise step '
        'updates each block\'s parameters in that block\'s backward pass, so '
        'a block\'s parameters must be its own. Read a shared parameter '
        'outside the blocks only, or give each block its own.')


class _Roles(NamedTuple):
  params: tuple[int, ...]             # operand positions of parameters
  param_leaves: tuple[int, ...]       # their leaf numbers
  hidden: tuple[tuple[int, Any], ...]  # (position, hidden index or var)
  static: tuple[tuple[int, Any], ...]  # (position, var or literal)


def _roles(program: program_lib.Program, blocks: list[int], carried: list[int],
           j: int) -> _Roles:
  """What each operand of block ``j`` (of the unrolled ones) is."""
  index = blocks[j]
  eqn = program.jaxpr.eqns[index]
  params, leaves, hidden, static = [], [], [], []
  for q, v in enumerate(eqn.invars):
    if _internals.is_literal(v):
      static.append((q, v))
    elif v in program.param_index:
      _param_only_in(program, v, index)
      params.append(q)
      leaves.append(program.param_index[v])
    elif j and program.produced_by.get(v) == blocks[j - 1]:
      hidden.append((q, carried.index(
          program.jaxpr.eqns[blocks[j - 1]].outvars.index(v))))
    elif v not in program.depends:
      static.append((q, v))
    elif not j and program.produced_by.get(v, blocks[0]) < blocks[0]:
      hidden.append((q, v))
    else:
      raise ValueError(
          f'Block {j} of loss_fn reads a value computed from the parameters '
          'that is neither the previous block\'s result nor its own '
          'parameter (a connection that skips blocks): the layer-wise step '
          'carries only what one block hands the next.')
  return _Roles(tuple(params), tuple(leaves), tuple(hidden), tuple(static))


def _keys(static: Sequence[tuple[int, Any]]) -> list[tuple[int, Any]]:
  """Comparable static operands: a literal by its value."""
  return [(q, ('literal', repr(v.val)) if _internals.is_literal(v) else v)
          for q, v in static]


def _same_block(a: Any, b: Any) -> bool:
  def signature(eqn):
    rest = sorted((k, repr(v)) for k, v in eqn.params.items() if k != 'jaxpr')
    return str(_internals.called_jaxpr(eqn)), rest
  return signature(a) == signature(b)


def _carried(program: program_lib.Program, blocks: list[int]) -> list[int]:
  """The results each block hands the next (their indices among its
  results): the same for every block, each read by the next block alone
  (the last block's by what follows the blocks); the other results (Flax's
  module state handed back by ``nnx.remat``, say) unread."""
  eqns = program.jaxpr.eqns
  readers = lambda j, k: program.readers.get(eqns[blocks[j]].outvars[k],
                                             set())
  width = len(eqns[blocks[0]].outvars)
  carried = [k for k in range(width) if readers(0, k)]
  for j in range(len(blocks)):
    for k in range(width):
      read = readers(j, k)
      last = j == len(blocks) - 1
      if k not in carried:
        ok = not read
      elif last:
        ok = bool(read) and not read & set(blocks) and 'output' not in read
      else:
        ok = read == {blocks[j + 1]}
      if not ok:
        raise ValueError(
            f'Result {k} of block {j} of loss_fn is not handed to the next '
            'block alone (or the blocks hand each other different results): '
            'the layer-wise step carries only what one block hands the '
            'next.')
  return carried


def _hidden_dtypes_float(avals: Sequence[Any]) -> None:
  for aval in avals:
    if not jax.dtypes.issubdtype(aval.dtype, np.inexact):  # bfloat16 too
      raise ValueError(
          'A value the blocks of loss_fn hand each other is of dtype '
          f'{aval.dtype}: the layer-wise step carries floating-point hidden '
          'states only. Compute integer values (masks, positions) from the '
          'batch inside the block, or before the first block.')


def _unrolled(program: program_lib.Program, blocks: list[int]):
  """``(embed targets, layer, param leaves per block, last results)``."""
  eqns = program.jaxpr.eqns
  if len(blocks) < 2:
    raise ValueError(
        'loss_fn has one rematerialised block: the layer-wise step reads the '
        'layers as two or more blocks, each handing its result to the next. '
        + _HOW_TO_MARK)
  between = [i for i in range(blocks[0], blocks[-1] + 1) if i not in blocks]
  if between:
    names = sorted({_internals.primitive(eqns[i]) for i in between})
    raise ValueError(
        f'loss_fn computes {", ".join(names)} between its blocks: the '
        'layer-wise step runs the blocks back to back. Move that work into '
        'the blocks (inside their remat).')
  for j in blocks[1:]:
    if _internals.primitive(eqns[j]) == 'scan' or not _same_block(
        eqns[blocks[0]], eqns[j]):
      raise ValueError(
          'The blocks of loss_fn are not the same program (their '
          'rematerialised jaxprs differ): the layer-wise step runs one layer '
          'function over every block\'s parameters. Give the blocks one '
          'structure, or stack them in a scan.')
  carried = _carried(program, blocks)
  roles = [_roles(program, blocks, carried, j) for j in range(len(blocks))]
  first, second = roles[0], roles[1]
  for j, r in enumerate(roles[1:], 1):
    if (r.params, r.hidden, _keys(r.static)) != (
        second.params, second.hidden, _keys(second.static)):
      raise ValueError(
          f'Block {j} of loss_fn reads its operands in another order than '
          'block 1 does: the layer-wise step runs one layer function over '
          'every block.')
  if first.params != second.params or _keys(first.static) != _keys(
      second.static) or [
      q for q, _ in first.hidden] != [q for q, _ in second.hidden]:
    raise ValueError(
        'The first block of loss_fn reads its operands in another order than '
        'the others: the layer-wise step runs one layer function over every '
        'block.')
  targets: list[Any] = [None] * len(carried)
  for (_, var), (_, k) in zip(first.hidden, second.hidden):
    targets[k] = var
  block = _internals.closed_function(_internals.called_jaxpr(eqns[blocks[0]]))
  static = [v for _, v in second.static]

  def layer(p: Sequence[Any], hidden: Sequence[Any],
            statics: Sequence[Any]) -> tuple[Any, ...]:
    operands: list[Any] = [None] * len(eqns[blocks[0]].invars)
    for q, leaf in zip(second.params, p):
      operands[q] = leaf
    for q, k in second.hidden:
      operands[q] = hidden[k]
    for (q, _), value in zip(second.static, statics):
      operands[q] = value
    results = block(*operands)
    return tuple(results[k] for k in carried)

  last = eqns[blocks[-1]].outvars
  return (targets, static, layer, [r.param_leaves for r in roles],
          [last[k] for k in carried])


def _scanned(program: program_lib.Program, index: int):
  """:func:`_unrolled`'s tuple for one scan over stacked layers."""
  eqn = program.jaxpr.eqns[index]
  num_consts, num_carry = _internals.scan_split(eqn)
  length, reverse = _internals.scan_options(eqn)
  if reverse:
    raise ValueError('loss_fn scans its layers in reverse: the layer-wise '
                     'step runs a scan over the layers forward.')
  operands = list(eqn.invars)
  consts = operands[:num_consts]
  carries = operands[num_consts:num_consts + num_carry]
  xs = operands[num_consts + num_carry:]
  for v in consts:
    if not _internals.is_literal(v) and v in program.depends:
      raise ValueError(
          'The scan over the layers of loss_fn closes over a value computed '
          'from the parameters (a parameter shared by every layer): the '
          'layer-wise step updates each layer\'s parameters in its own '
          'backward pass. Read shared parameters outside the scan.')
  leaves = []
  for v in xs:
    if _internals.is_literal(v) or v not in program.param_index:
      raise ValueError(
          'The scan over the layers of loss_fn scans over a value that is '
          'not a parameter leaf: the layer-wise step scans the stacked '
          'parameters alone. Compute per-layer inputs inside the body.')
    _param_only_in(program, v, index)
    leaves.append(program.param_index[v])
  ys = eqn.outvars[num_carry:]
  if any(not _internals.is_dropped(v) and program.readers.get(v)
         for v in ys):
    raise ValueError(
        'loss_fn reads the stacked outputs of its scan over the layers: the '
        'layer-wise step carries the scan\'s carry alone.')
  body = _internals.closed_function(eqn.params['jaxpr'])
  static = list(consts)

  def layer(p, hidden, statics):
    return tuple(body(*statics, *hidden, *p)[:num_carry])

  return carries, static, layer, tuple(leaves), list(
      eqn.outvars[:num_carry]), length


def layered_loss_of(loss_fn: Callable[[Any, Any], jax.Array], params: Any,
                    batch: Any) -> TracedLoss:
  """``loss_fn``'s blocks read from its jaxpr (on ``params``' and
  ``batch``'s shapes), as a :class:`LayeredLoss` on the re-laid parameters.

  Raises:
    ValueError: naming what to change, when the program has no blocks, its
      blocks differ or share parameters, or values skip blocks.
  """
  leaves_with_paths = jax.tree_util.tree_leaves_with_path(
      params, is_leaf=routing.is_masked)
  closed = _internals.inline_calls(
      jax.make_jaxpr(loss_fn)(_abstract(params), _abstract(batch)))
  jaxpr = closed.jaxpr
  if len(jaxpr.outvars) != 1 or getattr(jaxpr.outvars[0].aval, 'shape',
                                        None) != ():
    raise ValueError('loss_fn must return one scalar, the loss (as for '
                     'jax.grad); it returned '
                     f'{[getattr(v.aval, "shape", v) for v in jaxpr.outvars]}.')
  program = program_lib.Program(
      jaxpr, list(closed.consts), len(leaves_with_paths),
      [jax.tree_util.keystr(p) for p, _ in leaves_with_paths])
  eqns = jaxpr.eqns
  blocks = [i for i, eqn in enumerate(eqns) if _is_block(eqn)]
  if not blocks:
    raise _no_blocks(eqns)
  scanned = _internals.primitive(eqns[blocks[0]]) == 'scan'
  if scanned:
    if len(blocks) > 1:
      raise ValueError('loss_fn has more than one scan over layers (or a '
                       'scan and remat blocks): the layer-wise step reads '
                       'one run of layers.')
    targets, static, layer, stacked, last, count = _scanned(program,
                                                            blocks[0])
    block_leaves = set(stacked)
  else:
    targets, static, layer, per_block, last = _unrolled(program, blocks)
    block_leaves = {i for leaves in per_block for i in leaves}
    count = len(blocks)
  _hidden_dtypes_float([v.aval for v in last])
  outer_leaves = tuple(i for i in range(program.num_params)
                       if i not in block_leaves)
  first = blocks[0]
  static_vars = [v for v in static if not _internals.is_literal(v)]
  statics_of = program.function(program.slice(static_vars, first), (), (),
                                static_vars)
  embed_of = program.function(program.slice(targets, first), outer_leaves,
                              (), targets)
  suffix = eqns[blocks[-1] + 1:]
  needed = [v for e in suffix for v in e.invars
            if not _internals.is_literal(v)
            and program.produced_by.get(v, -1) < first
            and v in program.produced_by]
  head_eqns = program.slice(needed, first) + list(suffix)
  head_of = program.function(head_eqns, outer_leaves, last, jaxpr.outvars)

  def statics(batch):
    values = iter(statics_of((), jax.tree.leaves(batch)))
    return [v.val if _internals.is_literal(v) else next(values)
            for v in static]

  def embed(outer, batch):
    return tuple(embed_of(outer, jax.tree.leaves(batch)))

  def run_layer(p, hidden, batch):
    return layer(p, hidden, statics(batch))

  def head(outer, hidden, batch):
    return head_of(outer, jax.tree.leaves(batch), hidden)[0]

  def split(numbered):
    flat = jax.tree.leaves(numbered, is_leaf=routing.is_masked)
    outer = tuple(flat[i] for i in outer_leaves)
    if scanned:
      return outer, tuple(flat[i] for i in stacked)
    return outer, [tuple(flat[i] for i in leaves) for leaves in per_block]

  tables = traced_tables.find_tables(program, outer_leaves, first,
                                     blocks[-1], targets, head_eqns, last,
                                     jaxpr.outvars)
  loss = LayeredLoss(tables.embed or embed, run_layer, tables.head or head,
                     scan_layers=scanned)
  return TracedLoss(loss, split, count)
