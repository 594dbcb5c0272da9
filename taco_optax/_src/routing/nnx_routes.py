"""TACO's dimension numbers read from a Flax NNX model's own modules.

Imported by :mod:`taco_optax.nnx` only (it needs Flax). Each parameter is
routed by the module that holds it:

==========================================  ==================================
``nnx.Linear`` ``kernel`` ``(in, out)``      reduction 0, output 1
``nnx.LinearGeneral`` ``kernel``             batch, ``in_features`` (reduction),
                                             ``out_features`` (output)
``nnx.Einsum`` ``kernel``; any module with   read from the einsum
an ``einsum_str`` (tunix, Gemma), its        (:mod:`einsum`)
one weight of the einsum's rank
``nnx.Embed`` ``embedding``, tunix's         rows are tokens: reduction 1
``input_embedding`` ``(vocab, d)``           (features), output 0; scale 1
LoRA ``lora_a`` ``(in, r)``, ``lora_b``      the last two axes (reduction,
``(r, out)`` (``nnx.LoRA``, qwix's           output), leading ones batch;
``<name>_lora_a/b``)                         of an einsum weight: read from
                                             qwix's ``<name>_lora_einsum_str``
``bias``, ``scale``, norms' parameters,     ``None`` (Adam)
vectors, scalars, integers
any other rank-2 parameter                   reduction 0, output 1 (as taco's
                                             default)
any other rank >= 3 parameter                refused: say it in ``overrides``
==========================================  ==================================

A known module's kernel with more axes than the module declares (layers
stacked by ``nnx.vmap``/``nnx.scan``) has the extra leading axes as batch
axes: each layer is its own matrix.
"""

from typing import Any, Mapping, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp

from taco_optax._src.routing import dimension_numbers as dn
from taco_optax._src.routing import einsum
from taco_optax._src.routing import overrides as overrides_lib

DN = dn.TacoDimensionNumbers
TABLE_SCALE = 1.0  # the paper's update scale for a token table


_NORMS = (nnx.RMSNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.BatchNorm)


class Route(NamedTuple):
  """One parameter's routing: its dimension numbers, whether it is a table."""
  dims: Optional[DN]
  table: bool = False


class _Refused(Exception):
  """No rule says this parameter's axes (the reason is the message)."""


def _shifted(declared: DN, declared_rank: int, ndim: int) -> DN:
  """``declared`` on a kernel with ``ndim - declared_rank`` leading axes.

  A single axis is given as an ``int`` (``DN(0, 1)``), several as a tuple.
  """
  if ndim < declared_rank:
    raise _Refused(f'rank {ndim}, but the module declares a rank-'
                   f'{declared_rank} weight')
  extra = ndim - declared_rank

  def shift(axes):
    shifted = tuple(a + extra for a in dn.as_tuple(axes))
    return shifted[0] if len(shifted) == 1 else shifted

  return DN(shift(declared.reduction_axis), shift(declared.output_axis))


def _einsum_weight_name(module: Any, rank: int) -> Optional[str]:
  """The name of the einsum's weight among ``module``'s own Params."""
  if isinstance(module, nnx.Einsum):
    return 'kernel'
  names = [name for name, value in vars(module).items()
           if isinstance(value, nnx.Param) and not _is_lora(name, value)
           and value.ndim == rank]
  if len(names) != 1:
    raise _Refused(f'{type(module).__name__} carries einsum_str '
                   f'{module.einsum_str!r} but {len(names)} Params of rank '
                   f'{rank} ({", ".join(names) or "none"})')
  return names[0]


def _is_lora(name: str, variable: Any) -> bool:
  return (isinstance(variable, nnx.LoRAParam)
          or name in ('lora_a', 'lora_b')
          or name.endswith(('_lora_a', '_lora_b')))


def _lora_route(module: Any, name: str, ndim: int) -> Route:
  """A LoRA factor: ``(.., in, r)`` or ``(.., r, out)``, or read from the
  einsum qwix records beside an einsum weight's factors."""
  base, _, factor = name.rpartition('_lora_')
  einsum_str = getattr(module, f'{base}_lora_einsum_str', None)
  if not isinstance(einsum_str, str):
    return Route(DN(ndim - 2, ndim - 1))
  try:
    declared = einsum.lora_dimension_numbers(einsum_str, factor)
  except einsum.AmbiguousEinsum as error:
    raise _Refused(str(error)) from None
  return Route(_shifted(declared, ndim, ndim))


def _is_table(module: Any, name: str) -> bool:
  return (isinstance(module, nnx.Embed) and name == 'embedding'
          or name == 'input_embedding')


def _module_route(module: Any, name: str, variable: Any) -> Route:
  """The route of ``module.<name>``, a Variable of ``variable.ndim`` axes."""
  ndim = variable.ndim
  if not jnp.issubdtype(variable.dtype, jnp.floating) or ndim < 2:
    return Route(None)
  if _is_lora(name, variable):
    return _lora_route(module, name, ndim)
  if name in ('bias', 'scale') or isinstance(module, _NORMS):
    return Route(None)  # vectors, also when stacked as (layers, d)
  if _is_table(module, name):
    return Route(_shifted(DN(1, 0), 2, ndim), table=True)
  if isinstance(module, nnx.Linear) and name == 'kernel':
    return Route(_shifted(DN(0, 1), 2, ndim))
  if isinstance(module, nnx.LinearGeneral) and name == 'kernel':
    batch = len(module.batch_axis)
    inputs, outputs = len(module.in_features), len(module.out_features)
    declared = DN(tuple(range(batch, batch + inputs)),
                  tuple(range(batch + inputs, batch + inputs + outputs)))
    return Route(_shifted(declared, batch + inputs + outputs, ndim))
  einsum_str = getattr(module, 'einsum_str', None)
  if isinstance(einsum_str, str):
    rank = einsum.weight_rank(einsum_str)
    if name == _einsum_weight_name(module, rank):
      try:
        declared = einsum.weight_dimension_numbers(einsum_str)
      except einsum.AmbiguousEinsum as error:
        raise _Refused(str(error)) from None
      return Route(_shifted(declared, rank, ndim))
  if ndim == 2:
    return Route(DN(0, 1))
  raise _Refused(f'rank {ndim}, and {type(module).__name__} has no rule')


def _holders(model: Any) -> dict[tuple[Any, ...], Any]:
  """Every Module and list of ``model`` by its graph path."""
  return {path: node for path, node in nnx.iter_graph(model)
          if isinstance(node, (nnx.Module, list, tuple, dict))}


def _sourced(route: Route, holder: Any, name: str) -> Route:
  """``route`` whose dimension numbers say the rule (the module's type)."""
  if route.dims is None:
    return route
  return route._replace(dims=dn.decided(
      route.dims, f'taco_optax.nnx: {type(holder).__name__}.{name}'))


def routes(model: Any, wrt: Any, overrides: Mapping[str, Optional[DN]]
           ) -> dict[tuple[Any, ...], Route]:
  """The :class:`Route` of every ``wrt`` Variable of ``model``, by path.

  Raises:
    ValueError: naming every parameter no rule and no override covers, and
      every override pattern that matches no parameter.
  """
  holders = _holders(model)
  book = overrides_lib.Overrides(
      'taco_optax.nnx.dimension_numbers', overrides,
      "dimension_numbers(model, overrides={'layers/*/mlp/gate_proj': "
      'TacoDimensionNumbers(reduction_axis=1, output_axis=2)})')
  found = {}
  for path, variable in nnx.to_flat_state(nnx.state(model, wrt)):
    name = dn.path_name(path)
    override = book.entry(name)
    if override:  # None stays None in an nnx.State
      found[path] = Route(None if isinstance(override[0], dn.ToAdam)
                          else override[0])
      continue
    holder = holders.get(tuple(path[:-1]))
    try:
      found[path] = _sourced(_module_route(holder, str(path[-1]), variable),
                             holder, str(path[-1]))
    except _Refused as reason:
      book.refuse(f'  {name}: shape {tuple(variable.shape)}, {reason}')
  book.finish()
  return found


def table_paths(model: Any, wrt: Any) -> set[tuple[Any, ...]]:
  """The paths of ``model``'s embedding tables among its ``wrt`` Variables."""
  holders = _holders(model)
  return {path for path, variable in nnx.to_flat_state(nnx.state(model, wrt))
          if jnp.ndim(variable) >= 2
          and _is_table(holders.get(tuple(path[:-1])), str(path[-1]))}


def state_of(model: Any, wrt: Any, value_of) -> Any:
  """``nnx.state(model, wrt)`` with each Variable replaced by
  ``value_of(path)``."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return jax.tree_util.tree_map_with_path(
      lambda path, _: value_of(tuple(getattr(e, 'key', e) for e in path)),
      nnx.state(model, wrt), is_leaf=is_variable)
