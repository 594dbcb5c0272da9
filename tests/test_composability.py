"""TACO composes like any optax transformation."""

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from tests.support import bitwise

DN = taco_optax.TacoDimensionNumbers


def _params(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {'dense': {'kernel': jnp.asarray(rng.standard_normal((6, 10)), dtype),
                    'bias': jnp.asarray(rng.standard_normal((10,)), dtype)},
          'out': jnp.asarray(rng.standard_normal((10, 3)), dtype)}


def _grads(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)


def _steps(tx, params, num_steps=4, seed=10):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(num_steps):
    updates, state = update(_grads(params, seed + step), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_chain_after_clip_by_global_norm():
  params = _params()
  clipped, _ = _steps(optax.chain(optax.clip_by_global_norm(0.1),
                                  taco_optax.taco(1e-2)), params)
  plain = params
  tx = taco_optax.taco(1e-2)
  state = tx.init(params)
  for step in range(4):
    g = _grads(params, 10 + step)
    g, _ = optax.clip_by_global_norm(0.1).update(g, optax.EmptyState())
    updates, state = tx.update(g, state, plain)
    plain = optax.apply_updates(plain, updates)
  chex.assert_trees_all_close(clipped, plain)


def test_inject_hyperparams_with_schedule_matches_plain():
  schedule = optax.linear_schedule(0.0, 1e-2, transition_steps=3)
  params = _params()
  injected = optax.inject_hyperparams(taco_optax.taco, static_args=('k',))(
      learning_rate=schedule, k=4, mu=0.9)
  plain = taco_optax.taco(schedule, k=4, mu=0.9)
  p1, s1 = _steps(injected, params)
  p2, _ = _steps(plain, params)
  chex.assert_trees_all_close(p1, p2)
  np.testing.assert_allclose(s1.hyperparams['learning_rate'], schedule(4))


def test_multi_steps_averages_gradients():
  params = _params()
  tx = optax.MultiSteps(taco_optax.taco(1e-2, k=4), every_k_schedule=2)
  multi, _ = _steps(tx, params, num_steps=4)
  single_tx = taco_optax.taco(1e-2, k=4)
  state = single_tx.init(params)
  single = params
  for step in (0, 2):
    g = jax.tree.map(lambda a, b: (a + b) / 2, _grads(params, 10 + step),
                     _grads(params, 11 + step))
    updates, state = single_tx.update(g, state, single)
    single = optax.apply_updates(single, updates)
  chex.assert_trees_all_close(multi, single)


def test_params_none_is_accepted():
  params = _params()
  matrices = {'kernel': params['dense']['kernel'], 'out': params['out']}
  tx = taco_optax.scale_by_taco()
  updates, _ = tx.update(matrices, tx.init(matrices), None)
  chex.assert_trees_all_equal_shapes(updates, matrices)
  tx = taco_optax.taco(1e-3)  # adam_weight_decay=0 needs no params
  updates, _ = tx.update(params, tx.init(params))
  chex.assert_trees_all_equal_shapes(updates, params)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_updates_keep_the_param_dtype(dtype):
  params = _params(dtype=dtype)
  tx = taco_optax.taco(1e-3)
  updates, state = tx.update(params, tx.init(params), params)
  chex.assert_trees_all_equal_dtypes(updates, params)
  new = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal_dtypes(new, params)


def test_empty_trees_and_none_leaves():
  tx = taco_optax.taco(1e-3)
  updates, _ = tx.update({}, tx.init({}), {})
  assert updates == {}
  params = {'a': None, 'w': jnp.ones((3, 2))}
  updates, _ = tx.update(params, tx.init(params), params)
  assert updates['a'] is None and updates['w'].shape == (3, 2)
  # A None dimension-numbers leaf means "not TACO".
  tx = taco_optax.scale_by_taco(
      weight_dimension_numbers={'a': None, 'w': DN()})
  params = {'a': jnp.ones((4, 4)), 'w': jnp.ones((3, 2))}
  state = tx.init(params)
  assert isinstance(state.values['a'], optax.MaskedNode)
  updates, _ = tx.update(params, state)
  chex.assert_trees_all_equal(updates['a'], params['a'])


def test_scanned_layer_axis_equals_per_slice_matrices():
  rng = np.random.default_rng(3)
  stacked = jnp.asarray(rng.standard_normal((3, 6, 9)), jnp.float32)
  tx = taco_optax.scale_by_taco(k=4, weight_dimension_numbers=DN(1, 2))
  slice_tx = taco_optax.scale_by_taco(k=4)
  state, slice_states = tx.init({'w': stacked}), [
      slice_tx.init({'w': stacked[i]}) for i in range(3)]
  for step in range(3):
    g = stacked * (step + 1) + jnp.asarray(rng.standard_normal(stacked.shape),
                                           jnp.float32)
    updates, state = tx.update({'w': g}, state)
    for i in range(3):
      u, slice_states[i] = slice_tx.update({'w': g[i]}, slice_states[i])
      bitwise.assert_bitwise_equal(updates['w'][i], u['w'])
      bitwise.assert_bitwise_equal([x['w'][i] for x in state],
                                   [x['w'] for x in slice_states[i]])


def test_fused_qkv_equals_three_matrices():
  rng = np.random.default_rng(4)
  d = 8
  fused = jnp.asarray(rng.standard_normal((d, 3, d)), jnp.float32)
  tx = taco_optax.scale_by_taco(k=4, weight_dimension_numbers=DN(0, 2))
  separate_tx = taco_optax.scale_by_taco(k=4)
  split = lambda x: {name: x[:, i] for i, name in enumerate('qkv')}
  state = tx.init({'qkv': fused})
  assert state.values['qkv'].shape == (3, 4, d)
  separate_state = separate_tx.init(split(fused))
  for step in range(3):
    g = jnp.asarray(rng.standard_normal(fused.shape), jnp.float32)
    updates, state = tx.update({'qkv': g}, state)
    separate, separate_state = separate_tx.update(split(g), separate_state)
    for i, name in enumerate('qkv'):
      bitwise.assert_bitwise_equal(updates['qkv'][:, i], separate[name])
      bitwise.assert_bitwise_equal([x['qkv'][i] for x in state],
                                   [x[name] for x in separate_state])


def test_transposed_and_multi_axis_dimension_numbers():
  """A PyTorch-layout (out, in) matrix and a (heads, head_dim, d) kernel."""
  rng = np.random.default_rng(5)
  w = jnp.asarray(rng.standard_normal((7, 5)), jnp.float32)
  flipped = taco_optax.scale_by_taco(k=3, weight_dimension_numbers=DN(1, 0))
  plain = taco_optax.scale_by_taco(k=3)
  u1, _ = flipped.update({'w': w}, flipped.init({'w': w}))
  u2, _ = plain.update({'w': w.T}, plain.init({'w': w.T}))
  chex.assert_trees_all_equal(u1['w'], u2['w'].T)
  out = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
  multi = taco_optax.scale_by_taco(k=3, weight_dimension_numbers=DN((0, 1), 2))
  u1, s1 = multi.update({'o': out}, multi.init({'o': out}))
  u2, _ = plain.update({'o': out.reshape(6, 4)},
                       plain.init({'o': out.reshape(6, 4)}))
  chex.assert_trees_all_equal(u1['o'], u2['o'].reshape(2, 3, 4))
  assert s1.values['o'].shape == (3, 6)


def test_jit_does_not_recompile_and_state_is_fixed():
  params = _params()
  tx = taco_optax.taco(1e-3)
  state = tx.init(params)
  shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
  update = jax.jit(tx.update)
  for step in range(3):
    updates, state = update(_grads(params, step), state, params)
    chex.assert_trees_all_equal(
        jax.tree.map(lambda x: (x.shape, x.dtype), state), shapes)
  assert update._cache_size() == 1


def test_nnx_optimizer_integration():
  model = nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(16, 1, rngs=nnx.Rngs(1)))
  optimizer = nnx.Optimizer(model, taco_optax.taco(3e-2, k=4), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(0), (64, 4))
  y = jnp.sin(x.sum(axis=1, keepdims=True))

  @nnx.jit(donate_argnames=('model', 'optimizer'))
  def train_step(model, optimizer, x, y):
    loss_fn = lambda model: jnp.mean((model(x) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer, x, y)) for _ in range(150)]
  assert losses[-1] < 0.5 * losses[0]
  values = [x for x in jax.tree.leaves(nnx.state(optimizer))
            if getattr(x, 'dtype', None) == jnp.float8_e4m3fn]
  assert sorted(v.shape for v in values) == [(1, 16), (4, 4)]  # (min(k, m), n)


def _fit(loss, params, tx, num_steps):
  """Full-batch gradient descent with tx; returns the final params."""

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for _ in range(num_steps):
    params, state = step(params, state)
  return params


def test_converges_on_least_squares():
  rng = np.random.default_rng(6)
  a = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
  w_true = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  b = a @ w_true
  loss = lambda p: jnp.mean((a @ p['w'] - b) ** 2)
  params = {'w': jnp.zeros((16, 8))}
  tx = taco_optax.taco(optax.linear_schedule(0.2, 0.0, 400), k=4, mu=0.5)
  initial = float(loss(params))
  assert float(loss(_fit(loss, params, tx, 400))) < 1e-2 * initial


def test_converges_on_a_small_mlp():
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((128, 8)), jnp.float32)
  y = jnp.tanh(x @ jnp.asarray(rng.standard_normal((8, 1)), jnp.float32))
  params = {'w1': jnp.asarray(rng.standard_normal((8, 32)) / 3, jnp.float32),
            'b1': jnp.zeros((32,)),
            'w2': jnp.asarray(rng.standard_normal((32, 1)) / 6, jnp.float32),
            'b2': jnp.zeros((1,))}

  def loss(p):
    hidden = jax.nn.relu(x @ p['w1'] + p['b1'])
    return jnp.mean((hidden @ p['w2'] + p['b2'] - y) ** 2)

  tx = taco_optax.taco(optax.linear_schedule(0.05, 0.0, 500), k=8,
                       adam_learning_rate=1e-2)
  initial = float(loss(params))
  assert float(loss(_fit(loss, params, tx, 500))) < 0.1 * initial
