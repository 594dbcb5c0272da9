"""What :func:`taco`'s ``init`` says when no dimension numbers were given.

The default (:func:`dimension_numbers.rank2_matrices`) takes every rank-2
leaf for a Flax ``(in, out)`` kernel. That is right for Flax and silently
wrong elsewhere, so ``init`` refuses a tree of Equinox modules (whose
``Linear`` weights are ``(out, in)``) and rank-2 leaves the tree itself says
are stored ``(out, in)`` (named ``weight``, or beside a bias as long as axis
0), and warns once per call about what it
leaves out or may get wrong: rank >= 3 leaves (to Adam) and rank-2 leaves
named like embedding tables (routed as kernels, not as vocabulary rows),
naming the routing helper that fits the framework the tree comes from.
"""

import functools
import logging
import operator
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from taco_optax._src.routing import dimension_numbers as dn

_logger = logging.getLogger('taco_optax')


def _node_modules(tree: Any) -> set[str]:
  """The modules of the types (and their bases) of ``tree``'s nodes."""
  found: set[str] = set()
  pending = [tree]
  while pending:
    node = pending.pop()
    found.update(cls.__module__ for cls in type(node).__mro__)
    children = jax.tree.leaves(node, is_leaf=functools.partial(operator.is_not,
                                                           node))
    if not (len(children) == 1 and children[0] is node):
      pending.extend(children)
  return found


def framework_of(params: Any) -> str:
  """``'equinox'``, ``'nnx'``, ``'linen'`` (Flax names: ``kernel``,
  ``embedding``) or ``'other'``, from the tree's node types and names."""
  modules = _node_modules(params)
  if any(m.split('.')[0] == 'equinox' for m in modules):
    return 'equinox'
  if any(m.startswith('flax.nnx') for m in modules):
    return 'nnx'
  names = {dn.path_name(path).rsplit('/', 1)[-1]
           for path, _ in jax.tree_util.tree_leaves_with_path(params)}
  return 'linen' if names & {'kernel', 'embedding'} else 'other'


HELPERS = {
    'nnx': 'weight_dimension_numbers=taco_optax.nnx.dimension_numbers(model)',
    'linen': ('weight_dimension_numbers=taco_optax.linen.dimension_numbers('
              'module, *init_args)'),
    'equinox': ('weight_dimension_numbers=taco_optax.equinox.'
                'dimension_numbers(model)'),
    'other': ('dims, report = taco_optax.trace_dimension_numbers(loss_fn, '
              'params, batch); weight_dimension_numbers=dims'),
}


def _refuse_equinox(params: Any) -> None:
  raise ValueError(
      'taco(): these parameters are Equinox modules, whose Linear weights '
      'are (out, in); the default routing takes rank-2 leaves for Flax (in, '
      'out) kernels and would move one weight per output, by the wrong '
      'scale. Pass taco(..., weight_dimension_numbers=taco_optax.equinox.'
      'dimension_numbers(model), update_scale=taco_optax.equinox.'
      'update_scales(model)).')


def _module_and_name(path: str) -> tuple[str, str]:
  """``('fc', 'weight')`` for ``fc/weight`` and for a flat ``fc.weight``."""
  cut = max(path.rfind('/'), path.rfind('.'))
  return path[:cut], path[cut + 1:]


def pytorch_layout_evidence(params: Any) -> list[tuple[str, tuple[int, ...],
                                                       str]]:
  """The rank-2 leaves the default would take for ``(in, out)`` kernels
  although the tree says they are PyTorch's ``(out, in)``: ``(name, shape,
  why)``.

  Evidence is the name ``weight`` (PyTorch's and Equinox's; Flax says
  ``kernel``), unless a sibling ``bias`` matches axis 1 only, or, under any
  name, being the only matrix beside a ``bias`` that matches axis 0 only.
  """
  modules: dict[str, Any] = {}
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    name = dn.path_name(path)
    module, last = _module_and_name(name)
    modules.setdefault(module, []).append((name, last, tuple(jnp.shape(x))))
  found = []
  for entries in modules.values():
    biases = [shape[0] for _, last, shape in entries
              if last == 'bias' and len(shape) == 1]
    matrices = [(name, last, shape) for name, last, shape in entries
                if len(shape) == 2 and not dn.names_not_matrix(name)]
    for name, last, shape in matrices:
      axis0 = [b for b in biases if b == shape[0] != shape[1]]
      axis1 = [b for b in biases if b == shape[1] != shape[0]]
      if last == 'weight' and not axis1:
        found.append((name, shape, "named 'weight' (PyTorch's (out, in))"))
      elif axis0 and len(matrices) == 1:
        found.append((name, shape, f'its bias has {shape[0]} entries, '
                      'its axis 0'))
  return found


def _refuse_pytorch(found: list[tuple[str, tuple[int, ...], str]]) -> None:
  shown = '; '.join(f'{name} {shape}: {why}' for name, shape, why in found[:4])
  more = f' and {len(found) - 4} more' if len(found) > 4 else ''
  raise ValueError(
      f'taco(): {shown}{more}. These leaves look stored (out, in), as '
      'PyTorch and Hugging Face store them; the default routing takes '
      'rank-2 leaves for Flax (in, out) kernels and would move one weight '
      'per output, by the wrong scale. Give their axes: '
      'weight_dimension_numbers=jax.tree.map(lambda x: '
      'taco_optax.TacoDimensionNumbers(1, 0) if x.ndim == 2 else None, '
      'params), or dims, report = taco_optax.trace_dimension_numbers('
      'loss_fn, params, batch); weight_dimension_numbers=dims.')


def _warn(params: Any, framework: str) -> None:
  leaves = jax.tree_util.tree_leaves_with_path(params)
  floating = [(dn.path_name(path), tuple(jnp.shape(x))) for path, x in leaves
              if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  high = [(name, shape) for name, shape in floating if len(shape) >= 3]
  tables = [(name, shape) for name, shape in floating
            if len(shape) == 2 and dn.names_table(name)
            and not dn.names_not_matrix(name)]
  fix = (f'Give their axes: {HELPERS[framework]}, or a tree of '
         'TacoDimensionNumbers(reduction_axis, output_axis) and None for '
         'Adam; taco_optax.routing_report(tx, params) shows the routing.')
  if high:
    _logger.warning(
        'taco(): %d floating leaves of rank >= 3 go to Adam, not TACO, '
        'because weight_dimension_numbers was not given (the default takes '
        'rank-2 leaves only): %s. %s', len(high), _shown(high), fix)
  if tables:
    _logger.warning(
        'taco(): %s look like embedding tables; the default routes them as '
        '(in, out) kernels (one weight per vocabulary entry, at scale d / '
        'vocabulary). taco_optax routes a table by vocabulary rows: '
        'TacoDimensionNumbers(reduction_axis=1, output_axis=0) and '
        'update_scale 1, as its helpers do. %s', _shown(tables), fix)


def _shown(named: Sequence[tuple[str, tuple[int, ...]]]) -> str:
  shown = ', '.join(f'{name} {shape}' for name, shape in named[:8])
  return shown + (f' and {len(named) - 8} more' if len(named) > 8 else '')


def checked_init(init: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """``init`` that refuses Equinox trees and leaves stored ``(out, in)``
  (:func:`pytorch_layout_evidence`), and warns (once per call) about the
  leaves the default routing leaves out or may misroute."""

  def init_fn(params):
    framework = framework_of(params)
    if framework == 'equinox':
      _refuse_equinox(params)
    found = pytorch_layout_evidence(params)
    if found:
      _refuse_pytorch(found)
    _warn(params, framework)
    return init(params)

  return init_fn
