"""What :func:`taco`'s ``init`` says when no dimension numbers were given.

The default (:func:`dimension_numbers.rank2_matrices`) takes every rank-2
leaf for a Flax ``(in, out)`` kernel. That is right for Flax and silently
wrong elsewhere, so ``init`` refuses a tree of Equinox modules (whose
``Linear`` weights are ``(out, in)``), and warns once per call about what it
leaves out or may get wrong: rank >= 3 leaves (to Adam) and rank-2 leaves
named like embedding tables (routed as kernels, not as vocabulary rows),
naming the routing helper that fits the framework the tree comes from.
"""

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp

from taco_optax._src.transform import dimension_numbers as dn

_logger = logging.getLogger('taco_optax')


def _node_modules(tree: Any) -> set[str]:
  """The modules of the types (and their bases) of ``tree``'s nodes."""
  found = set()
  pending = [tree]
  while pending:
    node = pending.pop()
    found.update(cls.__module__ for cls in type(node).__mro__)
    children = jax.tree.leaves(node, is_leaf=lambda x, node=node: x is not node)
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


def _shown(named: list[tuple[str, tuple[int, ...]]]) -> str:
  shown = ', '.join(f'{name} {shape}' for name, shape in named[:8])
  return shown + (f' and {len(named) - 8} more' if len(named) > 8 else '')


def checked_init(init: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """``init`` that refuses Equinox trees and warns (once per call) about the
  leaves the default routing leaves out or may misroute."""

  def init_fn(params):
    framework = framework_of(params)
    if framework == 'equinox':
      _refuse_equinox(params)
    _warn(params, framework)
    return init(params)

  return init_fn
