"""Errors raised where their cause is, naming the leaf and the argument
(issue 51, item 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taco_optax

DN = taco_optax.TacoDimensionNumbers


@pytest.mark.parametrize('k', [16, None])
def test_row_count_mismatch_without_params_raises_in_update(k):
  tx = taco_optax.taco(1e-3, k=k)
  state = tx.init({'w': jnp.ones((8, 4))})
  with pytest.raises(ValueError, match=(
      r"^The gradient of the TACO leaf 'w' has shape \(8, 5\).*keeping 4 of "
      'their rows')):
    tx.update({'w': jnp.ones((8, 5))}, state)


@pytest.mark.parametrize('implementation', ['reference', 'auto'])
@pytest.mark.parametrize('rounding', ['stochastic', 'nearest'])
def test_numpy_inputs_work_as_with_adamw(implementation, rounding):
  params = {'w': np.ones((8, 4), np.float32), 'b': np.zeros(4, np.float32)}
  grads = {'w': np.arange(32, dtype=np.float32).reshape(8, 4) - 10,
           'b': np.ones(4, np.float32)}
  tx = taco_optax.taco(1e-3, implementation=implementation, rounding=rounding)
  updates, _ = tx.update(grads, tx.init(params), params)
  as_jax = jax.tree.map(jnp.asarray, (grads, params))
  expected, _ = tx.update(*as_jax[:1], tx.init(as_jax[1]), as_jax[1])
  jax.tree.map(np.testing.assert_array_equal, updates, expected)
  direction = taco_optax.scale_by_taco()
  updates, _ = direction.update({'w': grads['w']},
                                direction.init({'w': params['w']}))
  assert isinstance(updates['w'], jax.Array)


def test_float0_gradient_named():
  params = {'w': jnp.ones((8, 4)), 'steps': jnp.array(3)}
  grads = jax.grad(lambda p: jnp.sum(p['w']) * p['steps'],
                   allow_int=True)(params)
  tx = taco_optax.taco(1e-3)
  with pytest.raises(ValueError, match=(
      r"^The gradient of 'steps' is float0.*allow_int=True")):
    tx.update(grads, tx.init(params), params)


def test_routing_tree_with_other_keys_names_weight_dimension_numbers():
  params = {'w': jnp.ones((8, 4)), 'b': jnp.zeros(4)}
  tx = taco_optax.taco(1e-3, weight_dimension_numbers={'W': DN(), 'b': None})
  with pytest.raises(ValueError, match=(
      r"^weight_dimension_numbers does not fit the parameters.*"
      r"entries for no parameter: \['W'\]; parameters without an entry: "
      r"\['w'\]")):
    tx.init(params)


def test_apply_updates_is_never_reached_with_a_wrong_shape():
  # With params, the check names the leaf before anything runs.
  params = {'w': jnp.ones((8, 4))}
  tx = taco_optax.taco(1e-3)
  with pytest.raises(ValueError, match=r"^The gradient of 'w' has shape"):
    tx.update({'w': jnp.ones((8, 5))}, tx.init(params), params)
