"""Bad learning rates, mu and k under inject_hyperparams (issue 51, item 2).

A readable bad value is refused with a message; one only known inside
``jit`` gives a NaN step with TACO's history kept, never a step uphill.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax._src import transform

PARAMS = {'w': jnp.ones((4, 3)), 'b': jnp.zeros((3,))}
GRADS = {'w': jnp.arange(12.0).reshape(4, 3) - 5.0,
         'b': jnp.array([1.0, -2.0, 0.5])}


@pytest.mark.parametrize('learning_rate', [
    -1e-3, float('nan'), float('inf'), np.float32(-1.0), jnp.array(-0.5)])
@pytest.mark.parametrize('argument', ['learning_rate', 'adam_learning_rate'])
def test_bad_constant_rate_refused_when_built(learning_rate, argument):
  kwargs = {'learning_rate': 1e-3, argument: learning_rate}
  with pytest.raises(ValueError, match=f'^{argument} must be finite and >= 0'):
    taco_optax.taco(**kwargs)


@pytest.mark.parametrize('schedule', [
    optax.linear_schedule(-1e-3, 1e-3, 10),
    lambda count: jnp.nan * count,
])
def test_schedule_checked_at_init(schedule):
  tx = taco_optax.taco(schedule)
  with pytest.raises(ValueError, match='a schedule.*at step 0'):
    tx.init(PARAMS)


def _uphill(updates):
  return sum(float(jnp.vdot(updates[key], GRADS[key])) for key in GRADS)


def test_schedule_negative_later_gives_nan_not_uphill():
  # Valid at step 0, negative from step 1 on: inside jit it cannot be refused.
  tx = taco_optax.taco(optax.linear_schedule(1e-3, -1e-3, 1))
  state = tx.init(PARAMS)
  step = jax.jit(tx.update)
  updates, state = step(GRADS, state, PARAMS)
  assert _uphill(updates) < 0
  updates, _ = step(GRADS, state, PARAMS)
  assert all(bool(jnp.isnan(u).all()) for u in jax.tree.leaves(updates))


def test_valid_schedule_is_optax_bit_for_bit():
  schedule = optax.linear_schedule(1e-3, 0.0, 4)
  ours = taco_optax.taco(schedule, mu=0.0)
  state = ours.init(PARAMS)
  updates, _ = jax.jit(ours.update)(GRADS, state, PARAMS)
  direction = taco_optax.scale_by_taco(mu=0.0)
  expected, _ = direction.update({'w': GRADS['w']}, direction.init(
      {'w': PARAMS['w']}))
  np.testing.assert_array_equal(updates['w'], -1e-3 * expected['w'])


@pytest.mark.parametrize('mu', [1.5, -0.1, float('nan'), jnp.array(1.0)])
def test_mu_refused_when_built(mu):
  with pytest.raises(ValueError, match=r'^mu must be in \[0, 1\)'):
    taco_optax.taco(1e-3, mu=mu)


def test_injected_mu_refused_at_init():
  tx = optax.inject_hyperparams(taco_optax.taco)(learning_rate=1e-3, mu=1.5)
  with pytest.raises(ValueError, match=r'^mu must be in \[0, 1\)'):
    tx.init(PARAMS)


def _taco_history(state):
  return transform.taco_states(state.inner_state).direction


@pytest.mark.parametrize('name,value', [('mu', 1.5), ('mu', jnp.nan),
                                        ('learning_rate', -1e-3),
                                        ('learning_rate', jnp.nan)])
def test_injected_value_out_of_range_in_jit_is_a_nan_step(name, value):
  tx = optax.inject_hyperparams(taco_optax.taco)(learning_rate=1e-3)
  state = tx.init(PARAMS)
  state = state._replace(hyperparams={**state.hyperparams,
                                      name: jnp.float32(value)})
  updates, new_state = jax.jit(tx.update)(GRADS, state, PARAMS)
  assert bool(jnp.isnan(updates['w']).all()), updates['w']
  if name == 'mu':
    jax.tree.map(np.testing.assert_array_equal, _taco_history(new_state),
                 _taco_history(state))


def test_inject_hyperparams_needs_no_static_args_for_default_k():
  tx = optax.inject_hyperparams(taco_optax.taco)(
      learning_rate=optax.linear_schedule(1e-3, 0.0, 10))
  state = tx.init(PARAMS)
  updates, _ = jax.jit(tx.update)(GRADS, state, PARAMS)
  assert _uphill(updates) < 0
  assert 'k' not in state.hyperparams
  # k's history is the default 16 entries, capped at m = 3 rows.
  assert _taco_history(state).values['w'].shape == (3, 4)


def test_inject_hyperparams_still_refuses_a_passed_k():
  tx = optax.inject_hyperparams(taco_optax.taco)(learning_rate=1e-3, k=2)
  with pytest.raises(ValueError, match=r"static_args=\('k',\)"):
    tx.init(PARAMS)


def test_equinox_routing_tree_scheduled_by_inject_is_refused_with_the_fix():
  eqx = pytest.importorskip('equinox')
  model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
  params = eqx.filter(model, eqx.is_inexact_array)
  dims = taco_optax.equinox.dimension_numbers(model)
  tx = optax.inject_hyperparams(taco_optax.taco)(
      learning_rate=1e-3, weight_dimension_numbers=dims)
  with pytest.raises(TypeError, match=(
      r"routing tree of Equinox modules.*static_args=\("
      r"'weight_dimension_numbers', 'update_scale'\)")):
    tx.init(params)
  tx = optax.inject_hyperparams(
      taco_optax.taco, static_args=('weight_dimension_numbers',))(
          learning_rate=1e-3, weight_dimension_numbers=dims)
  tx.init(params)
