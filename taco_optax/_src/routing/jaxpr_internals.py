"""The jaxpr internals taco_optax reads, in one place.

:func:`taco_optax.trace_dimension_numbers` walks the jaxpr of a loss. The
primitives' names and parameters it reads are not a stable jax API: jax 0.12
replaced ``scan``'s ``num_consts``/``num_carry`` by ``ft_in``, a triple of
flat-tree groups (constants, carries, scanned inputs), for instance. Every
such read goes through a function here, so a jax upgrade is met in this one
module, and ``tests/test_jaxpr_internals.py`` pins each function on the
smallest program that has the equation, on every jax the project supports.

Each function takes a ``JaxprEqn`` (or a jaxpr) and returns plain Python
values; none of them interprets what the equation means for a parameter.
"""

from typing import Any, Sequence

import jax
from jax.extend import core as jex_core

# Sub-jaxprs called with the operands as they are: primitive -> parameter.
CALLS = {'jit': 'jaxpr', 'pjit': 'jaxpr', 'closed_call': 'call_jaxpr',
         'core_call': 'call_jaxpr', 'remat2': 'jaxpr', 'checkpoint': 'jaxpr',
         'custom_jvp_call': 'call_jaxpr', 'custom_vjp_call': 'call_jaxpr',
         'custom_vjp_call_jaxpr': 'fun_jaxpr', 'shard_map': 'jaxpr'}


def primitive(eqn: Any) -> str:
  """The name of the equation's primitive (``'dot_general'``, ``'scan'``)."""
  return eqn.primitive.name


def is_literal(var: Any) -> bool:
  """Whether an equation operand is a constant written into the jaxpr."""
  return isinstance(var, jex_core.Literal)


def is_dropped(var: Any) -> bool:
  """Whether an equation result is unused (``_``)."""
  return isinstance(var, jex_core.DropVar)


def open_jaxpr(jaxpr: Any) -> Any:
  """The ``Jaxpr`` of a ``Jaxpr`` or a ``ClosedJaxpr``."""
  return getattr(jaxpr, 'jaxpr', jaxpr)


def called_jaxpr(eqn: Any) -> Any:
  """The jaxpr a call-like equation (:data:`CALLS`) runs on its operands."""
  return eqn.params[CALLS[primitive(eqn)]]


def scan_split(eqn: Any) -> tuple[int, int]:
  """``(constants, carries)``: how a ``scan``'s operands begin.

  The operands are the constants, then the carries, then the scanned
  inputs; the results are the carries, then the stacked outputs.
  """
  params = eqn.params
  if 'num_consts' in params:  # jax <= 0.11
    return params['num_consts'], params['num_carry']
  # jax 0.12: a flat tree of three groups; a group's len counts its leaves.
  consts, carries, _ = params['ft_in'].unpack()
  return len(consts), len(carries)


def scan_body(eqn: Any) -> Any:
  """The ``Jaxpr`` of a ``scan``'s body."""
  return open_jaxpr(eqn.params['jaxpr'])


def while_split(eqn: Any) -> tuple[int, int]:
  """``(cond constants, body constants)`` at the front of a ``while``'s
  operands; the carries follow."""
  return eqn.params['cond_nconsts'], eqn.params['body_nconsts']


def while_jaxprs(eqn: Any) -> tuple[Any, Any]:
  """``(cond, body)`` jaxprs of a ``while``."""
  return (open_jaxpr(eqn.params['cond_jaxpr']),
          open_jaxpr(eqn.params['body_jaxpr']))


def cond_branches(eqn: Any) -> Sequence[Any]:
  """A ``cond``'s branches; its first operand is the index, the rest go to
  the branch taken."""
  return eqn.params['branches']


def dot_dimension_numbers(eqn: Any) -> tuple[tuple[Sequence[int], ...],
                                             tuple[Sequence[int], ...]]:
  """``((lhs contracting, rhs contracting), (lhs batch, rhs batch))`` of a
  ``dot_general``."""
  contracting, batch = eqn.params['dimension_numbers']
  return (tuple(contracting[0]), tuple(contracting[1])), (tuple(batch[0]),
                                                          tuple(batch[1]))


def ragged_dot_axes(eqn: Any) -> tuple[Sequence[int], Sequence[int],
                                       Sequence[int]]:
  """The rhs's ``(contracting, batch, group)`` axes of a
  ``ragged_dot_general`` (the group axis picks a stacked expert)."""
  numbers = eqn.params['ragged_dot_dimension_numbers']
  contracting, batch = numbers.dot_dimension_numbers
  return (tuple(contracting[1]), tuple(batch[1]),
          tuple(numbers.rhs_group_dimensions))


def slice_sizes(eqn: Any) -> tuple[int, ...]:
  """The slice sizes of a ``gather`` or a ``dynamic_slice``."""
  return tuple(eqn.params['slice_sizes'])


def gather_batching_dims(eqn: Any) -> tuple[int, ...]:
  """A ``gather``'s operand batching axes (none before jax 0.4.31)."""
  numbers = eqn.params['dimension_numbers']
  return tuple(getattr(numbers, 'operand_batching_dims', ()))


def permutation(eqn: Any) -> tuple[int, ...]:
  """A ``transpose``'s permutation."""
  return tuple(eqn.params['permutation'])


def broadcast_dimensions(eqn: Any) -> tuple[int, ...]:
  """Where ``broadcast_in_dim`` puts its operand's axes."""
  return tuple(eqn.params['broadcast_dimensions'])


def squeezed_dimensions(eqn: Any) -> tuple[int, ...]:
  """The axes a ``squeeze`` removes."""
  return tuple(eqn.params['dimensions'])


def all_gather_axis(eqn: Any) -> tuple[bool, int]:
  """``(tiled, axis)`` of an ``all_gather``: a tiled gather keeps the axes,
  an untiled one inserts ``axis``."""
  return (bool(eqn.params.get('tiled', False)),
          eqn.params['all_gather_dimension'])


# Remat's primitive: ``checkpoint`` (named ``remat2`` in the jaxprs it prints
# on jax 0.10 to 0.12).
REMATS = ('checkpoint', 'remat2')


def is_remat(eqn: Any) -> bool:
  """Whether the equation is a ``jax.checkpoint`` (``nnx.remat``, ``nn.remat``,
  ``eqx.filter_checkpoint``) of a sub-jaxpr."""
  return primitive(eqn) in REMATS


def scan_options(eqn: Any) -> tuple[int, bool]:
  """``(length, reverse)`` of a ``scan``."""
  return eqn.params['length'], bool(eqn.params['reverse'])


def function_of(eqns: Sequence[Any], invars: Sequence[Any],
                outvars: Sequence[Any]) -> Any:
  """``f(*values of invars) -> [values of outvars]``: ``eqns`` (a slice of a
  jaxpr's equations, in order, with every operand among ``invars`` or an
  earlier equation's results) run as a function, as ``jax.core.eval_jaxpr``
  runs a jaxpr."""
  # A Jaxpr built without a DebugInfo is deprecated (jax-ml/jax#26480).
  debug = jex_core.DebugInfo(
      'taco_optax', 'a slice of a traced loss',
      tuple(f'in{i}' for i in range(len(invars))),
      tuple(f'out{i}' for i in range(len(outvars))))
  jaxpr = jex_core.Jaxpr((), list(invars), list(outvars), list(eqns),
                         debug_info=debug)
  return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, ()))


def closed_function(jaxpr: Any) -> Any:
  """``f(*invars' values) -> [outvars' values]`` of a ``Jaxpr`` or a
  ``ClosedJaxpr`` (a remat's or a scan body's)."""
  if not hasattr(jaxpr, 'consts'):
    jaxpr = jex_core.ClosedJaxpr(jaxpr, ())
  return jex_core.jaxpr_as_fun(jaxpr)


# Calls that only group equations (``jax.jit`` inside a traced function):
# running their body in place computes the same values and derivatives.
INLINED = ('jit', 'pjit', 'closed_call', 'core_call')


def _bind(eqn: Any, operands: Sequence[Any], params: dict) -> list[Any]:
  # As jax.core.eval_jaxpr binds an equation (jax 0.10 to 0.12).
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*operands,
                             **eqn.primitive.get_bind_params(params))
  return list(out) if eqn.primitive.multiple_results else [out]


def bind_like(eqn: Any, operands: Sequence[Any], **changes: Any) -> list[Any]:
  """The equation's primitive applied to ``operands``, with its parameters
  (``changes`` replacing some, e.g. a ``gather``'s ``slice_sizes``)."""
  return _bind(eqn, operands, {**eqn.params, **changes})


def _run_inlined(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]
                 ) -> list[Any]:
  env: dict[Any, Any] = {}
  read = lambda v: v.val if is_literal(v) else env[v]
  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    operands = [read(v) for v in eqn.invars]
    if primitive(eqn) in INLINED:
      body = called_jaxpr(eqn)
      outs = _run_inlined(open_jaxpr(body), getattr(body, 'consts', ()),
                          operands)
    else:
      outs = _bind(eqn, operands, eqn.params)
    env.update((v, x) for v, x in zip(eqn.outvars, outs) if not is_dropped(v))
  return [read(v) for v in jaxpr.outvars]


def inline_calls(closed: Any) -> Any:
  """``closed`` (a ``ClosedJaxpr``) traced again with every
  :data:`INLINED` call at its top level (and inside those) replaced by the
  call's equations; remat, scan and custom-derivative calls stay whole."""
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                weak_type=v.aval.weak_type)
           for v in closed.jaxpr.invars]
  return jax.make_jaxpr(lambda *args: _run_inlined(
      closed.jaxpr, closed.consts, args))(*avals)


def gather_numbers(eqn: Any) -> tuple[tuple[int, ...], tuple[int, ...],
                                      tuple[int, ...]]:
  """``(offset_dims, collapsed_slice_dims, start_index_map)`` of a
  ``gather``."""
  numbers = eqn.params['dimension_numbers']
  return (tuple(numbers.offset_dims), tuple(numbers.collapsed_slice_dims),
          tuple(numbers.start_index_map))


def gather_mode(eqn: Any) -> str:
  """A ``gather``'s out-of-bounds mode by name (``'CLIP'``,
  ``'FILL_OR_DROP'``, ``'PROMISE_IN_BOUNDS'``)."""
  return eqn.params['mode'].name
