"""What the layer-wise step, and the plain ``jax.grad`` step through
``taco_optax.layerwise.remat_layers``, keep alive on an FSDP mesh, read off
the compiled program: a block's gathered weights only around its use.

Like ``tests/test_sharding.py`` these run on 8 simulated CPU devices (in the
rerun of ``tests/test_multidevice.py`` unless this process has them).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax import TacoDimensionNumbers as Dims
from tests.support import multidevice
from tests.support.bitwise import assert_bitwise_equal

NUM_DEVICES = multidevice.NUM_DEVICES
needs_mesh = multidevice.needs_devices(NUM_DEVICES)

WIDTH, HIDDEN, ROWS = 256, 512, 8
FSDP_ROWS = 64  # a batch split over the devices, 8 rows each
# One layer's two kernels, whole (what a gather makes), in bytes.
BLOCK_BYTES = 2 * WIDTH * HIDDEN * 4


def _on_mesh():
  return not jax.sharding.get_abstract_mesh().empty


def matmul(h, w, rows=P()):
  """``h @ w``, the weight gathered whole for its use on a mesh (as FSDP
  does), the result's rows split as ``rows`` says."""
  if not _on_mesh():
    return h @ w
  return jnp.matmul(h, jax.sharding.reshard(w, P()), out_sharding=rows)


def _loss(rows=P()):
  """``rows``: how the layers' results are split (``P('fsdp')``: each
  device its rows, so each weight's gradient is reduced over the devices)."""
  def layer(p, h, x):
    up = matmul(h, p['w_up'], rows)
    return h + matmul(jnp.tanh(up), p['w_down'], rows)
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


def _plain_step(loss, tx):
  """``value_and_grad -> tx.update -> apply_updates``, as the example's optax
  path runs it."""
  def step(params, opt_state, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def _plain_temporaries(num_layers):
  mesh = jax.make_mesh((NUM_DEVICES,), ('fsdp',))
  tx = optax.adamw(1e-2)
  rows = P('fsdp', None)
  with jax.set_mesh(mesh):
    outer, layers = _params(num_layers)
    params = (outer, jax.device_put(layers, NamedSharding(mesh, rows)))
    x = jax.device_put(jnp.ones((FSDP_ROWS, WIDTH)), NamedSharding(mesh, rows))
    compiled = jax.jit(_plain_step(_loss(rows), tx),
                       donate_argnums=(0, 1)).lower(
                           params, tx.init(params), x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@needs_mesh
def test_plain_step_gathers_each_block_when_used():
  # LayeredLoss.__call__ (remat on) runs its layers through remat_layers,
  # here as FSDP runs them: each device its rows, the weights gathered. With
  # jax.checkpoint alone XLA issued every layer's gathers, the forward's and
  # the recomputation's, at the step's start (each extra layer added two
  # whole blocks, 2.0 measured); without the wait for each layer's reduced
  # gradients it combined every layer's reduction into one at the end (2.0
  # too). Now a layer adds its saved rows and its AdamW shards (0.01).
  shallow, deep = _plain_temporaries(2), _plain_temporaries(8)
  per_layer = (deep - shallow) / 6
  assert per_layer < 0.25 * BLOCK_BYTES, (shallow, deep, BLOCK_BYTES)
  # At most two gathered blocks (one in use, one prefetched) besides one
  # block's gradient and the update's transients (3.1 blocks measured).
  assert deep < 4 * BLOCK_BYTES, (deep, BLOCK_BYTES)


def _checkpointed_loss(loss):
  """``loss`` with its layers under ``jax.checkpoint`` alone: the plain
  step's arithmetic before ``remat_layers``."""
  def checkpointed(params, x):
    outer, layers = params
    layer = jax.checkpoint(lambda p, h: loss.layer(p, h, x))
    hidden = loss.embed(outer, x)
    if loss.scan_layers:
      hidden = jax.lax.scan(lambda h, p: (layer(p, h), None), hidden,
                            layers)[0]
    else:
      for layer_params in layers:
        hidden = layer(layer_params, hidden)
    return loss.head(outer, hidden, x)
  return checkpointed


@needs_mesh
@pytest.mark.parametrize('scan_layers', [False, True])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_plain_step_gradients_equal_checkpointed_layers(scan_layers, dtype):
  # The loss and every gradient bit for bit as jax.checkpoint gives them, on
  # one device (where remat_layers is jax.checkpoint) and at fsdp=8, each
  # device with its rows.
  rows = P('fsdp', None)
  loss = dataclasses.replace(_loss(rows), scan_layers=scan_layers)
  outer, layers = _params(3)
  if scan_layers:
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  params = (outer, jax.tree.map(lambda w: w.astype(dtype), layers))
  x = jax.random.normal(jax.random.key(1), (FSDP_ROWS, WIDTH), dtype)
  gradients = lambda f, params, x: jax.jit(jax.value_and_grad(f))(params, x)
  assert_bitwise_equal(gradients(loss, params, x),
                       gradients(_checkpointed_loss(loss), params, x))
  mesh = jax.make_mesh((NUM_DEVICES,), ('fsdp',))
  spec = P(None, 'fsdp', None) if scan_layers else rows
  with jax.set_mesh(mesh):
    sharded = (outer, jax.device_put(params[1], NamedSharding(mesh, spec)))
    x = jax.device_put(x, NamedSharding(mesh, rows))
    got = gradients(loss, sharded, x)
    expected = gradients(_checkpointed_loss(loss), sharded, x)
  assert_bitwise_equal(got, expected)
  assert specs_of(got[1][1]) == specs_of(sharded[1])


def specs_of(tree):
  return [x.sharding.spec for x in jax.tree.leaves(tree)]


if __name__ == '__main__':
  pytest.main([__file__])
