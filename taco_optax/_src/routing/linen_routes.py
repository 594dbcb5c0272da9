"""TACO's dimension numbers read from a Flax Linen model's own modules.

Imported by :mod:`taco_optax.linen` only (it needs Flax).
:func:`abstract_params` runs ``module.init`` under :func:`jax.eval_shape` and
:func:`flax.linen.intercept_methods`; each module records the :class:`Route`
and shape of the parameters it owns. Inside lifted transforms (scopes with a
root of their own) parameters are also boxed in :class:`Seen`, a
:class:`flax.linen.meta.AxisMetadata`: ``nn.scan`` and ``nn.vmap`` call its
``add_axis(index, ...)`` as they stack, so the layer axis is known wherever
``variable_axes`` put it (a batch axis). Axes changed otherwise
(``nn.map_variables``) are refused, not guessed; a model that trips over the
boxes (``nn.SpectralNorm`` reads raw variables) is traced again without them.

==========================================  ==================================
``nn.Dense`` ``kernel`` ``(in, out)``        reduction 0, output 1
``nn.DenseGeneral`` ``kernel`` (and a        ``batch_dims`` batch, ``axis``
module with ``features`` and ``axis``)       (reduction), ``features`` (output)
``nn.Einsum`` ``kernel``; a module with an   read from the einsum, as for
``einsum_str``, its one weight of the        NNX (:mod:`.einsum`)
einsum's rank
``nn.Embed`` ``embedding`` ``(vocab, d)``    rows are tokens: reduction 1,
(and ``num_embeddings``, ``features``)       output 0; update scale 1
``bias``, ``scale``, norms' parameters,      Adam, also when stacked to rank 2
vectors, integers
convolutions; other modules' matrices        Adam, saying so (and, for other
                                             modules, logged once)
==========================================  ==================================
"""

import logging
from typing import Any, Mapping, NamedTuple, Optional

from flax import linen as nn
from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

from taco_optax._src.routing import dimension_numbers as dn
from taco_optax._src.routing import einsum
from taco_optax._src.routing import overrides as overrides_lib

DN = dn.TacoDimensionNumbers
TABLE_SCALE = 1.0  # the paper's update scale for a token table

_logger = logging.getLogger('taco_optax')
_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm,
          nn.InstanceNorm)
_CONVS = (nn.Conv, nn.ConvTranspose, nn.ConvLocal)
_VECTOR_NAMES = ('bias', 'scale')


class Route(NamedTuple):
  """What a module says of one of its parameters, over the axes it saw."""
  entry: Any = None  # decided(TacoDimensionNumbers, source), or ToAdam
  table: bool = False  # an embedding table: update scale 1
  refused: Optional[str] = None  # why no axes can be told (entry None)
  unknown: bool = False  # a matrix of a module without a rule (logged)


class Record(NamedTuple):
  """A parameter as the module that owns it saw it."""
  route: Route
  shape: tuple[int, ...]  # one layer's, in a stack


class Seen(struct.PyTreeNode, nn.meta.AxisMetadata):
  """A parameter created inside a lifted transform: ``value`` (or the user's
  own metadata box of it) and the ``index`` of every ``add_axis`` since."""
  value: Any
  inserted: tuple[int, ...] = struct.field(pytree_node=False, default=())

  def unbox(self) -> Any:
    return self.value

  def replace_boxed(self, val: Any) -> 'Seen':
    return self.replace(value=val)

  def add_axis(self, index: int, params: dict[Any, Any]) -> 'Seen':
    return self.replace(value=nn.meta.add_axis(self.value, index, params),
                        inserted=self.inserted + (index,))

  def remove_axis(self, index: int, params: dict[Any, Any]) -> 'Seen':
    return self.replace(value=nn.meta.remove_axis(self.value, index, params),
                        inserted=self.inserted[:-1])


class _Site(NamedTuple):
  """One parameter of one module call, as the rules read it."""
  module: nn.Module
  name: str
  shape: tuple[int, ...]
  owner: str  # 'nn.Dense', or the class's module and name
  where: str  # 'layers/Dense_0/kernel'
  einsum_str: Optional[str]
  sibling_ranks: Mapping[str, int]


def _owner(module: nn.Module) -> str:
  cls = type(module)
  if cls.__module__.startswith('flax.linen'):
    return f'nn.{cls.__name__}'
  return f'{cls.__module__}.{cls.__qualname__}'


def _compact(axes: tuple[int, ...]) -> Any:
  return axes[0] if len(axes) == 1 else tuple(axes)


def _decided(reduction, output, source: str, table: bool = False) -> Route:
  dims = DN(_compact(tuple(reduction)), _compact(tuple(output)))
  return Route(dn.decided(dims, source), table=table)


def _embed_rule(site: _Site) -> Optional[Route]:
  module = site.module
  declared = (getattr(module, 'num_embeddings', None),
              getattr(module, 'features', None))  # nn.Embed's, MaxText's
  if site.name == 'embedding' and (isinstance(module, nn.Embed)
                                   or site.shape == declared):
    return _decided((1,), (0,), f'{site.owner} embedding: vocabulary rows',
                    table=True)
  return None


def _dense_rule(site: _Site) -> Optional[Route]:
  module = site.module
  if site.name != 'kernel':
    return None
  if isinstance(module, nn.Dense):
    return _decided((0,), (1,), 'nn.Dense kernel (in, out)')
  general = isinstance(module, nn.DenseGeneral)
  if not general and not (hasattr(module, 'features')
                          and hasattr(module, 'axis')):
    return None
  batch = len(dn.as_tuple(getattr(module, 'batch_dims', ())))
  inputs = len(dn.as_tuple(module.axis))
  features = dn.as_tuple(module.features)
  outputs = len(features)
  if (len(site.shape) != batch + inputs + outputs
      or site.shape[batch + inputs:] != features):
    return None  # not laid out as a DenseGeneral's kernel: no rule
  source = (f'{site.owner} kernel (batch_dims, axis, features)' if general
            else f'{site.owner} kernel (axis, features), as nn.DenseGeneral')
  return _decided(range(batch, batch + inputs),
                  range(batch + inputs, batch + inputs + outputs), source)


def _einsum_rule(site: _Site) -> Optional[Route]:
  einsum_str = site.einsum_str
  if not isinstance(einsum_str, str):
    return None
  try:
    rank = einsum.weight_rank(einsum_str)
    if isinstance(site.module, nn.Einsum):
      if site.name != 'kernel':
        return None
    elif [n for n, r in site.sibling_ranks.items() if r == rank] != [
        site.name]:
      return None  # not the one weight of the einsum's rank
    declared = einsum.weight_dimension_numbers(einsum_str)
  except einsum.AmbiguousEinsum as error:
    return Route(refused=str(error))
  if rank != len(site.shape):
    return Route(refused=f'rank {len(site.shape)}, but the weight of '
                 f'{einsum_str!r} has rank {rank}')
  return _decided(dn.as_tuple(declared.reduction_axis),
                  dn.as_tuple(declared.output_axis),
                  f'{site.owner} {site.name} of {einsum_str!r}')


def site_route(site: _Site, dtype: Any) -> Route:
  """The route of one parameter, from the module that owns it."""
  if site.name in _VECTOR_NAMES or isinstance(site.module, _NORMS):
    return Route(dn.ToAdam(f'{site.owner} {site.name}'))
  if not jnp.issubdtype(dtype, jnp.floating):
    return Route(dn.ToAdam(f'{site.owner} {site.name}: {dtype}'))
  if len(site.shape) < 2:
    return Route(dn.ToAdam(f'{site.owner} {site.name}: not a matrix'))
  if isinstance(site.module, _CONVS):
    return Route(dn.ToAdam(
        f'{site.owner} {site.where}: convolution kernels go to Adam'))
  for rule in (_embed_rule, _dense_rule, _einsum_rule):
    found = rule(site)
    if found is not None:
      return found
  return Route(dn.ToAdam(
      f'{site.owner} {site.where}: no TACO rule for this module'),
               unknown=True)


def _call_einsum_str(module: nn.Module, method: str, args, kwargs):
  given = kwargs.get('einsum_str', args[1] if len(args) > 1 else None)
  if method == '__call__' and isinstance(given, str):  # nn.Einsum's may be
    return given
  return getattr(module, 'einsum_str', None)


def _owns_its_scope(module: nn.Module) -> bool:
  # Not a lifted transform's wrapper (the module it wraps has the scope).
  # mypy: a bound module has a scope.
  path = module.scope.path  # type: ignore[union-attr]
  return path[-1:] == (() if module.name is None else (module.name,))


def _record_own_params(module: nn.Module, call, records: dict, box: bool
                       ) -> None:
  """Records (and, if ``box``, boxes) each parameter ``module`` owns."""
  if not _owns_its_scope(module) or not module.is_mutable_collection(
      'params'):
    return
  own = {name: value
         for name, value in module.variables.get('params', {}).items()
         if not isinstance(value, Mapping)}
  raw = {name: nn.meta.unbox(value) for name, value in own.items()}
  ranks = {name: jnp.ndim(value) for name, value in raw.items()}
  einsum_str = _call_einsum_str(module, *call)
  for name, value in own.items():
    # mypy: a bound module has a scope.
    path = module.scope.path + (name,)  # type: ignore[union-attr]
    if path not in records:
      shape = tuple(jnp.shape(raw[name]))
      site = _Site(module, name, shape, _owner(module), '/'.join(path),
                   einsum_str, ranks)
      records[path] = Record(site_route(site, raw[name].dtype), shape)
    if box and not isinstance(value, Seen):
      module.put_variable('params', name, Seen(value))


class _Recorder:
  """The interceptor: records a module's parameters as its outermost call
  returns (``nn.Einsum.__call__``, not its helper, knows the einsum), and
  boxes them if ``box`` inside lifted transforms (a scope root of their own).
  """

  def __init__(self, box: bool):
    self.box = box
    self.records: dict[Any, Any] = {}
    self._active: list[Any] = []
    self._root = None  # the scope of module.init itself

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if self._root is None and module.scope is not None:
      self._root = module.scope.root
    self._active.append(module)
    try:
      out = next_fun(*args, **kwargs)
    finally:
      self._active.pop()
    if module.scope is not None and all(m is not module for m in self._active):
      lifted = module.scope.root is not self._root
      _record_own_params(module, (context.method_name, args, kwargs),
                         self.records, box=self.box and lifted)
    return out


_ARRAYS = (jax.Array, np.ndarray, jax.ShapeDtypeStruct)


def abstract_params(module: nn.Module, rngs: Any, args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]
                    ) -> tuple[Any, dict[tuple[str, ...], Record]]:
  """``module.init(rngs, *args, **kwargs)['params']``, abstract (leaves of
  lifted transforms' modules boxed in :class:`Seen`), and the record of every
  parameter by path.

  Arrays among the arguments (``jax.ShapeDtypeStruct`` too) are traced;
  anything else (``train=False``) is passed as it is.
  """
  leaves, treedef = jax.tree.flatten((args, dict(kwargs)))
  arrays = [leaf for leaf in leaves if isinstance(leaf, _ARRAYS)]

  def init(rngs, arrays):
    given = iter(arrays)
    call_args, call_kwargs = treedef.unflatten(
        [next(given) if isinstance(leaf, _ARRAYS) else leaf for leaf in leaves])
    return module.init(rngs, *call_args, **call_kwargs)

  def traced(box: bool):
    recorder = _Recorder(box)
    with nn.intercept_methods(recorder):
      variables = jax.eval_shape(init, rngs, arrays)
    return variables.get('params', {}), recorder.records

  try:
    return traced(box=True)
  except Exception as error:  # pylint: disable=broad-except
    found = traced(box=False)  # the model's own error raises again here
    _logger.warning(
        'taco_optax.linen: the model reads the raw variables of a lifted '
        'transform (%s: %s), where the boxes that follow nn.scan and '
        'nn.vmap layer axes are; traced again without them, so stacked '
        'matrices need overrides.', type(error).__name__, error)
    return found


class _Refused(Exception):
  """No rule says this parameter's axes (the reason is the message)."""


def _stacked(record: Record, inserted: tuple[int, ...],
             shape: tuple[int, ...]) -> Any:
  """``record``'s entry over the axes of ``shape``, where lifted transforms
  inserted the axes ``inserted`` (batch axes)."""
  entry = record.route.entry
  if isinstance(entry, dn.ToAdam):
    return entry  # Adam needs no axes
  layers: list[Any] = []
  axes = [dn.as_tuple(entry.reduction_axis),
          dn.as_tuple(entry.output_axis)]
  for index in inserted:  # each add_axis shifts the axes at or after it
    layers = [a + (a >= index) for a in layers] + [index]
    axes = [tuple(a + (a >= index) for a in group) for group in axes]
  inner = tuple(size for axis, size in enumerate(shape) if axis not in layers)
  if len(shape) != len(record.shape) + len(layers) or inner != record.shape:
    raise _Refused(
        f'its module created it as {record.shape}; no transform said where '
        'the other axes are (nn.scan and nn.vmap modules do), so the layer '
        'axis cannot be located')
  if not inserted:
    return entry
  source = (f'{dn.source_of(entry)}; stacked: batch axis '
            f'{_compact(tuple(sorted(layers)))}')
  return dn.decided(DN(*map(_compact, axes)), source)


def _leaf_entry(leaf: Any, record: Optional[Record]) -> Any:
  value = nn.meta.unbox(leaf)
  if record is None:
    if jnp.ndim(value) < 2 or not jnp.issubdtype(value.dtype, jnp.floating):
      return dn.ToAdam('not a matrix')
    raise _Refused('no Linen module method was seen creating it')
  if record.route.refused is not None:
    raise _Refused(record.route.refused)
  inserted = leaf.inserted if isinstance(leaf, Seen) else ()
  return _stacked(record, inserted, tuple(jnp.shape(value)))


def _is_param(x: Any) -> bool:
  return isinstance(x, Seen) or nn.meta.is_axis_metadata(x)


def _keys(path: tuple[Any, ...]) -> tuple[str, ...]:
  return tuple(str(getattr(entry, 'key', entry)) for entry in path)


def dimension_numbers(params: Any, records: Mapping[tuple[str, ...], Record],
                      overrides: Mapping[str, Any]) -> Any:
  """The entries for :func:`abstract_params`' ``params`` and ``records``.

  Raises:
    ValueError: naming every parameter no rule and no override covers, and
      every override pattern that matches no parameter.
  """
  book = overrides_lib.Overrides(
      'taco_optax.linen.dimension_numbers', overrides,
      "dimension_numbers(module, x, overrides={'layers/mlp/kernel': "
      'TacoDimensionNumbers(reduction_axis=1, output_axis=2)})')

  def decide(name, path, leaf):
    shape = tuple(jnp.shape(nn.meta.unbox(leaf)))
    record = records.get(_keys(path))
    try:
      found = _leaf_entry(leaf, record)
    except _Refused as reason:
      book.refuse(f'  {name}: shape {shape}, {reason}')
      return None
    if record is not None and record.route.unknown:
      book.unknown(f'{name} {shape}')
    return found

  return book.entries(params, decide, is_leaf=_is_param)


def update_scales(params: Any, records: Mapping[tuple[str, ...], Record]
                  ) -> Any:
  """``TABLE_SCALE`` for each embedding table of ``params``, else None."""

  def scale(path, _):
    record = records.get(_keys(path))
    return TABLE_SCALE if record is not None and record.route.table else None

  return jax.tree_util.tree_map_with_path(scale, params, is_leaf=_is_param)

