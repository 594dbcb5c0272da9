"""What the layer-wise step keeps alive on an FSDP mesh, read off the compiled
program: a block's gathered weights only around its use.

Like ``tests/test_sharding.py`` these run on 8 simulated CPU devices (in the
rerun of ``tests/test_multidevice.py`` unless this process has them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_optax
from taco_optax import TacoDimensionNumbers as Dims
from tests import multidevice

NUM_DEVICES = multidevice.NUM_DEVICES
needs_mesh = multidevice.needs_devices(NUM_DEVICES)

WIDTH, HIDDEN, ROWS = 256, 512, 8
# One layer's two kernels, whole (what a gather makes), in bytes.
BLOCK_BYTES = 2 * WIDTH * HIDDEN * 4


def _on_mesh():
  return not jax.sharding.get_abstract_mesh().empty


def matmul(h, w):
  """``h @ w``, the weight gathered whole for its use on a mesh (as FSDP
  does)."""
  if not _on_mesh():
    return h @ w
  return jnp.matmul(h, jax.sharding.reshard(w, P()), out_sharding=P())


def _loss():
  def layer(p, h, x):
    return h + matmul(jnp.tanh(matmul(h, p['w_up'])), p['w_down'])
  return taco_optax.layerwise.LayeredLoss(
      embed=lambda outer, x: x * outer['scale'],
      layer=layer,
      head=lambda outer, h, x: jnp.mean((h * outer['scale'] - .5) ** 2),
      scan_layers=False)


def _params(num_layers):
  keys = iter(jax.random.split(jax.random.key(0), 2 * num_layers))
  normal = lambda shape: jax.random.normal(next(keys), shape) / shape[0]**.5
  layers = [{'w_up': normal((WIDTH, HIDDEN)), 'w_down': normal((HIDDEN, WIDTH))}
            for _ in range(num_layers)]
  return {'scale': jnp.ones((WIDTH,))}, layers


def _dims(params):
  return ({'scale': None}, jax.tree.map(lambda _: Dims(), params[1]))


def _compiled(num_layers, fsdp_spec):
  mesh = jax.make_mesh((NUM_DEVICES,), ('fsdp',))
  tx = taco_optax.taco(1e-2, k=4, weight_dimension_numbers=_dims)
  step = taco_optax.layerwise.train_step(_loss(), tx)
  with jax.set_mesh(mesh):
    outer, layers = _params(num_layers)
    layers = jax.device_put(layers, NamedSharding(mesh, fsdp_spec))
    params = (outer, layers)
    state = tx.init(params)
    x = jnp.ones((ROWS, WIDTH))
    return jax.jit(step, donate_argnums=(0, 1)).lower(
        params, state, x).compile()


def _temporaries(num_layers):
  return _compiled(num_layers, P('fsdp', None)).memory_analysis(
      ).temp_size_in_bytes


@needs_mesh
def test_gathered_block_weights_live_only_around_their_use():
  # Every extra layer adds its saved input (ROWS x WIDTH floats) and nothing
  # whole: were the forward's gathers issued up front, or kept for the
  # backward's recomputation, or the gradients' reductions of every layer
  # combined at the end, each layer would add a block (or more).
  shallow, deep = _temporaries(2), _temporaries(8)
  per_layer = (deep - shallow) / 6
  assert per_layer < 0.25 * BLOCK_BYTES, (shallow, deep, BLOCK_BYTES)
  # And at most two gathered blocks (one in use, one prefetched) besides
  # one block's gradient and the column steps' transients.
  assert deep < 4 * BLOCK_BYTES, (deep, BLOCK_BYTES)


@needs_mesh
def test_regathering_keeps_the_mesh_step_equal_to_one_device():
  tx = taco_optax.taco(1e-2, k=4, weight_dimension_numbers=_dims)
  step = jax.jit(taco_optax.layerwise.train_step(_loss(), tx))
  x = jax.random.normal(jax.random.key(1), (ROWS, WIDTH))
  params = _params(3)
  expected = step(params, tx.init(params), x)
  mesh = jax.make_mesh((NUM_DEVICES,), ('fsdp',))
  with jax.set_mesh(mesh):
    outer, layers = params
    sharded = (outer, jax.device_put(layers, NamedSharding(mesh,
                                                           P('fsdp', None))))
    got = step(sharded, tx.init(sharded), x)
  for a, e in zip(jax.tree.leaves(got[0][1]), jax.tree.leaves(expected[0][1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  assert not np.array_equal(np.asarray(got[0][1][0]['w_up']),
                            np.asarray(params[1][0]['w_up']))


if __name__ == '__main__':
  pytest.main([__file__])
