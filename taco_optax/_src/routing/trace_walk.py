"""Every use of every parameter in a jaxpr, in the parameter's own axes.

:func:`walk` walks a jaxpr whose first inputs are the flattened parameters.
Each value carries its :class:`trace_views.View`\\ s (which parameters it is
a view of) and whether it depends on data (the other inputs): a value made
of weights and constants only stays a view through elementwise ops (``W *
mask``, ``W + A @ B``); one that mixed in data (``h + b``) is an activation.

What each equation does with a view is a :class:`trace_uses.Use`
(``dot_general``, ``ragged_dot``, ``gather``, convolutions, opaque
kernels); this module carries the views through everything else: views
through structural ops (:mod:`trace_views`), weight-only values through
elementwise ops, and operands into sub-jaxprs (``jit``, ``remat``,
``custom_vjp``/``custom_jvp``, ``scan``, ``cond``, ``while``,
``shard_map``), a ``scan``'s sliced leading axis becoming a batch axis, and
the views they return back out.

Primitive names and parameters are jaxpr internals, read through
:mod:`jaxpr_internals`.
"""

from typing import Any, Sequence

from taco_optax._src.routing import jaxpr_internals as jx
from taco_optax._src.routing import trace_uses
from taco_optax._src.routing import trace_views
from taco_optax._src.routing.trace_uses import Found
from taco_optax._src.routing.trace_uses import Use
from taco_optax._src.routing.trace_uses import Value

# Kernels whose use of a weight the trace cannot read.
OPAQUE = frozenset(('pallas_call', 'ffi_call', 'custom_call',
                    'tpu_custom_call', 'mosaic_gpu_call', 'triton_kernel_call',
                    'pure_callback', 'io_callback'))
IGNORED = frozenset(('debug_callback', 'debug_print'))
CONVOLUTIONS = frozenset(('conv_general_dilated',))
# Elementwise ops and reductions: values, not axes, of a weight.
ELEMENTWISE_PRIMITIVES = frozenset((
    'abs', 'acos', 'acosh', 'add', 'add_any', 'and', 'argmax', 'argmin',
    'asin', 'asinh', 'atan', 'atan2', 'atanh', 'cbrt', 'ceil', 'clamp',
    'cos', 'cosh', 'cumsum', 'cumprod', 'cummax', 'cummin', 'cumlogsumexp',
    'digamma', 'div', 'eq', 'erf', 'erfc', 'erf_inv', 'exp', 'exp2', 'expm1',
    'floor', 'ge', 'gt', 'integer_pow', 'is_finite', 'le', 'lgamma', 'log',
    'log1p', 'logistic', 'lt', 'max', 'min', 'mul', 'ne', 'neg', 'nextafter',
    'not', 'or', 'pow', 'reduce_and', 'reduce_max', 'reduce_min', 'reduce_or',
    'reduce_prod', 'reduce_sum', 'reduce_xor', 'rem', 'round', 'rsqrt',
    'select_n', 'sign', 'sin', 'sinh', 'sqrt', 'square', 'sub', 'tan', 'tanh',
    'xor', 'psum', 'pmax', 'pmin', 'square', 'sort', 'top_k', 'imag', 'real',
    'conj', 'bitcast_convert_type'))


def _value(env: dict[Any, Value], var: Any) -> Value:
  if jx.is_literal(var):
    return Value()
  return env.get(var, Value())


def walk(jaxpr: Any, inputs: Sequence[Value], names: Sequence[str]
         ) -> tuple[list[Value], Found]:
  """The values of ``jaxpr``'s outputs and the parameter uses inside.

  Args:
    jaxpr: a ``Jaxpr`` or ``ClosedJaxpr`` (its constants carry no view).
    inputs: one :class:`Value` per input variable.
    names: the parameters' paths, for the uses' descriptions.
  """
  jaxpr = jx.open_jaxpr(jaxpr)
  if len(inputs) != len(jaxpr.invars):
    raise AssertionError(
        f'{len(inputs)} operands for a jaxpr of {len(jaxpr.invars)} inputs: '
        'a jax upgrade changed a primitive this trace reads.')
  env = dict(zip(jaxpr.invars, inputs))
  consumers = _consumers(jaxpr)
  found: Found = []
  for eqn in jaxpr.eqns:
    ins = [_value(env, v) for v in eqn.invars]
    outs, uses = _equation(eqn, ins, names, consumers)
    found += uses
    for var, value in zip(eqn.outvars, outs):
      if not jx.is_dropped(var):
        env[var] = value
  return [_value(env, v) for v in jaxpr.outvars], found


def _consumers(jaxpr: Any) -> dict[Any, list[Any]]:
  """The equations reading each variable (``None`` for an output)."""
  readers: dict[Any, list[Any]] = {}
  for eqn in jaxpr.eqns:
    for var in eqn.invars:
      if not jx.is_literal(var):
        readers.setdefault(var, []).append(eqn)
  for var in jaxpr.outvars:
    if not jx.is_literal(var):
      readers.setdefault(var, []).append(None)
  return readers


def _equation(eqn: Any, ins: list[Value], names: Sequence[str],
              consumers: dict[Any, list[Any]]) -> tuple[list[Value], Found]:
  """The values ``eqn`` makes and the parameter uses it is."""
  name = jx.primitive(eqn)
  data = any(value.data for value in ins)
  plain = [Value(data=data)] * len(eqn.outvars)
  if not any(value.views for value in ins) or name in IGNORED:
    return plain, []
  if name == 'dot_general':
    return plain, trace_uses.dot_uses(eqn, ins, names, consumers)
  if name == 'ragged_dot_general':
    return plain, trace_uses.ragged_uses(eqn, ins)
  if name == 'gather':
    return plain, trace_uses.lookups(eqn, ins)
  if name in trace_views.STRUCTURAL:
    return _structural(eqn, ins, data)
  if name in _WALKED:
    return _WALKED[name](eqn, ins, names)
  if name in ELEMENTWISE_PRIMITIVES:
    return _elementwise(eqn, ins, data)
  if name in CONVOLUTIONS:
    kind, how = trace_uses.CONVOLUTION, 'a convolution: no TACO rule'
  else:
    kind, how = trace_uses.AMBIGUOUS, f'an opaque kernel ({name}) consumes it'
  return plain, [(v.leaf, Use(kind, how)) for value in ins
                 for v in value.views]


def _elementwise(eqn: Any, ins: list[Value], data: bool
                 ) -> tuple[list[Value], Found]:
  """A weight-only result keeps its operands' views (``W * mask``)."""
  shape_of = trace_uses.shape_of
  views = () if data else trace_views.elementwise_views(
      [value.views for value in ins], [shape_of(v) for v in eqn.invars],
      shape_of(eqn.outvars[0]))
  uses = [(v.leaf, Use(trace_uses.ELEMENTWISE, jx.primitive(eqn)))
          for value in ins for v in value.views]
  plain = [Value(data=data)] * (len(eqn.outvars) - 1)
  return [Value(views, data)] + plain, uses


def _structural(eqn: Any, ins: list[Value], data: bool
                ) -> tuple[list[Value], Found]:
  name = jx.primitive(eqn)
  if name == 'optimization_barrier':
    return list(ins), []
  in_shape = trace_uses.shape_of(eqn.invars[0])
  out_shape = trace_uses.shape_of(eqn.outvars[0])
  sources = ins if name == 'concatenate' else ins[:1]
  views, uses = [], []
  for view in (v for value in sources for v in value.views):
    new = trace_views.moved(eqn, view, in_shape, out_shape)
    if new is None:
      uses.append((view.leaf, Use(trace_uses.AMBIGUOUS, f'a reshape '
                                  f'{in_shape} -> {out_shape} mixes its axes')))
    views.append(new or view)
  if name == 'dynamic_slice' and any(value.data for value in ins[1:]):
    uses += trace_uses.picked_rows(eqn, ins)
  return [Value(tuple(views), data)] * len(eqn.outvars), uses


def _kept_carries(body: Any, offset: int, count: int) -> set[int]:
  """The loop carries the body returns unchanged (a weight passed along)."""
  return {i for i in range(count)
          if body.outvars[i] is body.invars[offset + i]}


def _carried(init: Sequence[Value], kept: set[int]) -> list[Value]:
  return [init[i] if i in kept else Value(data=True)
          for i in range(len(init))]


def _call(eqn: Any, ins: list[Value], names: Sequence[str]
          ) -> tuple[list[Value], Found]:
  return walk(jx.called_jaxpr(eqn), ins, names)


def _scan(eqn: Any, ins: list[Value], names: Sequence[str]
          ) -> tuple[list[Value], Found]:
  consts, carries = jx.scan_split(eqn)
  body = jx.scan_body(eqn)
  carry = _carried(ins[consts:consts + carries],
                   _kept_carries(body, consts, carries))
  xs = [Value(tuple(trace_views.sliced(v) for v in x.views), x.data)
        for x in ins[consts + carries:]]
  outs, found = walk(body, ins[:consts] + carry + xs, names)
  ys = [Value(tuple(trace_views.stacked(v) for v in y.views), y.data)
        for y in outs[carries:]]
  return carry + ys, found


def _while(eqn: Any, ins: list[Value], names: Sequence[str]
           ) -> tuple[list[Value], Found]:
  cond_consts, body_consts = jx.while_split(eqn)
  cond, body = jx.while_jaxprs(eqn)
  init = ins[cond_consts + body_consts:]
  carry = _carried(init, _kept_carries(body, body_consts, len(init)))
  _, in_body = walk(body, ins[cond_consts:cond_consts + body_consts] + carry,
                    names)
  _, in_cond = walk(cond, ins[:cond_consts] + carry,
                    names)
  return carry, in_body + in_cond


def _cond(eqn: Any, ins: list[Value], names: Sequence[str]
          ) -> tuple[list[Value], Found]:
  walked = [walk(branch, ins[1:], names)
            for branch in jx.cond_branches(eqn)]
  outs = []
  for values in zip(*(outs for outs, _ in walked)):
    common = tuple(v for v in values[0].views
                   if all(v in other.views for other in values))
    outs.append(Value(common, any(value.data for value in values)))
  return outs, [use for _, found in walked for use in found]


_WALKED = {**{name: _call for name in jx.CALLS}, 'scan': _scan,
           'while': _while, 'cond': _cond}
