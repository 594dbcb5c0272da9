"""TACO's state with optax's tree utilities, as optax's own states (issue 51,
item 6)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax

otu = optax.tree_utils
PARAMS = {'w': jnp.ones((8, 4)), 'b': jnp.zeros((4,))}
GRADS = {'w': jnp.arange(32.0).reshape(8, 4) - 9.0, 'b': jnp.ones((4,))}


def test_one_count_when_nothing_is_rounded():
  tx = taco_optax.taco(1e-3)
  state = tx.init(PARAMS)
  assert int(otu.tree_get(state, 'count')) == 0
  _, state = tx.update(GRADS, state, PARAMS)
  assert int(otu.tree_get(state, 'count')) == 1
  state = otu.tree_set(state, count=jnp.asarray(7, jnp.int32))
  assert int(otu.tree_get(state, 'count')) == 7
  # As optax.adamw's: one count, Adam's.
  assert len(otu.tree_get_all_with_path(state, 'count')) == len(
      otu.tree_get_all_with_path(optax.adamw(1e-3).init(PARAMS), 'count'))


def test_sixteen_bit_params_keep_their_rounding_counters():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  tx = taco_optax.taco(1e-3)
  state = tx.init(params)
  updates, state = tx.update(jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                          GRADS), state, params)
  counts = [int(c) for _, c in otu.tree_get_all_with_path(state, 'count')]
  assert counts == [1, 1, 1]
  assert updates['w'].dtype == jnp.bfloat16


def test_injected_learning_rate_is_read_and_set():
  tx = optax.inject_hyperparams(taco_optax.taco)(learning_rate=1e-3)
  state = tx.init(PARAMS)
  assert float(otu.tree_get(state, 'learning_rate')) == pytest.approx(1e-3)
  doubled = otu.tree_set(state, learning_rate=jnp.float32(2e-3))
  one, _ = tx.update(GRADS, state, PARAMS)
  two, _ = tx.update(GRADS, doubled, PARAMS)
  np.testing.assert_allclose(two['w'], 2 * one['w'], rtol=1e-6)


def test_tree_map_params_sees_parameter_shaped_leaves_only():
  tx = taco_optax.taco(1e-3)
  state = tx.init(PARAMS)
  seen = []

  def record(x):
    seen.append(x.shape)
    return x

  mapped = otu.tree_map_params(tx, record, state)
  # Adam's two moments of 'b' (the TACO leaf 'w' is masked there); never
  # TACO's (k, n) histories or (n,) exponents.
  assert seen == [(4,), (4,)]
  assert jax.tree.structure(mapped) == jax.tree.structure(state)


def test_tree_map_params_for_bf16_and_injected_states():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  for tx in (taco_optax.taco(1e-3),
             optax.inject_hyperparams(taco_optax.taco)(learning_rate=1e-3)):
    state = tx.init(params)
    seen = []
    otu.tree_map_params(tx, lambda x: seen.append(x.shape) or x, state)
    assert seen == [(4,), (4,)]


def test_tree_cast_keeps_the_structure_and_tree_norm_of_updates():
  tx = taco_optax.taco(1e-3)
  state = tx.init(PARAMS)
  cast = otu.tree_cast(state, jnp.float32)
  assert jax.tree.structure(cast) == jax.tree.structure(state)
  updates, _ = tx.update(GRADS, state, PARAMS)
  assert float(otu.tree_norm(updates)) > 0


def test_the_states_norm_is_taken_in_float32():
  # float8 histories square to NaN past 448 in float8: the documented way
  # casts first, and gives the float64 norm of every state leaf (tree_cast
  # casts them all, counts and indices too, as tree_norm reads an adamw
  # state's count).
  tx = taco_optax.taco(1e-3)
  params = {'w': jnp.ones((8, 4))}
  grads = {'w': jnp.sin(jnp.arange(32.0).reshape(8, 4))}
  _, state = tx.update(grads, tx.init(params), params)
  got = float(otu.tree_norm(otu.tree_cast(state, jnp.float32)))
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(state)]
  history = state.inner_states['taco'].inner_state[0].values['w']
  assert np.abs(np.asarray(history, np.float32)).max() > 21  # squares > 448
  expected = np.sqrt(sum(float((x ** 2).sum()) for x in leaves))
  np.testing.assert_allclose(got, expected, rtol=1e-6)
