"""benchmarks/step_time.py's scatter row times the layer-wise step on the
gradient it is given: the loss it builds has exactly that gradient, and the
step it runs makes taco's optax update on it."""

import jax
import jax.numpy as jnp
import optax
import pytest

from benchmarks import step_time
import taco_optax
from tests.support.bitwise import assert_bitwise_equal


@pytest.fixture
def tiny(monkeypatch):
  # vocab, hidden, layers, ffn, q dim, kv dim
  monkeypatch.setitem(step_time.SHAPES, 'tiny', (40, 16, 3, 24, 16, 8))
  params = step_time.llama_params('tiny', jnp.float32)
  # A different gradient for every leaf (each block's differs from the
  # others', so a block handed another's slice is seen).
  grads = {name: jax.random.normal(jax.random.key(i), p.shape)
           for i, (name, p) in enumerate(sorted(params.items()))}
  return params, grads


def test_split_is_the_examples(tiny):
  params, _ = tiny
  outer, layers = step_time.layered_split(params)
  assert sorted(outer) == ['embedding', 'final_norm', 'lm_head']
  assert len(layers) == 3
  assert sorted(layers[2]) == ['attn_norm', 'down', 'gate', 'k', 'mlp_norm',
                               'o', 'q', 'up', 'v']
  assert layers[2]['q'] is params['layer2/q']


def test_loss_gradient_is_the_given_gradient(tiny):
  params, grads = tiny
  loss = step_time.given_gradient_loss()
  got = jax.grad(loss)(step_time.layered_split(params),
                       step_time.given_batch(grads))
  assert_bitwise_equal(got, step_time.layered_split(grads))


def test_layerwise_step_is_tacos_update_on_the_given_gradient(tiny):
  params, grads = tiny
  split = step_time.layered_split(params)
  tx = taco_optax.taco(1e-2)
  state = tx.init(split)
  step = jax.jit(taco_optax.layerwise.train_step(
      step_time.given_gradient_loss(), tx))
  got_params, got_state, _ = step(split, state,
                                  step_time.given_batch(grads))

  @jax.jit
  def plain(params, state, grads):  # compiled too: the same fusions
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  assert_bitwise_equal((got_params, got_state),
                       plain(split, state, step_time.layered_split(grads)))
  # Every matrix moved: the step is not of untouched weights.
  for moved, before in zip(jax.tree.leaves(got_params),
                           jax.tree.leaves(split)):
    assert moved.ndim < 2 or not (moved == before).all()
