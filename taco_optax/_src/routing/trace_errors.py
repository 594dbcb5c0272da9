"""The errors of :func:`taco_optax.trace_dimension_numbers`, worded once."""

from typing import Mapping, Sequence

_HINT = ("say them in overrides={'<path pattern>': TacoDimensionNumbers("
         "reduction_axis=..., output_axis=...)} (fnmatch over '/'-joined "
         'paths; None sends a leaf to Adam)')


def unused(named: Sequence[tuple[str, tuple[int, ...]]]) -> str:
  """A refusal naming every matrix leaf ``fn`` never reads."""
  listed = '\n'.join(f'  {name}: shape {shape}' for name, shape in named)
  return (f'trace_dimension_numbers: fn never uses {len(named)} matrix '
          f'parameter(s), so the trace cannot tell their axes:\n{listed}\n'
          'Trace the function that uses them (the loss or the forward, '
          f'reading them from its params argument, not a closure), or {_HINT}.')


def trace_failed(error: BaseException, traced: Mapping[int, int],
                 names: Sequence[str]) -> str:
  """Why ``fn`` did not trace: jax's error, the parameters the failing line
  held (``traced``: the ``id`` of each parameter's tracer, to its index),
  and what the params tree holds."""
  held = _held_parameters(error, traced, names)
  lines = [f'trace_dimension_numbers could not trace fn(params, *args, '
           f'**kwargs): {type(error).__name__}: {error}']
  if held:
    lines.append('The failing line holds parameter(s) ' + ', '.join(held)
                 + '.')
  if isinstance(error, (KeyError, AttributeError, IndexError, TypeError)):
    shown = ', '.join(names[:8]) + (', ...' if len(names) > 8 else '')
    lines.append(f'Do params match the tree and shapes fn expects? params '
                 f'has {len(names)} leaves: {shown}.')
  if 'params_leaves[' in str(error):
    lines.append('(params_leaves[i] is leaf i of params, in the order '
                 'above; args_leaves[i] the i-th array of args and kwargs.)')
  return '\n'.join(lines)


def _held_parameters(error: BaseException, traced: Mapping[int, int],
                     names: Sequence[str]) -> list[str]:
  """The parameters in the innermost frame of the error that holds any."""
  held: list[str] = []
  entry = error.__traceback__
  while entry is not None:
    found = list(dict.fromkeys(
        f'{names[traced[id(value)]]} {tuple(value.shape)}'
        for value in entry.tb_frame.f_locals.values() if id(value) in traced))
    held = found or held
    entry = entry.tb_next
  return held
