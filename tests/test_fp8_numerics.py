"""The FP8 history keeps the right winners at real gradient magnitudes."""

from hypothesis import given, strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taco_optax
from taco_optax import _selection
from tests import reference


def _gradient_stream(seed, steps, n=16, m=64, magnitude=1.0):
  """A persistent signal plus minibatch noise, like fine-tuning gradients."""
  rng = np.random.default_rng(seed)
  signal = rng.standard_normal((n, m)) * rng.lognormal(0, 1, (n, m))
  return [((signal + 2.0 * rng.standard_normal((n, m))) * magnitude
           ).astype(np.float32) for _ in range(steps)]


def _trajectory(tx, grads):
  state = tx.init({'w': grads[0]})
  update = jax.jit(tx.update)
  updates, states = [], []
  for g in grads:
    u, state = update({'w': jnp.asarray(g)}, state)
    updates.append(np.asarray(u['w']))
    states.append(jax.tree.map(np.asarray, state))
  return updates, states


@pytest.mark.parametrize('power', [-30, -20, -10, -1, 5, 12])
def test_power_of_two_scaling_changes_nothing_but_exponents(power):
  """(a) Scaling every gradient by 2**p leaves updates and indices unchanged."""
  grads = _gradient_stream(0, steps=25, magnitude=1e-6)
  tx = taco_optax.scale_by_taco(k=8, mu=0.95)
  base_updates, base_states = _trajectory(tx, grads)
  updates, states = _trajectory(tx, [g * np.float32(2.0**power) for g in grads])
  for u0, u1, s0, s1 in zip(base_updates, updates, base_states, states):
    np.testing.assert_array_equal(u0, u1)
    np.testing.assert_array_equal(s0.indices['w'], s1.indices['w'])
    np.testing.assert_array_equal(s0.values['w'].view(np.uint8),
                                  s1.values['w'].view(np.uint8))
    nonzero = s0.values['w'][0] != 0
    np.testing.assert_array_equal(
        (s1.exponents['w'].astype(int) - s0.exponents['w'])[nonzero], power)


@given(st.integers(0, 2**31 - 1), st.floats(-10, 4), st.sampled_from([0.5, 0.95]))
def test_one_step_winners_equal_float64(seed, log10_magnitude, mu):
  """(b) Given the same state, winners are those of an exact computation.

  The candidates are formed in float32 from the decoded FP8 history; the
  winner may differ from the float64 argmax only where two candidates agree
  to float32 rounding. Stored values are the candidates rounded to FP8.
  """
  rng = np.random.default_rng(seed)
  n, m, k = 8, 40, 6
  magnitude = 10.0 ** log10_magnitude
  tx = taco_optax.scale_by_taco(k=k, mu=mu)
  state = tx.init({'w': jnp.zeros((n, m))})
  for _ in range(3):  # build a non-trivial history
    g = (rng.standard_normal((n, m)) * magnitude).astype(np.float32)
    _, state = tx.update({'w': jnp.asarray(g)}, state)
  g = (rng.standard_normal((n, m)) * magnitude).astype(np.float32)
  history = reference.History(*(np.asarray(x['w']) for x in state))
  exact = reference.candidates(g.T, history, mu)  # (m, n) float64
  updates, new_state = tx.update({'w': jnp.asarray(g)}, state)
  winners = np.abs(np.asarray(updates['w'])).argmax(axis=1)
  best = np.abs(exact).max(axis=0)
  chosen = np.abs(exact[winners, np.arange(n)])
  np.testing.assert_array_less(best - chosen, best * 2e-7 + 1e-45)
  clear = np.sort(np.abs(exact), axis=0)
  clear = clear[-1] - clear[-2] > best * 1e-6
  np.testing.assert_array_equal(winners[clear],
                                np.abs(exact).argmax(axis=0)[clear])
  # Stored values: FP8 rounding (3 mantissa bits) of the exact candidates,
  # or below FP8's subnormal range relative to the column maximum.
  stored = (np.asarray(new_state.values['w'], np.float64)
            * 2.0 ** np.asarray(new_state.exponents['w'], np.float64))
  kept = exact[np.asarray(new_state.indices['w']), np.arange(n)]
  tolerance = np.abs(kept) * 2.0**-4 + best * 2.0**-17
  assert (np.abs(stored - kept) <= tolerance).all()


def _agreement(grads, **kwargs):
  fp8, _ = _trajectory(taco_optax.scale_by_taco(**kwargs), grads)
  f32, _ = _trajectory(
      taco_optax.scale_by_taco(values_dtype=jnp.float32, **kwargs), grads)
  same = [(np.abs(a).argmax(1) == np.abs(b).argmax(1)).mean()
          for a, b in zip(fp8, f32)]
  return float(np.mean(same))


@pytest.mark.parametrize('magnitude', [1e-10, 1e-6, 1.0, 1e4])
def test_winners_over_many_steps_agree_with_float32_history(magnitude):
  """(c) How often FP8-history winners equal float32-history winners.

  The rate is printed (run pytest with -s); the bound is well below what is
  measured (0.97-1.0 on this stream) and far above what an underflowing
  history gives (see the next test).
  """
  grads = _gradient_stream(1, steps=60, magnitude=magnitude)
  rate = _agreement(grads, k=16, mu=0.95)
  print(f'winner agreement FP8 vs f32 history at {magnitude:g}: {rate:.4f}')
  assert rate >= 0.9


def test_unscaled_fp8_cast_would_lose_the_history():
  """Why the per-column scale exists: a raw cast of 1e-6 values is all zeros."""
  raw = jnp.asarray(np.full((4,), 1e-6, np.float32)).astype(jnp.float8_e4m3fn)
  assert not np.asarray(raw, np.float32).any()
  encoded = _selection.encode(jnp.full((1, 4), 1e-6), jnp.float8_e4m3fn)
  np.testing.assert_allclose(_selection.decode(encoded), 1e-6, rtol=2**-4)


@pytest.mark.parametrize('value', [1e-35, 1e-30, 1e30, 3e38, -3.4e38])
def test_extreme_magnitudes_stay_finite(value):
  g = np.zeros((3, 5), np.float32)
  g[:, 2] = value
  g[1, 4] = value / 2
  tx = taco_optax.scale_by_taco(k=3, mu=0.95)
  updates, states = _trajectory(tx, [g, g, -g])
  for u, s in zip(updates, states):
    assert np.isfinite(u).all()
    assert np.isfinite(s.values['w'].astype(np.float32)).all()
  assert (np.abs(updates[0]).argmax(1) == 2).all()
  assert (np.sign(updates[0][:, 2]) == np.sign(value)).all()


def test_below_float32_normal_range_gives_zero_update_not_nan():
  """(1 - mu) * 1e-39 is subnormal: XLA flushes it to zero, so no winner."""
  g = np.full((3, 5), 1e-39, np.float32)
  tx = taco_optax.scale_by_taco(k=3, mu=0.95)
  updates, states = _trajectory(tx, [g, g])
  for u, s in zip(updates, states):
    assert np.isfinite(u).all()
    assert np.isfinite(s.values['w'].astype(np.float32)).all()
