"""TACO's dimension numbers read from an Equinox model's own modules.

Imported by :mod:`taco_optax.equinox` only (it needs Equinox). Every array of
the model is routed by the ``eqx.Module`` that holds it as a field, in the
layout that module declares (Equinox stores ``(out, in)``, the transpose of
Flax's ``(in, out)``):

==============================================  =============================
``eqx.nn.Linear`` ``weight`` ``(out, in)``      reduction 1, output 0
(``MultiheadAttention``'s projections and
``MLP``'s layers are ``Linear`` modules)
``eqx.nn.GRUCell``, ``LSTMCell``                reduction 1, output 0 (the
``weight_ih`` ``(gates * hidden, in)``,         gates stacked on the rows)
``weight_hh``
``eqx.nn.Embedding`` ``weight`` ``(vocab, d)``  rows are tokens: reduction 1,
                                                output 0; update scale 1
``bias``, norms' parameters, ``WeightNorm``'s   Adam, also when stacked to
``g``, a ``Linear`` with a ``'scalar'`` side,   rank 2
vectors, integers
convolutions (``Conv*``, ``ConvTranspose*``)    Adam, saying so
other modules' arrays of rank >= 2              Adam, saying so (and logged)
==============================================  =============================

A known module's weight with more axes than it declares (layers stacked by
``eqx.filter_vmap``, whose ``out_axes=0`` puts the layer axis first) has the
extra leading axes as batch axes: each layer is its own matrix. The trailing
axes must be the shape the module declares (``(out_features,
in_features)``), else the weight is refused.
"""

from typing import Any, Mapping, NamedTuple, Optional, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from taco_optax._src.routing import dimension_numbers as dn
from taco_optax._src.routing import overrides as overrides_lib

DN = dn.TacoDimensionNumbers
TABLE_SCALE = 1.0  # the paper's update scale for a token table

# Modules whose every array is a vector (a stack of vectors when stacked).
_VECTOR_MODULES = (eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.GroupNorm,
                   eqx.nn.BatchNorm, eqx.nn.PReLU)
_VECTOR_FIELDS = ('bias', 'bias_n')  # bias_n: GRUCell's
_CONVS = (eqx.nn.Conv, eqx.nn.ConvTranspose)
_GATES = {eqx.nn.GRUCell: 3, eqx.nn.LSTMCell: 4}


class Route(NamedTuple):
  """What a module says of one of its arrays.

  Attributes:
    entry: ``decided(TacoDimensionNumbers, source)``, or a :class:`ToAdam`
      with its reason.
    table: whether it is an embedding table (update scale 1).
    refused: why no axes can be given (``entry`` is then ``None``).
    unknown: an array of rank >= 2 of a module without a rule (sent to Adam,
      logged).
  """
  entry: Any = None
  table: bool = False
  refused: Optional[str] = None
  unknown: bool = False


class Site(NamedTuple):
  """One array of the model, as the rules read it.

  Attributes:
    module: the ``eqx.Module`` holding it as a field (``None``: a container
      that is not a module, such as a top-level list, holds it).
    field: the name of that field (``'weight'``).
    where: the array's ``'/'``-joined path in the model.
    shape: its shape.
    dtype: its dtype.
  """
  module: Any
  field: str
  where: str
  shape: tuple[int, ...]
  dtype: Any


def _owner(module: Any) -> str:
  if module is None:
    return 'no eqx.Module'
  cls = type(module)
  if cls.__module__.startswith('equinox.nn'):
    return f'eqx.nn.{cls.__name__}'
  return f'{cls.__module__}.{cls.__qualname__}'


def _compact(axes: tuple[int, ...]) -> Any:
  return axes[0] if len(axes) == 1 else tuple(axes)


def _declared(site: Site, declared: tuple[int, ...], source: str,
              table: bool = False) -> Route:
  """The ``(out, in)`` weight ``site`` of a module that declares it as
  ``declared``; leading axes beyond those are batch axes (a stack)."""
  extra = len(site.shape) - len(declared)
  if extra < 0 or site.shape[extra:] != tuple(declared):
    return Route(refused=f'shape {site.shape}, but {_owner(site.module)} '
                 f'declares its {site.field} as {tuple(declared)}')
  if extra:
    source += f'; stacked: batch axis {_compact(tuple(range(extra)))}'
  return Route(dn.decided(DN(extra + 1, extra), source), table=table)


def _linear_rule(site: Site) -> Optional[Route]:
  module = site.module
  if not isinstance(module, eqx.nn.Linear) or site.field != 'weight':
    return None
  if 'scalar' in (module.in_features, module.out_features):
    return Route(dn.ToAdam(
        "eqx.nn.Linear weight with a 'scalar' side: a vector"))
  # Both are ints here ('scalar' returned above).
  sides = cast(tuple[int, int], (module.out_features, module.in_features))
  return _declared(site, sides,
                   'eqx.nn.Linear weight (out, in)')


def _embedding_rule(site: Site) -> Optional[Route]:
  module = site.module
  if not isinstance(module, eqx.nn.Embedding) or site.field != 'weight':
    return None
  return _declared(site, (module.num_embeddings, module.embedding_size),
                   'eqx.nn.Embedding weight (vocab, d): vocabulary rows',
                   table=True)


def _cell_rule(site: Site) -> Optional[Route]:
  module = site.module
  gates = _GATES.get(type(module))
  if gates is None or site.field not in ('weight_ih', 'weight_hh'):
    return None
  inputs = (module.input_size if site.field == 'weight_ih'
            else module.hidden_size)
  return _declared(site, (gates * module.hidden_size, inputs),
                   f'{_owner(module)} {site.field} (gates * hidden, in)')


def site_route(site: Site) -> Route:
  """The route of one array, from the module that holds it."""
  owner, rank = _owner(site.module), len(site.shape)
  if not jnp.issubdtype(site.dtype, jnp.floating):
    return Route(dn.ToAdam(f'{owner} {site.field}: {site.dtype}'))
  if (site.field in _VECTOR_FIELDS or isinstance(site.module, _VECTOR_MODULES)
      or isinstance(site.module, eqx.nn.WeightNorm) and site.field == 'g'):
    return Route(dn.ToAdam(f'{owner} {site.field}'))
  if rank < 2:
    return Route(dn.ToAdam(f'{owner} {site.field}: rank {rank}'))
  if isinstance(site.module, _CONVS):
    return Route(dn.ToAdam(
        f'{owner} {site.where}: convolution kernels go to Adam'))
  for rule in (_linear_rule, _embedding_rule, _cell_rule):
    found = rule(site)
    if found is not None:
      return found
  return Route(dn.ToAdam(
      f'{owner} {site.where}: no TACO rule for this module'), unknown=True)


def _field_name(key: Any) -> str:
  return str(getattr(key, 'name', getattr(key, 'key', getattr(key, 'idx',
                                                              key))))


def sites(model: Any) -> dict[tuple[Any, ...], Site]:
  """Every array of ``model`` by its key path, with the module holding it."""
  found = {}

  def walk(node: Any, prefix: tuple[Any, ...]) -> None:
    is_inner = lambda x: x is not node and isinstance(x, eqx.Module)
    leaves = jax.tree_util.tree_flatten_with_path(node, is_leaf=is_inner)[0]
    for path, leaf in leaves:
      if is_inner(leaf):
        walk(leaf, prefix + tuple(path))
      elif eqx.is_array(leaf):
        module = node if isinstance(node, eqx.Module) else None
        full = prefix + tuple(path)
        found[full] = Site(module, _field_name(path[0]) if path else '',
                           dn.path_name(full), tuple(np.shape(leaf)),
                           leaf.dtype)

  walk(model, ())
  return found


def routes(model: Any, filter_spec: Any) -> Any:
  """``eqx.filter(model, filter_spec)`` with each leaf replaced by its
  :class:`Route` (a leaf that is not an array: ``ToAdam``)."""
  found = sites(model)

  def route(path, leaf):
    site = found.get(tuple(path))
    if site is None:
      return Route(dn.ToAdam(f'not an array: {type(leaf).__name__}'))
    return site_route(site)

  return jax.tree_util.tree_map_with_path(
      route, eqx.filter(model, filter_spec))


def _is_route(x: Any) -> bool:
  return isinstance(x, Route)


def dimension_numbers(model: Any, filter_spec: Any,
                      overrides: Mapping[str, Any]) -> Any:
  """The tree of entries of ``eqx.filter(model, filter_spec)``.

  Raises:
    ValueError: naming every array no rule and no override covers, and
      every override pattern that matches no array.
  """
  book = overrides_lib.Overrides(
      'taco_optax.equinox.dimension_numbers', overrides,
      "dimension_numbers(model, overrides={'layers/*/weight': "
      'TacoDimensionNumbers(reduction_axis=2, output_axis=1)})')

  def decide(name, unused_path, route):
    if route.refused is not None:
      book.refuse(f'  {name}: {route.refused}')
      return None
    if route.unknown:
      book.unknown(name)
    return route.entry

  return book.entries(routes(model, filter_spec), decide, is_leaf=_is_route)


def update_scales(model: Any, filter_spec: Any) -> Any:
  """``TABLE_SCALE`` for every embedding table of the filtered model, else
  ``None``."""
  return jax.tree.map(lambda route: TABLE_SCALE if route.table else None,
                      routes(model, filter_spec), is_leaf=_is_route)
