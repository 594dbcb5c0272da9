"""The explicit-mesh cases the sharding tests share (and the multi-process
runs): leaf layouts on a 2 x 4 ``('fsdp', 'tensor')`` mesh, their gradients
with many ties, and the specs arrays and shardings carry."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_optax import TacoDimensionNumbers as Dims
from taco_optax._src.sharding import mesh as _mesh

# name -> (shape, spec, dimension numbers). 'fsdp': reduction axis sharded;
# 'tp': output axis sharded; 'both'; and batch / multi-axis variants.
LAYOUTS = {
    'fsdp': ((64, 32), P('fsdp', None), Dims()),
    'tp': ((64, 32), P(None, 'tensor'), Dims()),
    'tp_narrow': ((16, 16), P(None, 'tensor'), Dims()),  # k=16 keeps all m
    'both': ((64, 32), P('fsdp', 'tensor'), Dims()),
    'tp_over_all': ((16, 64), P(None, ('fsdp', 'tensor')), Dims()),
    'scanned': ((2, 16, 24), P(None, 'fsdp', 'tensor'), Dims(1, 2)),
    'heads_out': ((16, 4, 8), P('fsdp', 'tensor', None), Dims(0, (1, 2))),
    'head_dim_out': ((16, 4, 8), P(None, 'fsdp', 'tensor'), Dims(0, (1, 2))),
    'unsharded': ((8, 12), P(), Dims()),
}


def make_mesh(explicit=True):
  axis_type = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh((2, 4), ('fsdp', 'tensor'),
                       axis_types=(axis_type, axis_type))


def place(tree, mesh, names=None):
  return {name: jax.device_put(x, NamedSharding(mesh, LAYOUTS[name][1]))
          for name, x in tree.items() if names is None or name in names}


def tied_gradients(step, names):
  """Small integers times 1e-3: many exact ties in every column."""
  return {name: 1e-3 * jax.random.randint(
      jax.random.key(100 * step + i), LAYOUTS[name][0], -3, 4).astype(
          jnp.float32)
          for i, name in enumerate(names)}


def normalized(spec, ndim):
  """``spec`` as mesh axes per array axis: ``P()`` equals ``P(None, None)``."""
  return _mesh.padded_spec(spec, ndim)


def specs(tree):
  return jax.tree.map(lambda x: normalized(x.sharding.spec, x.ndim), tree)


def sharding_specs(shardings, like):
  return jax.tree.map(lambda s, x: normalized(s.spec, x.ndim), shardings, like)
