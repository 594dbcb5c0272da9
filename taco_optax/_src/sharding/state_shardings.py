"""The shardings of an optimizer state, for ``jit``, checkpoints and ``nnx``.

TACO's ``(k, n)`` history has no parameter-shaped counterpart, so
``optax.tree_map_params`` cannot place it and :class:`flax.nnx.Optimizer`
would copy the parameter's spec onto it. :func:`state_shardings` derives every
state leaf's sharding from the parameters' (by abstract evaluation of
``init`` on an explicit mesh); ``taco_optax.nnx.for_nnx_optimizer`` uses it to
relabel the state Variables that ``nnx.Optimizer`` builds.
"""

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import optax


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
