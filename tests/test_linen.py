"""taco_optax.linen: TACO's routing read from Flax Linen modules.

Each test builds a small real Linen model, routes it, runs one ``taco``
update and checks the update itself (tests/support/routing_checks.py) against
axes written here by hand: one weight moved per input feature of every matrix
(per layer of a stack) by lr * m / n (1 for an embedding table), and a dense
Adam step for biases, norms and everything else.
"""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taco_optax
from taco_optax import linen
from tests.support.linen_models import LanguageModel
from tests.support.routing_checks import assert_adam_dense
from tests.support.routing_checks import assert_one_per_input

DN = taco_optax.TacoDimensionNumbers
LR = 1e-2
ADAM = 'adam'


def _flat(tree):
  return {_path_name(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _path_name(path):
  return '/'.join(str(entry.key) for entry in path)


def _normal(tree, seed):
  # Host numpy: jax.random here would compile per shape, for nothing.
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda x: rng.standard_normal(x.shape).astype(x.dtype), tree)


def _params(module, *args):
  """Random params of ``module.init``'s shapes (the routing reads shapes)."""
  shapes = jax.eval_shape(module.init, jax.random.key(0), *args)
  return _normal(nn.meta.unbox(shapes['params']), seed=0)


def _random_grads(params):
  return _normal(params, seed=1)


def _update(tx, params, grads_of=_random_grads):
  grads = grads_of(params)
  # One compile: op-by-op dispatch of many tiny steps is slower.
  return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


def _one_update(module, *args, grads_of=_random_grads, **kwargs):
  """The update of one routed ``taco`` step on ``module``'s params."""
  dims = linen.dimension_numbers(module, *args, **kwargs)
  scales = linen.update_scales(module, *args)
  params = _params(module, *args)
  tx = taco_optax.taco(LR, weight_dimension_numbers=dims,
                       update_scale=scales)
  return _flat(_update(tx, params, grads_of))


def _check(updates, expected):
  """``expected``: path -> ADAM or (reduction, output[, scale])."""
  assert set(updates) == set(expected)
  for path, want in expected.items():
    if want == ADAM:
      assert_adam_dense(updates[path], name=path)
    else:
      assert_one_per_input(updates[path], *want[:2], LR, *want[2:],
                           name=path)


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    hidden = jnp.tanh(nn.Dense(12)(x))
    return nn.Dense(4)(hidden)


def test_mlp_kernels_move_one_weight_per_input_under_a_real_loss():
  x = jax.random.normal(jax.random.key(1), (5, 6))
  target = jax.random.normal(jax.random.key(2), (5, 4))
  loss = lambda p: jnp.mean((MLP().apply({'params': p}, x) - target) ** 2)
  updates = _one_update(MLP(), x, grads_of=jax.jit(jax.grad(loss)))
  assert updates['Dense_0/kernel'].shape == (6, 12)
  _check(updates, {'Dense_0/kernel': (0, 1), 'Dense_0/bias': ADAM,
                   'Dense_1/kernel': (0, 1), 'Dense_1/bias': ADAM})


class Attention(nn.Module):
  heads: int = 2
  head_dim: int = 3

  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(x)
    project = lambda name: nn.DenseGeneral((self.heads, self.head_dim),
                                           name=name)(x)
    q, k, v = project('q'), project('k'), project('v')
    weights = jax.nn.softmax(jnp.einsum('btnh,bsnh->bnts', q, k), axis=-1)
    mixed = jnp.einsum('bnts,bsnh->btnh', weights, v)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name='out')(mixed)


def test_attention_general_kernels_and_their_rank2_biases():
  updates = _one_update(Attention(), jnp.ones((1, 4, 8)))
  assert updates['q/kernel'].shape == (8, 2, 3)  # (D, N, H)
  assert updates['q/bias'].shape == (2, 3)        # (N, H): a bias
  assert updates['out/kernel'].shape == (2, 3, 8)  # (N, H, D)
  expected = {f'{p}/kernel': (0, (1, 2)) for p in 'qkv'}
  expected.update({f'{p}/bias': ADAM for p in ('q', 'k', 'v', 'out')})
  expected.update({'out/kernel': ((0, 1), 2), 'LayerNorm_0/scale': ADAM,
                   'LayerNorm_0/bias': ADAM})
  _check(updates, expected)


@pytest.mark.parametrize('tied', [False, True], ids=['untied', 'tied'])
def test_embedding_rows_are_the_vocabulary_at_scale_one(tied):
  tokens = jnp.array([[1, 2, 3]])
  updates = _one_update(LanguageModel(tied), tokens)
  assert updates['Embed_0/embedding'].shape == (11, 4)  # (V, D)
  expected = {'Embed_0/embedding': (1, 0, 1.0), 'Dense_0/kernel': (0, 1),
              'Dense_0/bias': ADAM}
  if not tied:
    expected.update({'Dense_1/kernel': (0, 1), 'Dense_1/bias': ADAM})
  _check(updates, expected)


class Block(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    x = x + nn.Dense(
        4, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ('embed', 'mlp')))(x)
    heads = nn.DenseGeneral((2, 3), name='heads')(nn.LayerNorm()(x))
    return x + heads.sum(axis=(-2, -1))[..., None], None


class Stack(nn.Module):
  layer_axis: int

  @nn.compact
  def __call__(self, x):
    # As MaxText's param_scan_axis: the layer axis where variable_axes says.
    layers = nn.scan(Block, variable_axes={'params': self.layer_axis},
                     split_rngs={'params': True}, length=4,
                     metadata_params={nn.PARTITION_NAME: 'layers'})
    return layers(name='layers')(x, None)[0]


# Layers L = 4 = D: (L, D, F) and (D, L, F) have the same shape, so the layer
# axis must come from the scan, not from the shapes.
STACKED = {
    0: {'layers/Dense_0/kernel': (1, 2), 'layers/heads/kernel': (1, (2, 3))},
    1: {'layers/Dense_0/kernel': (0, 2), 'layers/heads/kernel': (0, (2, 3))},
}


@pytest.mark.parametrize('layer_axis', [0, 1])
def test_scanned_layers_are_matrices_per_layer_at_the_scan_axis(layer_axis):
  x = jnp.ones((2, 4))
  dims = linen.dimension_numbers(Stack(layer_axis), x)
  params = _params(Stack(layer_axis), x)
  assert params['layers']['Dense_0']['kernel'].shape == (4, 4, 4)
  assert params['layers']['heads']['kernel'].shape == (4, 4, 2, 3)
  assert params['layers']['Dense_0']['bias'].shape == (4, 4)  # (L, F)
  tx = taco_optax.taco(LR, weight_dimension_numbers=dims)
  updates = _update(tx, params)
  expected = {f'layers/{path}': ADAM for path in (
      'Dense_0/bias', 'heads/bias', 'LayerNorm_0/scale', 'LayerNorm_0/bias')}
  expected.update(STACKED[layer_axis])
  _check(_flat(updates), expected)
  report = taco_optax.routing_report(tx, params)
  why = {row.path: row.why for row in report.rows}
  assert f'stacked: batch axis {layer_axis}' in why['layers/Dense_0/kernel']


class Inner(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    return nn.remat(nn.Dense)(4, name='dense')(x), None


def test_nested_scans_stack_two_batch_axes_where_each_put_its_own():
  inner = nn.scan(Inner, variable_axes={'params': 1},
                  split_rngs={'params': True}, length=2)
  outer = nn.scan(inner, variable_axes={'params': 0},
                  split_rngs={'params': True}, length=3)
  updates = _one_update(outer(), jnp.ones((2, 4)), None)
  assert updates['dense/kernel'].shape == (3, 4, 2, 4)  # (L1, D, L2, F)
  _check(updates, {'dense/kernel': (1, 3), 'dense/bias': ADAM})


class Spectral(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.SpectralNorm(nn.Dense(3))(x, update_stats=False)


def test_a_model_reading_raw_lifted_variables_is_traced_again(caplog):
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    updates = _one_update(Spectral(), jnp.ones((2, 4)))
  _check(updates, {'Dense_0/kernel': (0, 1), 'Dense_0/bias': ADAM})
  assert 'traced again without them' in caplog.text


class Einsums(nn.Module):

  @nn.compact
  def __call__(self, x):
    heads = nn.Einsum((8, 2, 3), 'btd,dnh->btnh', name='q')(x)
    return nn.Einsum((2, 3, 8), name='out')(heads, 'btnh,nhd->btd')


def test_einsum_kernels_are_read_from_their_einsum():
  updates = _one_update(Einsums(), jnp.ones((1, 4, 8)))
  _check(updates, {'q/kernel': (0, (1, 2)), 'q/bias': ADAM,
                   'out/kernel': ((0, 1), 2), 'out/bias': ADAM})


class ConvAndCustom(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3,))(x)
    return x @ self.param('mix', nn.initializers.lecun_normal(), (4, 5))


def test_convolutions_and_unknown_matrices_go_to_adam_saying_why(caplog):
  x = jnp.ones((1, 6, 2))
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    updates = _one_update(ConvAndCustom(), x)
  _check(updates, {'Conv_0/kernel': ADAM, 'Conv_0/bias': ADAM, 'mix': ADAM})
  warned = [r.getMessage() for r in caplog.records]
  assert len(warned) == 1 and 'mix (4, 5)' in warned[0], warned
  assert 'overrides=' in warned[0] and 'Conv_0' not in warned[0]
  params = _params(ConvAndCustom(), x)
  tx = taco_optax.taco(LR, weight_dimension_numbers=linen.dimension_numbers(
      ConvAndCustom(), x))
  why = {row.path: row.why for row in
         taco_optax.routing_report(tx, params).rows}
  assert why['Conv_0/kernel'].startswith('nn.Conv Conv_0/kernel')
  assert 'ConvAndCustom mix: no TACO rule' in why['mix']


def test_overrides_route_by_path_and_must_each_match():
  x = jnp.ones((5, 6))
  updates = _one_update(MLP(), x, overrides={
      'Dense_0/kernel': None, 'Dense_1/kernel': DN(1, 0)})
  _check(updates, {'Dense_0/kernel': ADAM, 'Dense_0/bias': ADAM,
                   'Dense_1/kernel': (1, 0), 'Dense_1/bias': ADAM})
  with pytest.raises(ValueError, match=r"match no parameter: \['Dense_9/\*'\]"):
    linen.dimension_numbers(MLP(), x, overrides={'Dense_9/*': None})


class Reshaped(nn.Module):
  """A Dense whose kernel gains an axis nn.scan/nn.vmap did not add."""

  @nn.compact
  def __call__(self, x):
    add_axis = lambda tree: jax.tree.map(lambda v: v[None], tree)
    drop_axis = lambda tree: jax.tree.map(lambda v: v[0], tree)
    dense = nn.map_variables(nn.Dense, 'params', drop_axis, add_axis,
                             init=True)
    return dense(3, name='dense')(x) + dense(3, name='other')(x)


def test_an_axis_that_cannot_be_located_is_refused_by_name():
  x = jnp.ones((2, 4))
  with pytest.raises(ValueError) as error:
    linen.dimension_numbers(Reshaped(), x)
  message = str(error.value)
  assert 'cannot tell the TACO axes of 2 parameter(s)' in message, message
  for name in ('dense/kernel', 'other/kernel'):
    assert f'{name}: shape (1, 4, 3), its module created it as (4, 3)' in (
        message)
  assert 'layer axis cannot be located' in message and 'bias' not in message
  updates = _one_update(Reshaped(), x, overrides={'*/kernel': DN(1, 2)})
  _check(updates, {'dense/kernel': (1, 2), 'dense/bias': ADAM,
                   'other/kernel': (1, 2), 'other/bias': ADAM})


def test_shapes_alone_suffice():
  shapes = jax.ShapeDtypeStruct((1, 4, 8), jnp.float32)
  assert repr(linen.dimension_numbers(Attention(), shapes)) == repr(
      linen.dimension_numbers(Attention(), jnp.ones((1, 4, 8))))
