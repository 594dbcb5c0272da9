"""The layer-wise step's case on a mesh, shared by the sharding tests.

A two-layer residual MLP as a :class:`taco_optax.layerwise.LayeredLoss`, its
parameters, dimension numbers and three placements on an 8-device
``('fsdp', 'tensor')`` mesh (``LAYERWISE_LAYOUTS``): tests/test_sharding.py,
tests/test_auto_mesh.py and the multi-process cases run it.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_optax
from taco_optax import TacoDimensionNumbers as Dims


def matmul(a, b):
  """``a @ b``, replicated on a mesh (explicit axes need an output sharding)."""
  if jax.sharding.get_abstract_mesh().empty:
    return a @ b
  return jnp.matmul(a, b, out_sharding=P())


WIDTH, HIDDEN, NUM_LAYERS = 32, 64, 2
# Kernel and bias specs: FSDP splits the reduction (input) axis, TP the output
# axis, and 'both' mixes them as Megatron does (up: columns over 'fsdp', rows
# over 'tensor'; down the other way round).
LAYERWISE_LAYOUTS = {
    'fsdp': {'w_in': P('fsdp', None), 'w_up': P('fsdp', None),
             'w_down': P('fsdp', None), 'w_out': P('fsdp', None),
             'b_up': P()},
    'tp': {'w_in': P(None, 'tensor'), 'w_up': P(None, 'tensor'),
           'w_down': P(None, 'tensor'), 'w_out': P(None, 'tensor'),
           'b_up': P('tensor')},
    'both': {'w_in': P('fsdp', 'tensor'), 'w_up': P('fsdp', 'tensor'),
             'w_down': P('tensor', 'fsdp'), 'w_out': P('tensor', 'fsdp'),
             'b_up': P('tensor')},
}


def layered_loss(scan_layers):
  """``x @ w_in -> (h + tanh(h @ w_up + b) @ w_down) x L -> MSE(h @ w_out)``.

  ``w_out`` is not read by the embedding, so the step updates it before the
  layers (the untied-head path).
  """
  return taco_optax.layerwise.LayeredLoss(
      embed=lambda outer, x: matmul(x, outer['w_in']),
      layer=lambda p, h, x: h + matmul(
          jnp.tanh(matmul(h, p['w_up']) + p['b_up']), p['w_down']),
      head=lambda outer, h, x: jnp.mean((matmul(h, outer['w_out']) - .5)**2),
      scan_layers=scan_layers)


def layered_params(scan_layers):
  keys = iter(jax.random.split(jax.random.key(0), 3 * NUM_LAYERS + 2))
  normal = lambda shape: jax.random.normal(next(keys), shape) / shape[0]**.5
  outer = {'w_in': normal((16, WIDTH)), 'w_out': normal((WIDTH, 16))}
  layers = [{'w_up': normal((WIDTH, HIDDEN)), 'w_down': normal((HIDDEN, WIDTH)),
             'b_up': 0.1 * jax.random.normal(next(keys), (HIDDEN,))}
            for _ in range(NUM_LAYERS)]
  if scan_layers:
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return outer, layers


def layered_dims(params):
  """Kernels are matrices, behind a leading layer axis when stacked."""
  rank = 2 if isinstance(params[1], list) else 3
  layer_dims = lambda x: Dims(rank - 2, rank - 1) if x.ndim == rank else None
  return (jax.tree.map(lambda _: Dims(), params[0]),
          jax.tree.map(layer_dims, params[1]))


def place_layered(params, mesh, layout):
  def put(path, x):
    spec = LAYERWISE_LAYOUTS[layout][path[-1].key]
    spec = P(*(None,) * (x.ndim - len(spec)), *spec)  # the layer axis
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(put, params)


def three_steps(train):
  """``run(params) -> (params, state)``: ``train``'s jitted step on three
  fixed batches from a fresh state."""
  inputs = [jax.random.normal(jax.random.key(10 + i), (8, 16))
            for i in range(3)]

  def run(params):
    state = train.optimizer.init(params)
    step = jax.jit(train.step)
    for x in inputs:
      params, state, _ = step(params, state, x)
    return params, state
  return run
