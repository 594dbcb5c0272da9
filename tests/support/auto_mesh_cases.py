"""The Auto-mesh cases the auto-partition tests share (and the multi-process
runs): leaf layouts on a 2 x 4 ``('fsdp', 'tensor')`` mesh of Auto axes,
gradients with many ties (and a NaN), and three updates of a transformation."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_optax
from taco_optax import TacoDimensionNumbers as Dims

# name -> (shape, spec, dimension numbers; None: not TACO, AdamW's).
LAYOUTS = {
    'tp': ((64, 32), P(None, 'tensor'), Dims()),
    'fsdp': ((64, 32), P('fsdp', None), Dims()),
    'both': ((64, 32), P('fsdp', 'tensor'), Dims()),
    'tp_over_all': ((16, 64), P(None, ('fsdp', 'tensor')), Dims()),
    'scanned': ((2, 16, 24), P(None, 'fsdp', 'tensor'), Dims(1, 2)),
    'scanned_tp': ((2, 16, 24), P(None, None, 'tensor'), Dims(1, 2)),
    'unsharded': ((8, 12), P(), Dims()),
    'bias': ((32,), P('tensor'), None),
}


def auto_mesh():
  return jax.make_mesh((2, 4), ('fsdp', 'tensor'),
                       axis_types=(AxisType.Auto, AxisType.Auto))


def shardings(mesh, names):
  return {n: NamedSharding(mesh, LAYOUTS[n][1]) for n in names}


def tied_gradients(step, names, nan=False):
  """Small integers times 1e-3 (many exact ties); optionally one NaN each."""
  grads = {}
  for i, name in enumerate(names):
    shape = LAYOUTS[name][0]
    grad = 1e-3 * jax.random.randint(jax.random.key(100 * step + i), shape,
                                     -3, 4).astype(jnp.float32)
    if nan and LAYOUTS[name][2] is not None:
      grad = grad.at[(0,) * (len(shape) - 1) + (-1,)].set(jnp.nan)
    grads[name] = grad
  return grads


def run_steps(tx, names, mesh=None, put=jax.device_put):
  """Three updates (the third with a NaN gradient): updates and states.

  ``put(tree, shardings)`` places the inputs on ``mesh``.
  """
  params = {n: jnp.zeros(LAYOUTS[n][0]) for n in names}
  init, update = jax.jit(tx.init), jax.jit(tx.update)
  place = lambda tree: tree
  if mesh is not None:
    place = lambda tree: put(tree, shardings(mesh, names))
    state_shardings = taco_optax.state_shardings(tx, place(params))
    init = jax.jit(tx.init, out_shardings=state_shardings)
    update = jax.jit(tx.update, out_shardings=(shardings(mesh, names),
                                               state_shardings))
  state = init(place(params))
  results = []
  for step in range(3):
    grads = place(tied_gradients(step, names, nan=step == 2))
    updates, state = update(grads, state, place(params))
    results.append((updates, state))
  return results
