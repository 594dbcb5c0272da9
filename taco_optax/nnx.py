"""Flax NNX support: routing read from the model, state Variables' shardings.

:func:`dimension_numbers` and :func:`update_scales` read which parameters are
TACO matrices (and their axes) from the model's modules;
:func:`for_nnx_optimizer` gives TACO's state Variables their own shardings.

Needs Flax: ``pip install "taco_optax[flax]"``.
"""

from typing import Any, Mapping, Optional

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import optax

from taco_optax._src import routing
from taco_optax._src import sharding as sharding_lib
from taco_optax._src import transform

try:
  from flax import nnx
except ImportError as error:  # pragma: no cover - depends on the install
  raise ImportError(
      'taco_optax.nnx needs Flax; install it with '
      '`pip install "taco_optax[flax]"`.') from error

# Flax is imported above: the module that reads Flax modules may now load.
from taco_optax._src.routing import nnx_routes  # pylint: disable=g-import-not-at-top,g-bad-import-order

__all__ = ('dimension_numbers', 'for_nnx_optimizer', 'update_scales')


def dimension_numbers(
    model: nnx.Module, wrt: Any = nnx.Param, *,
    overrides: Optional[Mapping[str, Optional[
        routing.TacoDimensionNumbers]]] = None) -> nnx.State:
  """TACO's ``weight_dimension_numbers`` for ``model``, read from its modules.

  Each parameter is routed by the module that holds it: ``nnx.Linear`` and
  ``nnx.LinearGeneral`` kernels by their declared input and output features;
  ``nnx.Einsum`` and any module with an ``einsum_str`` (tunix's, Gemma's) by
  the einsum: the weight's axes summed with the input's are the reduction
  axes, those only in the output the output axes (``'BTD,DNH->BTNH'``:
  ``(D, N, H)`` is ``reduction_axis=0``, ``output_axis=(1, 2)``;
  ``'BTNH,NHD->BTD'``: ``((0, 1), 2)``), an output axis placed before the
  input's axes in the output (``'BTD,SNDH->SBTNH'``: ``q, k, v = out``) a
  batch axis (Q, K and V are three matrices, as in the paper); ``nnx.Embed``
  and tunix's ``input_embedding`` tables with the vocabulary as the rows
  (output axis); LoRA factors as ``(in, r)`` and ``(r, out)`` matrices.
  Biases, vectors, scalars and integer parameters get ``None`` (Adam), other
  rank-2 parameters ``TacoDimensionNumbers()``. Layers stacked by
  ``nnx.vmap``/``nnx.scan`` have a leading layer axis: a batch axis.

  Args:
    model: the model, as given to ``nnx.Optimizer(model, tx, wrt=wrt)``.
    wrt: the same filter ``nnx.Optimizer`` gets (``nnx.LoRAParam`` for LoRA).
    overrides: ``{pattern: TacoDimensionNumbers or None}``; a parameter whose
      ``'/'``-joined path (``'layers/0/attn/q_proj/w'``) matches a pattern
      (``fnmatch``: ``'layers/*/attn/q_proj/w'``) gets the first match's
      value instead of the rule. Every pattern must match a parameter.

  Returns:
    An ``nnx.State`` like ``nnx.state(model, wrt)`` holding
    :class:`taco_optax.TacoDimensionNumbers` or ``None``: a tree prefix of
    what ``nnx.Optimizer`` hands to ``tx.init`` and ``tx.update``, for
    ``taco(..., weight_dimension_numbers=...)`` (also under
    :func:`optax.inject_hyperparams`, without ``static_args``: it is a tree).

  Raises:
    ValueError: once, naming every rank >= 3 parameter of a module without a
      rule (or an ambiguous einsum) and every override that matches nothing.

  Examples:
    >>> import taco_optax
    >>> from flax import nnx
    >>> from taco_optax.nnx import dimension_numbers
    >>> query = nnx.Einsum('BTD,DNH->BTNH', (8, 2, 4), rngs=nnx.Rngs(0))
    >>> dimension_numbers(query)['kernel']
    TacoDimensionNumbers(reduction_axis=0, output_axis=(1, 2))
    >>> tx = taco_optax.taco(1e-3, weight_dimension_numbers=(
    ...     dimension_numbers(query)))
    >>> optimizer = nnx.Optimizer(query, tx, wrt=nnx.Param)
  """
  found = nnx_routes.routes(model, wrt, dict(overrides or {}))
  return nnx_routes.state_of(model, wrt, lambda path: found[path].dims)


def update_scales(model: nnx.Module, wrt: Any = nnx.Param) -> nnx.State:
  """TACO's ``update_scale`` for ``model``: 1 for embedding tables.

  The paper updates the token embedding with scale 1 (its ``m / n =
  vocab / d`` would move every touched weight far too much); every table
  :func:`dimension_numbers` routes as one (``nnx.Embed``, tunix's
  ``input_embedding``, learned position tables included) gets ``1.0``, every
  other parameter ``None`` (``m / n``).

  Args:
    model: the model.
    wrt: the filter given to ``nnx.Optimizer``.

  Returns:
    An ``nnx.State`` like ``nnx.state(model, wrt)`` of ``1.0`` or ``None``,
    for ``taco(..., update_scale=...)``.

  Examples:
    >>> from flax import nnx
    >>> from taco_optax.nnx import update_scales
    >>> update_scales(nnx.Embed(10, 4, rngs=nnx.Rngs(0)))['embedding']
    1.0
  """
  found = nnx_routes.table_paths(model, wrt)
  return nnx_routes.state_of(
      model, wrt,
      lambda path: nnx_routes.TABLE_SCALE if path in found else None)


def for_nnx_optimizer(tx: optax.GradientTransformation
                      ) -> optax.GradientTransformation:
  """``tx`` whose state Variables carry their own shardings in ``nnx``.

  :class:`flax.nnx.Optimizer` copies every parameter's metadata, including its
  ``out_sharding``, onto each state leaf built from it. That is right for AdamW
  moments but wrong for TACO's ``(k, n)`` history: with an explicit mesh
  ``nnx.Optimizer`` then fails to reshard the state, and
  :func:`flax.nnx.get_partition_spec` returns the parameter's spec. Wrap the
  optimizer with this function before handing it to ``nnx.Optimizer``; the
  updates are unchanged.

  Args:
    tx: any optax transformation, e.g. :func:`taco_optax.taco`.

  Returns:
    A transformation with the same ``update`` whose ``init`` relabels state
    Variables with the shardings of :func:`taco_optax.state_shardings`.

  Examples:
    >>> import optax, taco_optax
    >>> from flax import nnx
    >>> from taco_optax.nnx import for_nnx_optimizer
    >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(
    ...     model, for_nnx_optimizer(taco_optax.taco(1e-3)),
    ...     wrt=nnx.Param)
  """
  is_variable = lambda x: isinstance(x, nnx.Variable)

  def abstract_param(x):
    value = x.get_value() if is_variable(x) else x
    sharding = (sharding_lib.explicit_sharding(value)
                or getattr(value, 'sharding', None))
    names = x.get_metadata('out_sharding', None) if is_variable(x) else None
    if names is not None and not isinstance(sharding, NamedSharding):
      mesh = ((x.get_metadata('mesh', None) if is_variable(x) else None)
              or jax.sharding.get_abstract_mesh())
      if mesh is not None and not getattr(mesh, 'empty', False):
        sharding = NamedSharding(mesh, PartitionSpec(*names))
    if not isinstance(sharding, NamedSharding):
      return jax.ShapeDtypeStruct(value.shape, value.dtype)
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

  def relabel(leaf, shardings):
    if not is_variable(leaf) or not shardings:  # e.g. Variable(MaskedNode())
      return leaf
    (sharding,) = shardings
    names = sharding_lib.padded_spec(sharding.spec, leaf.get_value().ndim)
    return leaf.replace(leaf.get_value(),
                        out_sharding=tuple(sharding_lib.spec_entry(a)
                                           for a in names))

  def init_fn(params):
    state = tx.init(params)
    abstract = jax.tree.map(abstract_param, params, is_leaf=is_variable)
    if not any(isinstance(getattr(x, 'sharding', None), NamedSharding)
               for x in jax.tree.leaves(abstract)):
      return state
    shardings = iter(jax.tree.leaves(
        sharding_lib.state_shardings(tx, abstract)))
    leaves, treedef = jax.tree.flatten(state, is_leaf=is_variable)
    return treedef.unflatten([
        relabel(x, [next(shardings) for _ in jax.tree.leaves(x)])
        for x in leaves])

  return transform.replace_init(tx, init_fn)
