"""Bad inputs: clear errors for bad configuration, no NaN reaching the state."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from tests.support import bitwise

DN = taco_optax.TacoDimensionNumbers


@pytest.mark.parametrize('kwargs,message', [
    (dict(k=0), 'k must be >= 1'),
    (dict(k=2.5), 'k must be an int'),
    (dict(mu=1.0), r'mu must be in \[0, 1\)'),
    (dict(mu=-0.1), r'mu must be in \[0, 1\)'),
    (dict(update_topk=0), 'update_topk must be >= 1'),
    (dict(k=2, update_topk=3), 'update_topk=3 must be <= k=2'),
    (dict(index_dtype=jnp.float32), 'index_dtype must be an integer'),
    (dict(values_dtype=jnp.int8), 'values_dtype must be a float'),
])
def test_bad_hyperparameters_raise(kwargs, message):
  with pytest.raises(ValueError, match=message):
    taco_optax.scale_by_taco(**kwargs)


@pytest.mark.parametrize('dims,shape,message', [
    (DN(), (5,), 'TACO requested on a rank-1 leaf'),
    (DN(), (), 'TACO requested on a rank-0 leaf'),
    (DN(0, 0), (3, 4), 'overlap'),
    (DN((0, 1), 1), (3, 4, 5), 'overlap'),
    (DN(0, 2), (3, 4), 'out of range'),
    (DN(-3, 1), (3, 4), 'out of range'),
    (DN((0, 0), 1), (3, 4), 'repeats an axis'),
    (DN((), 1), (3, 4), 'reduction_axis is empty'),
])
def test_bad_dimension_numbers_raise(dims, shape, message):
  tx = taco_optax.scale_by_taco(weight_dimension_numbers=dims)
  with pytest.raises(ValueError, match=message):
    tx.init({'w': jnp.zeros(shape)})


def test_index_dtype_too_small_for_rows():
  tx = taco_optax.scale_by_taco(index_dtype=jnp.int8)
  with pytest.raises(ValueError, match='cannot index m=300'):
    tx.init({'w': jnp.zeros((4, 300))})


@pytest.mark.parametrize('weight_decay', [0.0, 0.1])
def test_taco_alias_routes_vectors_to_adam(weight_decay):
  """Vectors and scalars get exactly optax's Adam(W), matrices TACO."""
  tx = taco_optax.taco(1e-2, k=2, mu=0.9, adam_learning_rate=3e-3,
                       adam_b1=0.8, adam_b2=0.99, adam_eps=1e-6,
                       adam_weight_decay=weight_decay)
  adam_kwargs = dict(learning_rate=3e-3, b1=0.8, b2=0.99, eps=1e-6)
  adam = (optax.adamw(weight_decay=weight_decay, **adam_kwargs)
          if weight_decay else optax.adam(**adam_kwargs))
  matrix_tx = optax.chain(taco_optax.scale_by_taco(k=2, mu=0.9),
                          optax.scale_by_learning_rate(1e-2))
  rng = np.random.default_rng(2)
  params = {'w': jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
            'b': jnp.asarray(rng.standard_normal((4,)), jnp.float32),
            's': jnp.asarray(rng.standard_normal(()), jnp.float32)}
  vectors = lambda tree: {'b': tree['b'], 's': tree['s']}
  state = tx.init(params)
  adam_state = adam.init(vectors(params))
  matrix_state = matrix_tx.init({'w': params['w']})
  for _ in range(3):
    grads = jax.tree.map(lambda p: jnp.asarray(
        rng.standard_normal(p.shape), jnp.float32), params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    expected, adam_state = jax.jit(adam.update)(
        vectors(grads), adam_state, vectors(params))
    expected_w, matrix_state = jax.jit(matrix_tx.update)(
        {'w': grads['w']}, matrix_state)
    bitwise.assert_bitwise_equal(vectors(updates), expected)
    bitwise.assert_bitwise_equal(updates['w'], expected_w['w'])
    assert (np.asarray(updates['w']) != 0).sum() == 3  # one per column
    params = optax.apply_updates(params, updates)


@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
def test_scale_by_taco_nonfinite_gradient(bad):
  """Documented: the leaf's update is all NaN and its history is unchanged."""
  tx = taco_optax.scale_by_taco(k=3)
  rng = np.random.default_rng(0)
  good = {'w': jnp.asarray(rng.standard_normal((4, 6)), jnp.float32),
          'v': jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)}
  _, state = tx.update(good, tx.init(good))
  grads = {'w': good['w'].at[2, 3].set(bad), 'v': good['v']}
  updates, new_state = jax.jit(tx.update)(grads, state)
  assert np.isnan(np.asarray(updates['w'])).all()
  assert np.isfinite(np.asarray(updates['v'])).all()
  for field in ('values', 'indices', 'exponents'):
    np.testing.assert_array_equal(
        np.asarray(getattr(new_state, field)['w']).view(np.uint8),
        np.asarray(getattr(state, field)['w']).view(np.uint8))
  # The finite leaf still steps: its history moved on.
  assert not np.array_equal(np.asarray(new_state.values['v'], np.float32),
                            np.asarray(state.values['v'], np.float32))
  assert np.isfinite(np.asarray(new_state.values['v'], np.float32)).all()


@pytest.mark.parametrize('where', ['matrix', 'vector'])
def test_apply_if_finite_keeps_params_and_state_intact(where):
  rng = np.random.default_rng(1)
  params = {'w': jnp.asarray(rng.standard_normal((5, 7)), jnp.float32),
            'b': jnp.asarray(rng.standard_normal((7,)), jnp.float32)}
  tx = optax.apply_if_finite(taco_optax.taco(1e-2), max_consecutive_errors=5)
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.asarray(
      rng.standard_normal(p.shape), p.dtype), params)
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  key = 'w' if where == 'matrix' else 'b'
  bad = dict(grads)
  bad[key] = bad[key].at[0].set(jnp.nan)
  updates, new_state = jax.jit(tx.update)(bad, state, params)
  new_params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(new_state.notfinite_count) == 1
  assert all(np.isfinite(np.asarray(x, np.float32)).all()
             for x in jax.tree.leaves(new_state))


def _with_empty(shape, dtype=jnp.float32):
  return {'w': jnp.arange(12.0, dtype=dtype).reshape(4, 3) / 7,
          'z_empty': jnp.ones(shape, dtype), 'b': jnp.ones((3,), dtype)}


# 'z_empty' flattens last, so the other leaves keep their stochastic-rounding
# leaf numbers with or without it.
def _empty_dims(shape):
  return {'w': DN(), 'b': None,
          'z_empty': DN(len(shape) - 2, len(shape) - 1)}


@pytest.mark.parametrize('shape', [(0, 3), (4, 0), (2, 0, 3), (0, 4, 3)])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('factory', ['taco', 'scale_by_taco'])
def test_zero_size_matrix_behaves_like_an_empty_optax_leaf(shape, dtype,
                                                           factory):
  params = _with_empty(shape, dtype)
  build = lambda dims: (
      taco_optax.taco(1e-2, k=2, weight_dimension_numbers=dims)
      if factory == 'taco' else
      taco_optax.scale_by_taco(k=2, weight_dimension_numbers=dims))
  tx = build(_empty_dims(shape))
  without = build({'w': DN(), 'b': None})
  rest = {'w': params['w'], 'b': params['b']}
  state, rest_state = tx.init(params), without.init(rest)
  structure = jax.tree.map(lambda x: (x.shape, x.dtype), state)
  step = jax.jit(tx.update)
  for seed in range(3):
    grads = jax.tree.map(
        lambda p: jax.random.normal(jax.random.key(seed), p.shape, p.dtype),
        params)
    updates, state = step(grads, state, params)
    expected, rest_state = jax.jit(without.update)(
        {'w': grads['w'], 'b': grads['b']}, rest_state, rest)
    # As optax.adam: an empty update of the leaf's shape and dtype.
    adam_updates, _ = optax.adam(1e-2).update(
        grads, optax.adam(1e-2).init(params), params)
    assert updates['z_empty'].shape == adam_updates['z_empty'].shape == shape
    assert updates['z_empty'].dtype == dtype
    bitwise.assert_bitwise_equal({'w': updates['w'], 'b': updates['b']},
                                 expected)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == structure


@pytest.mark.parametrize('shape', [(0, 3), (4, 0)])
def test_zero_size_matrix_in_the_layerwise_step(shape):
  loss = taco_optax.layerwise.LayeredLoss(
      embed=lambda outer, x: x @ outer['w_in'],
      layer=lambda p, h, x: jnp.tanh(h @ p['w']) + p['z_empty'].sum(),
      head=lambda outer, h, x: jnp.mean(h ** 2))
  outer = {'w_in': jnp.ones((3, 8)) / 3}
  layers = {'w': jnp.ones((2, 8, 8)) / 8 + jnp.eye(8),
            'z_empty': jnp.ones((2,) + shape)}
  dims = ({'w_in': DN()}, {'w': DN(1, 2), 'z_empty': DN(1, 2)})
  tx = taco_optax.taco(1e-2, k=2, weight_dimension_numbers=dims)
  step = jax.jit(taco_optax.layerwise.train_step(loss, tx))
  params, state = (outer, layers), tx.init((outer, layers))
  optax_params, optax_state = params, state
  for seed in range(2):
    batch = jax.random.normal(jax.random.key(seed), (5, 3))
    params, state, _ = step(params, state, batch)
    grads = jax.grad(loss)(optax_params, batch)
    updates, optax_state = tx.update(grads, optax_state, optax_params)
    optax_params = optax.apply_updates(optax_params, updates)
  assert params[1]['z_empty'].shape == (2,) + shape
  chex.assert_trees_all_close(params, optax_params, rtol=1e-6)
