"""The shardings of an optimizer state, for ``jit``, checkpoints and ``nnx``.

TACO's ``(k, n)`` history has no parameter-shaped counterpart, so
``optax.tree_map_params`` cannot place it and :class:`flax.nnx.Optimizer`
would copy the parameter's spec onto it. :func:`state_shardings` derives every
state leaf's sharding from the parameters' (by abstract evaluation of
``init`` on an explicit mesh); :func:`for_nnx_optimizer` relabels the state
Variables that ``nnx.Optimizer`` builds.
"""

from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from taco_optax import _sharding


def _explicit_abstract(params: Any, mesh: Any) -> Any:
  """Abstract params sharded on an all-explicit copy of ``mesh``."""
  abstract_mesh = getattr(mesh, 'abstract_mesh', mesh)
  explicit = abstract_mesh.update_axis_types(
      {name: jax.sharding.AxisType.Explicit for name in mesh.axis_names})

  def convert(x):
    sharding = getattr(x, 'sharding', None)
    if not isinstance(sharding, NamedSharding):
      return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=NamedSharding(explicit, sharding.spec))

  return jax.tree.map(convert, params), explicit


def _the_mesh(params: Any) -> Any:
  meshes = {}
  for x in jax.tree.leaves(params):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      mesh = sharding.mesh
      meshes[(tuple(mesh.axis_names), tuple(mesh.axis_sizes))] = mesh
  if len(meshes) != 1:
    raise ValueError(
        'state_shardings needs params with NamedShardings on exactly one mesh; '
        f'found {len(meshes)} meshes.')
  return next(iter(meshes.values()))


def state_shardings(tx: optax.GradientTransformation, params: Any) -> Any:
  """The shardings of ``tx.init(params)`` for sharded ``params``.

  Works for any optax transformation, TACO or not: parameter-shaped state
  (AdamW moments) shards like the parameter, TACO's ``(k, n)`` history like
  the parameter's batch and reduction axes (replicated over the mesh axes of
  the output axes), other state is replicated. Use it for
  ``jax.jit(tx.init, out_shardings=...)``, to restore a checkpoint, and with
  meshes whose axes are ``Auto``, where JAX does not track shardings through
  ``init``. (:func:`optax.tree_map_params` cannot build TACO's state: its
  shapes depend on the parameters'.)

  Args:
    tx: the optimizer.
    params: arrays or :class:`jax.ShapeDtypeStruct` whose shardings are
      :class:`jax.sharding.NamedSharding` on one mesh (unsharded leaves are
      allowed).

  Returns:
    A tree of :class:`jax.sharding.NamedSharding`, on the params' mesh, shaped
    like ``tx.init(params)``.

  Examples:
    >>> import jax, optax, taco_optax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1, 1), ('fsdp', 'tensor'))
    >>> w = jax.ShapeDtypeStruct((8, 4), 'float32',
    ...     sharding=NamedSharding(mesh, P('fsdp', 'tensor')))
    >>> tx = taco_optax.scale_by_taco(k=2)
    >>> state_shardings = taco_optax.state_shardings(tx, {'w': w})
    >>> state_shardings.values['w'].spec
    P(None, 'fsdp')
  """
  mesh = _the_mesh(params)
  explicit_params, explicit_mesh = _explicit_abstract(params, mesh)
  with jax.sharding.use_abstract_mesh(explicit_mesh):
    abstract_state = jax.eval_shape(tx.init, explicit_params)

  def on_mesh(x):
    sharding = getattr(x, 'sharding', None)
    spec = sharding.spec if sharding is not None else PartitionSpec()
    return NamedSharding(mesh, spec)

  return jax.tree.map(on_mesh, abstract_state)


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
    Variables with the shardings of :func:`state_shardings`.

  Examples:
    >>> import optax, taco_optax
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(
    ...     model, taco_optax.for_nnx_optimizer(taco_optax.taco(1e-3)),
    ...     wrt=nnx.Param)
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  is_variable = lambda x: isinstance(x, nnx.Variable)

  def abstract_param(x):
    value = x.get_value() if is_variable(x) else x
    sharding = (_sharding.explicit_sharding(value)
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
    names = _sharding.padded_spec(sharding.spec, leaf.get_value().ndim)
    return leaf.replace(leaf.get_value(),
                        out_sharding=tuple(_sharding.spec_entry(a)
                                           for a in names))

  def init_fn(params):
    state = tx.init(params)
    abstract = jax.tree.map(abstract_param, params, is_leaf=is_variable)
    if not any(isinstance(getattr(x, 'sharding', None), NamedSharding)
               for x in jax.tree.leaves(abstract)):
      return state
    shardings = iter(jax.tree.leaves(state_shardings(tx, abstract)))
    leaves, treedef = jax.tree.flatten(state, is_leaf=is_variable)
    return treedef.unflatten([
        relabel(x, [next(shardings) for _ in jax.tree.leaves(x)])
        for x in leaves])

  return optax.GradientTransformation(init_fn, tx.update)
