"""Flax NNX support: TACO's state Variables with their own shardings.

Needs Flax: ``pip install "taco_optax[flax]"``.
"""

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from taco_optax import _mesh
from taco_optax import _state_shardings

try:
  from flax import nnx
except ImportError as error:  # pragma: no cover - depends on the install
  raise ImportError(
      'taco_optax.nnx needs Flax; install it with '
      '`pip install "taco_optax[flax]"`.') from error

__all__ = ('for_nnx_optimizer',)


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
    sharding = (_mesh.explicit_sharding(value)
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
    names = _mesh.padded_spec(sharding.spec, leaf.get_value().ndim)
    return leaf.replace(leaf.get_value(),
                        out_sharding=tuple(_mesh.spec_entry(a)
                                           for a in names))

  def init_fn(params):
    state = tx.init(params)
    abstract = jax.tree.map(abstract_param, params, is_leaf=is_variable)
    if not any(isinstance(getattr(x, 'sharding', None), NamedSharding)
               for x in jax.tree.leaves(abstract)):
      return state
    shardings = iter(jax.tree.leaves(
        _state_shardings.state_shardings(tx, abstract)))
    leaves, treedef = jax.tree.flatten(state, is_leaf=is_variable)
    return treedef.unflatten([
        relabel(x, [next(shardings) for _ in jax.tree.leaves(x)])
        for x in leaves])

  return optax.GradientTransformation(init_fn, tx.update)
