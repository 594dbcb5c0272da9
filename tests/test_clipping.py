"""What global-norm clipping means for TACO, on each path (README, Clipping)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from tests import test_train_step as case


def _winners(tx, grads_sequence):
  """The nonzero positions of each step's update (TACO's winners)."""
  params = {'w': jnp.zeros(grads_sequence[0].shape)}
  state = tx.init(params)
  winners = []
  for grads in grads_sequence:
    updates, state = tx.update({'w': grads}, state, params)
    winners.append(np.asarray(updates['w']) != 0)
  return winners


def _grads():
  keys = jax.random.split(jax.random.key(3), 4)
  # Step sizes that differ by 100x: clipping scales them unequally.
  return [jax.random.normal(k, (16, 8)) * s for k, s in zip(keys,
                                                            (1, 100, 1, 100))]


def test_one_constant_scale_leaves_every_winner():
  # The column step merges mu * M + (1 - mu) * c * G: with the same c at every
  # step the history is c times as large too, so each column's order is
  # unchanged (powers of two: the FP8 history's values keep their bits).
  grads = _grads()
  plain = _winners(taco_optax.taco(1e-2, k=4), grads)
  scaled = _winners(taco_optax.taco(1e-2, k=4), [g * 0.25 for g in grads])
  for a, b in zip(plain, scaled):
    np.testing.assert_array_equal(a, b)


def test_global_norm_clipping_changes_winners_on_the_optax_path():
  # Clipping scales each step by its own min(1, c / ||G_t||): the history is
  # then weighed against another multiple of the new gradient.
  grads = _grads()
  plain = _winners(taco_optax.taco(1e-2, k=4), grads)
  clipped = _winners(optax.chain(optax.clip_by_global_norm(1.0),
                                 taco_optax.taco(1e-2, k=4)), grads)
  assert not all(np.array_equal(a, b) for a, b in zip(plain, clipped))


def test_the_layerwise_step_refuses_a_clipping_chain_saying_why():
  loss = taco_optax.layerwise.LayeredLoss(case._embed, case._layer,
                                          case._head)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   taco_optax.taco(1e-2,
                                   weight_dimension_numbers=case._matrix_dims))
  with pytest.raises(ValueError, match='Global-norm clipping cannot run '
                     'layer-wise'):
    taco_optax.layerwise.train_step(loss, tx)
