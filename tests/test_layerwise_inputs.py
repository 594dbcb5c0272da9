"""The hand-split layer-wise step names the argument a user got wrong.

Each mistake a user makes writing the ``(outer, layers)`` glue by hand (the
whole model's routing tree, an ``nnx.State`` of Variables, a ``[d, vocab]``
head) gets one error naming the argument, or just works where the intent is
clear (a ``[d, vocab]`` head with ``table_axis=0``).
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax import layerwise
from tests.support.bitwise import assert_bitwise_equal

VOCAB, WIDTH = 24, 8


def _params(seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) / 3,
                                      jnp.float32)
  outer = {'embed': normal(VOCAB, WIDTH), 'head': normal(WIDTH, VOCAB)}
  layers = [{'w': normal(WIDTH, WIDTH)} for _ in range(2)]
  return outer, layers


def _cross_entropy(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, jnp.roll(tokens, -1, axis=-1)).mean()


def _loss(head):
  return layerwise.LayeredLoss(
      embed=lambda outer, tokens: outer['embed'][tokens],
      layer=lambda p, h, tokens: h + jnp.tanh(h @ p['w']),
      head=head, scan_layers=False)


def _projection(**kwargs):
  return layerwise.TableProjection(
      table=('head',), features=lambda outer, hidden, tokens: hidden,
      loss=_cross_entropy, **kwargs)


TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (3, 6)),
                     jnp.int32)


def _dims(params):
  return jax.tree.map(lambda x: taco_optax.TacoDimensionNumbers(), params)


def test_a_d_by_vocab_head_with_table_axis_0_needs_no_project():
  # The default projection contracts along table_axis: features @ kernel.
  loss = _loss(_projection(table_axis=0))
  tx = taco_optax.taco(1e-2, weight_dimension_numbers=_dims)
  params = _params()
  state = tx.init(params)
  fused = jax.jit(layerwise.train_step(loss, tx))(params, state, TOKENS)

  @jax.jit
  def plain(params, state):
    value, grads = jax.value_and_grad(loss)(params, TOKENS)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  expected = plain(params, state)
  assert_bitwise_equal(fused[:2], expected[:2])
  np.testing.assert_allclose(fused[2], expected[2], rtol=1e-6)
  # ... and it is the loss written by hand.
  hand = _cross_entropy(_forward(params) @ params[0]['head'], TOKENS)
  np.testing.assert_allclose(loss(params, TOKENS), hand, rtol=1e-6)


def _forward(params):
  outer, layers = params
  hidden = outer['embed'][TOKENS]
  for p in layers:
    hidden = hidden + jnp.tanh(hidden @ p['w'])
  return hidden


@pytest.mark.parametrize('table_axis', [1, 0])
def test_a_table_axis_that_is_not_d_is_named(table_axis):
  outer, layers = _params()
  if table_axis == 1:  # a [d, vocab] kernel described as [vocab, d]
    head = _projection()
  else:  # a [vocab, d] table described as [d, vocab]
    outer = {**outer, 'head': outer['head'].T}
    head = _projection(table_axis=0)
  loss = _loss(head)
  tx = taco_optax.taco(1e-2, weight_dimension_numbers=_dims)
  params = (outer, layers)
  with pytest.raises(ValueError, match='table_axis=.*d axis'):
    loss(params, TOKENS)
  with pytest.raises(ValueError, match='table_axis=.*d axis'):
    layerwise.train_step(loss, tx)(params, tx.init(params), TOKENS)


def test_table_axis_other_than_0_or_1_is_refused():
  with pytest.raises(ValueError, match='table_axis'):
    _projection(table_axis=2)


def test_params_that_are_not_the_pair_are_named():
  outer, layers = _params()
  tx = taco_optax.taco(1e-2, weight_dimension_numbers=_dims)
  step = layerwise.train_step(_loss(_projection(table_axis=0)), tx)
  whole = {'outer': outer, 'layers': layers}
  with pytest.raises(ValueError, match=r'pair \(outer, layers\).*dict'):
    step(whole, None, TOKENS)
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *layers)
  with pytest.raises(ValueError, match='scan_layers=False.*list'):
    step((outer, stacked), None, TOKENS)


def test_an_nnx_state_of_variables_is_named():
  model = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
  outer, _ = _params()
  layers = [nnx.state(model)]  # Variables, not arrays
  tx = taco_optax.taco(1e-2)
  step = layerwise.train_step(_loss(_projection(table_axis=0)), tx)
  with pytest.raises(ValueError, match=r'Flax NNX Variables .*\[1\]\[0\].*'
                     r'nnx\.as_pure'):
    step((outer, layers), None, TOKENS)
  # Made pure, the same parameters are taken.
  pure = (outer, [{'w': nnx.as_pure(nnx.state(model))['kernel']}])
  tx = taco_optax.taco(1e-2, weight_dimension_numbers=_dims)
  step = layerwise.train_step(_loss(_projection(table_axis=0)), tx)
  step(pure, tx.init(pure), TOKENS)


def test_the_whole_models_routing_tree_is_named():
  # A routing tree shaped like the whole model, not like (outer, layers).
  model = {'outer': _params()[0], 'layers': _params()[1]}
  tx = taco_optax.taco(1e-2, weight_dimension_numbers=jax.tree.map(
      lambda x: taco_optax.TacoDimensionNumbers(), model))
  with pytest.raises(ValueError, match='weight_dimension_numbers'):
    tx.init(_params())
