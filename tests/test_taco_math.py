"""TACO's mathematics: exact minimiser, ternary one-sparse updates, the rule."""

import chex
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import taco_optax
from tests.support import bitwise
from tests.support import reference
from tests.support import strategies


def _run(tx, grads_seq):
  """Runs tx over a list of gradient trees; returns (updates list, states)."""
  state = tx.init(grads_seq[0])
  update = jax.jit(tx.update)
  outs, states = [], []
  for grads in grads_seq:
    updates, state = update(grads, state)
    outs.append(updates)
    states.append(state)
  return outs, states


@st.composite
def matrices(draw, max_side=24):
  """A Flax-layout ``(n, m)`` gradient with ties, zero columns, wide scales."""
  n = draw(st.integers(1, max_side))
  m = draw(st.integers(1, max_side))
  return draw(strategies.gradients((n, m)))


@given(matrices())
def test_vanilla_update_is_the_exact_minimiser(g):
  """With mu=0, -D is the exact minimiser of <G, D> on the 1->1 unit ball."""
  n, m = g.shape  # Flax layout: n columns (reduction), m rows (output).
  tx = taco_optax.scale_by_taco(k=4, mu=0.0)
  (updates,), _ = _run(tx, [{'w': jnp.asarray(g)}])
  step = -np.asarray(updates['w'], np.float64)  # descent step, (n, m)
  g = g.astype(np.float64)
  column_inf_norms = np.abs(g).max(axis=1)
  optimum = -(m / n) * column_inf_norms.sum()
  tolerance = 1e-9 * abs(optimum)
  # The step size is m/n rounded to float32: a relative 2**-24.
  np.testing.assert_allclose((g * step).sum(), optimum, rtol=2e-7, atol=0)
  # Feasible: normalised 1->1 norm (n/m) * max_j ||d_j||_1 <= 1, with
  # equality unless the gradient is zero.
  norm = (n / m) * np.abs(step).sum(axis=1).max()
  assert norm <= 1 + 2e-7
  assert norm == 0 or abs(norm - 1) <= 2e-7
  # No feasible direction does better (random points of the unit ball).
  rng = np.random.default_rng(0)
  for _ in range(20):
    d = rng.standard_normal((n, m)) * (rng.random((n, m)) < 0.5)
    norm = (n / m) * np.abs(d).sum(axis=1).max()
    if norm == 0:
      continue
    assert (g * d / norm).sum() >= optimum - tolerance


@given(matrices(), st.integers(1, 4), st.sampled_from([0.0, 0.5, 0.95]))
def test_updates_are_ternary_and_r_sparse(g, r, mu):
  """Exactly min(r, nonzeros) signs per column, at the largest entries."""
  n, m = g.shape
  tx = taco_optax.scale_by_taco(k=4, mu=mu, update_topk=r)
  outs, _ = _run(tx, [{'w': jnp.asarray(g)},
                      {'w': jnp.asarray(g[::-1].copy())}])
  for updates in outs:
    u = np.asarray(updates['w'])
    assert set(np.unique(np.abs(u))) <= {0.0, np.float32(m / n)}
    assert ((u != 0).sum(axis=1) <= min(r, m)).all()
  # The first step starts from an empty history: its candidates are
  # (1 - mu) * g, so each column gets exactly min(r, nonzeros) signs, each
  # the sign of g there, at entries no smaller than any entry left out.
  u = np.asarray(outs[0]['w'])
  chosen = u != 0
  np.testing.assert_array_equal(chosen.sum(axis=1),
                                np.minimum(r, (g != 0).sum(axis=1)))
  np.testing.assert_array_equal(np.sign(u[chosen]), np.sign(g[chosen]))
  magnitudes = np.abs(g)
  smallest_chosen = np.where(chosen, magnitudes, np.inf).min(axis=1)
  largest_left = np.where(chosen, -np.inf, magnitudes).max(axis=1)
  assert (smallest_chosen >= largest_left).all()


@pytest.mark.parametrize('k,mu,r', [(1, 0.95, 1), (3, 0.9, 1), (4, 0.95, 2),
                                    (8, 0.5, 3), (16, 0.95, 1), (5, 0.0, 1)])
def test_matches_numpy_reference_over_steps(k, mu, r):
  rng = np.random.default_rng(k * 100 + r)
  n, m, steps = 7, 12, 8
  grads = [rng.standard_normal((n, m)).astype(np.float32)
           * 10.0 ** rng.uniform(-8, 2) for _ in range(steps)]
  grads[3][2] = 0.0  # an all-zero column
  grads[5][1, :4] = 1.5  # ties
  grads[6][4, 7] = np.nan  # a skipped step: NaN update, history kept
  tx = taco_optax.scale_by_taco(k=k, mu=mu, update_topk=r)
  outs, states = _run(tx, [{'w': jnp.asarray(g)} for g in grads])
  history = reference.init(m, n, k)
  for g, updates, state in zip(grads, outs, states):
    direction, history = reference.step(g.T, history, mu, r=r)
    np.testing.assert_array_equal(np.asarray(updates['w']), direction.T)
    np.testing.assert_array_equal(
        np.asarray(state.values['w']).view(np.uint8),
        history.values.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(state.indices['w']),
                                  history.indices)
    np.testing.assert_array_equal(np.asarray(state.exponents['w']),
                                  history.exponents)


def test_dense_history_equals_dense_ema():
  """k=None with a float32 history is the dense EMA TACO, exactly."""
  rng = np.random.default_rng(1)
  n, m, mu = 6, 9, 0.9
  tx = taco_optax.scale_by_taco(k=None, mu=mu, values_dtype=jnp.float32)
  grads = [rng.standard_normal((n, m)).astype(np.float32) for _ in range(10)]
  outs, states = _run(tx, [{'w': jnp.asarray(g)} for g in grads])
  ema = np.zeros((n, m), np.float32)
  for g, updates, state in zip(grads, outs, states):
    ema = np.float32(mu) * ema + np.float32(1 - mu) * g
    winners = np.abs(ema).argmax(axis=1)
    expected = np.zeros_like(ema)
    rows = np.arange(n)
    expected[rows, winners] = (m / n) * np.sign(ema[rows, winners])
    np.testing.assert_array_equal(np.asarray(updates['w']), expected)
    assert state.values['w'].shape == (m, n)
    dense = np.zeros((n, m), np.float32)
    values = np.asarray(state.values['w']) * 2.0 ** np.asarray(
        state.exponents['w'], np.float64)
    for slot in range(m):
      dense[np.arange(n), np.asarray(state.indices['w'])[slot]] = values[slot]
    np.testing.assert_array_equal(dense, ema)


def test_k_larger_than_m_keeps_m_entries():
  tx = taco_optax.scale_by_taco(k=16, mu=0.9)
  params = {'w': jnp.zeros((5, 3))}
  state = tx.init(params)
  chex.assert_shape(state.values['w'], (3, 5))
  chex.assert_shape(state.indices['w'], (3, 5))
  g = {'w': jnp.arange(15.0).reshape(5, 3) - 7}
  updates, state = tx.update(g, state)
  assert sorted(np.asarray(state.indices['w'])[:, 0].tolist()) == [0, 1, 2]


def test_zero_columns_and_ties_are_deterministic():
  g = np.zeros((4, 6), np.float32)
  g[1] = [0, 2, -2, 2, 1, 0]   # tie between rows 1, 2, 3: lowest index wins
  g[2] = [0, 0, 0, 0, 0, -3]
  tx = taco_optax.scale_by_taco(k=2, mu=0.95)
  state = tx.init({'w': g})
  updates, state = jax.jit(tx.update)({'w': jnp.asarray(g)}, state)
  u = np.asarray(updates['w'])
  scale = 6 / 4
  expected = np.zeros_like(g)
  expected[1, 1] = scale
  expected[2, 5] = -scale
  np.testing.assert_array_equal(u, expected)
  assert np.isfinite(np.asarray(state.values['w'], np.float32)).all()
  np.testing.assert_array_equal(np.asarray(state.indices['w'])[:, 1], [1, 2])
  np.testing.assert_array_equal(np.asarray(state.values['w'])[:, 0], [0, 0])


def test_update_scale_override():
  params = {'embed': jnp.ones((10, 4)), 'w': jnp.ones((4, 8))}
  tx = taco_optax.scale_by_taco(
      k=2, mu=0.0, update_scale=lambda p: {'embed': 1.0, 'w': None})
  grads = jax.tree.map(lambda x: x * 3.0, params)
  updates, _ = tx.update(grads, tx.init(params))
  assert set(np.unique(np.asarray(updates['embed']))) == {0.0, 1.0}
  assert set(np.unique(np.asarray(updates['w']))) == {0.0, 2.0}
  tx = taco_optax.scale_by_taco(k=2, mu=0.0, update_scale=0.5)
  updates, _ = tx.update(grads, tx.init(params))
  assert set(np.unique(np.asarray(updates['w']))) == {0.0, 0.5}


def test_int16_indices():
  tx = taco_optax.scale_by_taco(k=4, index_dtype=jnp.int16)
  g = {'w': jax.random.normal(jax.random.key(0), (8, 300))}
  state = tx.init(g)
  chex.assert_type(state.indices['w'], jnp.int16)
  _, state = tx.update(g, state)
  chex.assert_type(state.indices['w'], jnp.int16)
  reference_tx = taco_optax.scale_by_taco(k=4)
  _, reference_state = reference_tx.update(g, reference_tx.init(g))
  np.testing.assert_array_equal(state.indices['w'],
                                reference_state.indices['w'])


def test_state_memory_is_5k_plus_1_bytes_per_column():
  params = {'w': jnp.zeros((576, 1536), jnp.bfloat16)}
  state = taco_optax.scale_by_taco(k=16).init(params)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  assert nbytes == (5 * 16 + 1) * 576
  assert state.values['w'].dtype == ml_dtypes.float8_e4m3fn


@given(st.data(), st.integers(1, 3), st.integers(1, 9), st.integers(1, 20),
       st.integers(1, 20), st.sampled_from([0.0, 0.9, 0.95]),
       st.integers(1, 3))
def test_matches_reference_with_batch_axes(data, batch, n, m, k, mu, r):
  """Drawn gradients (ties, zero columns, NaN/Inf, 2**-80 .. 2**80), a batch
  axis, any k (also > m), r <= k: updates and the whole state, bit for bit."""
  r = min(r, k)
  grads = data.draw(strategies.gradient_sequences((batch, n, m), steps=3,
                                                  nonfinite=True))
  tx = taco_optax.scale_by_taco(
      k=k, mu=mu, update_topk=r,
      weight_dimension_numbers=taco_optax.TacoDimensionNumbers(1, 2))
  outs, states = _run(tx, [{'w': jnp.asarray(g)} for g in grads])
  histories = [reference.init(m, n, k) for _ in range(batch)]
  for g, updates, state in zip(grads, outs, states):
    finite = np.isfinite(g).all()  # the rule is per leaf, not per slice
    for b in range(batch):
      direction, histories[b] = reference.step(
          g[b].T if finite else np.full((m, n), np.nan, np.float32),
          histories[b], mu, r=r)
      np.testing.assert_array_equal(np.asarray(updates['w'][b]), direction.T)
      bitwise.assert_bitwise_equal(
          [state.values['w'][b], state.indices['w'][b],
           state.exponents['w'][b]],
          [histories[b].values, histories[b].indices.astype(np.int32),
           histories[b].exponents.astype(np.int8)])
