"""A weight's TACO axes read from the einsum that uses it.

``jnp.einsum('BTD,DNH->BTNH', x, w)`` (tunix's, Gemma's and Flax's
``Einsum`` modules all compute ``einsum(einsum_str, x, w)``) says what every
axis of the weight ``w`` does:

- in ``x`` and not in the output: summed over, a *reduction* axis (the
  paper's columns);
- in the output and not in ``x``: an *output* axis (the paper's rows), unless
  the output puts it before every axis it shares with ``x`` (``'BTD,SNDH->
  SBTNH'``: ``q, k, v = out``), which stacks separate matrices: a *batch*
  axis, as a fused QKV kernel is three matrices in the paper;
- in ``x`` and in the output: a *batch* axis (each slice its own matrix).

Anything else (an axis of ``w`` alone, a repeated letter, an ellipsis in the
weight, more than two operands, no explicit output) is ambiguous.
"""

from taco_optax._src.routing import dimension_numbers as dn

_ELLIPSIS = '.'


class AmbiguousEinsum(ValueError):
  """The einsum does not say which of the weight's axes are which."""


def _operands(einsum_str: str) -> tuple[str, str, str]:
  spec = einsum_str.replace(' ', '')
  if '->' not in spec:
    raise AmbiguousEinsum(f'{einsum_str!r} has no explicit output (->)')
  inputs, output = spec.split('->')
  operands = inputs.split(',')
  if len(operands) != 2:
    raise AmbiguousEinsum(
        f'{einsum_str!r} has {len(operands)} operands, not (input, weight)')
  lhs, weight = (x.replace('...', _ELLIPSIS) for x in operands)
  return lhs, weight, output.replace('...', _ELLIPSIS)


def weight_dimension_numbers(einsum_str: str) -> dn.TacoDimensionNumbers:
  """The :class:`TacoDimensionNumbers` of ``w`` in ``einsum(einsum_str, x, w)``.

  Args:
    einsum_str: e.g. ``'BTD,DNH->BTNH'`` (a ``(D, N, H)`` query kernel).

  Returns:
    Dimension numbers over the weight's axes, e.g. ``reduction_axis=(0,)``,
    ``output_axis=(1, 2)``; axes in neither are batch axes.

  Raises:
    AmbiguousEinsum: when the einsum does not say it (see the module).

  Examples:
    >>> from taco_optax._src.routing import einsum
    >>> einsum.weight_dimension_numbers('BTNH,NHD->BTD')
    TacoDimensionNumbers(reduction_axis=(0, 1), output_axis=(2,))
  """
  lhs, weight, output = _operands(einsum_str)
  if _ELLIPSIS in weight:
    raise AmbiguousEinsum(f'the weight of {einsum_str!r} has an ellipsis')
  if len(set(weight)) != len(weight):
    raise AmbiguousEinsum(f'the weight of {einsum_str!r} repeats an axis')
  shared = [output.index(c) for c in lhs if c in output]
  first_shared = min(shared, default=-1)  # none shared: nothing stacked
  reduction, out = [], []
  for axis, letter in enumerate(weight):
    in_input, in_output = letter in lhs, letter in output
    if in_input and not in_output:
      reduction.append(axis)
    elif in_output and not in_input:
      if output.index(letter) > first_shared:
        out.append(axis)
    elif not in_input:
      raise AmbiguousEinsum(
          f'axis {letter!r} of the weight of {einsum_str!r} is in neither the '
          'input nor the output')
  if not reduction or not out:
    raise AmbiguousEinsum(
        f'the weight of {einsum_str!r} has no '
        f'{"reduction" if not reduction else "output"} axis')
  return dn.TacoDimensionNumbers(tuple(reduction), tuple(out))


def weight_rank(einsum_str: str) -> int:
  """The number of axes of the weight operand of ``einsum_str``."""
  return len(_operands(einsum_str)[1])


def lora_dimension_numbers(lora_einsum_str: str, factor: str
                           ) -> dn.TacoDimensionNumbers:
  """The axes of a LoRA factor of an einsum weight.

  qwix's LoRA of ``einsum('BTNH,NHD->BTD', x, w)`` computes
  ``einsum('BTNH,NHr,rD->BTD', x, a, b)``: ``a`` maps the input to the rank
  axis ``r`` (and is a weight of ``'BTNH,NHr->BTr'``), ``b`` maps ``r`` to
  the output (a weight of ``'BTr,rD->BTD'``); each is read as
  :func:`weight_dimension_numbers` reads those.

  Args:
    lora_einsum_str: ``'<input>,<a>,<b>-><output>'``.
    factor: ``'a'`` or ``'b'``.

  Raises:
    AmbiguousEinsum: for anything else.
  """
  spec = lora_einsum_str.replace(' ', '').replace('...', _ELLIPSIS)
  inputs, _, output = spec.partition('->')
  operands = inputs.split(',')
  if len(operands) != 3 or not output or factor not in ('a', 'b'):
    raise AmbiguousEinsum(f'{lora_einsum_str!r} is not (input, a, b) -> out')
  lhs, a, b = operands
  rank = a[-1:]
  middle = ''.join(c for c in lhs if c in output) + rank
  if factor == 'a':
    return weight_dimension_numbers(f'{lhs},{a}->{middle}')
  return weight_dimension_numbers(f'{middle},{b}->{output}')
