"""taco()'s default routing guesses less: names, frameworks, bad input.

Without dimension numbers every rank-2 leaf is a Flax ``(in, out)`` kernel,
except those named like a bias, a scale or a norm (Adam, with the reason in
the routing report); a tree of Equinox modules is refused; an embedding-like
name and rank >= 3 leaves are warned about, with the helper of the tree's
framework. And two bad inputs get an error naming the leaf: a negative
update scale, a gradient of another shape than its parameter.
"""

import copy
import logging
import pickle

import equinox as eqx
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taco_optax
from taco_optax._src import routing
from tests.support import routing_checks

DN = taco_optax.TacoDimensionNumbers
LR = 1e-2


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records
          if r.name == 'taco_optax' and r.levelno == logging.WARNING]


def _grads(params, seed=0):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype)
                            for k, x in zip(keys, leaves)])


def _update(tx, params):
  state = tx.init(params)
  updates, _ = tx.update(_grads(params), state, params)
  return updates


def test_rank2_leaves_named_like_biases_scales_and_norms_go_to_adam():
  params = {'attn': {'q_bias': jnp.ones((4, 8)), 'kernel': jnp.ones((16, 8))},
            'layers': {'input_layernorm': {'scale': jnp.ones((3, 16))},
                       'ln_1': {'w': jnp.ones((3, 16))},
                       'bias': jnp.ones((3, 8))},
            'lora_b': jnp.ones((2, 8))}
  updates = _update(taco_optax.taco(LR), params)
  routing_checks.assert_one_per_input(updates['attn']['kernel'], 0, 1, LR,
                                      name='attn/kernel')
  routing_checks.assert_one_per_input(updates['lora_b'], 0, 1, LR,
                                      name='lora_b')
  for name, update in (('q_bias', updates['attn']['q_bias']),
                       ('layernorm', updates['layers']['input_layernorm']
                        ['scale']),
                       ('ln_1', updates['layers']['ln_1']['w']),
                       ('stacked bias', updates['layers']['bias'])):
    routing_checks.assert_adam_dense(update, name=name)
  report = taco_optax.routing_report(taco_optax.taco(LR), params)
  why = {row.path: row.why for row in report.rows}
  assert why['attn/q_bias'] == (
      'default: rank 2, but named like a bias, scale or norm')
  assert why['attn/kernel'] == ('reduction (0,), output (1,); default: rank '
                                '2, a Flax (in, out) kernel')


def test_a_tree_of_equinox_modules_is_refused_by_the_default():
  model = eqx.nn.Linear(64, 32, key=jax.random.key(0))
  params = eqx.filter(model, eqx.is_inexact_array)
  with pytest.raises(ValueError, match=(
      r'Equinox modules, whose Linear weights are \(out, in\).*'
      r'taco_optax\.equinox\.dimension_numbers\(model\)')):
    taco_optax.taco(LR).init(params)


def test_a_callable_tree_of_dimension_numbers_is_taken_as_a_tree():
  # The tree made with jax.tree.map over an eqx model is an eqx.Module,
  # hence callable: taco used to call it as a function of the params.
  model = eqx.nn.Linear(64, 32, key=jax.random.key(0))
  params = eqx.filter(model, eqx.is_inexact_array)
  dims = jax.tree.map(lambda x: DN(1, 0) if x.ndim == 2 else None, params)
  assert callable(dims)
  scales = jax.tree.map(lambda x: 0.25 if x.ndim == 2 else None, params)
  tx = taco_optax.taco(LR, weight_dimension_numbers=dims, update_scale=scales)
  updates = _update(tx, params)
  # (out, in) = (32, 64): one nonzero per input feature, 64 of them.
  routing_checks.assert_one_per_input(updates.weight, 1, 0, LR, scale=0.25,
                                      name='weight')
  routing_checks.assert_adam_dense(updates.bias, name='bias')


def test_a_function_is_still_called_with_the_params():
  params = {'w': jnp.ones((8, 4))}
  tx = taco_optax.taco(LR, weight_dimension_numbers=lambda p: {'w': DN(1, 0)})
  routing_checks.assert_one_per_input(_update(tx, params)['w'], 1, 0, LR)


def test_an_embedding_like_name_is_warned_about_with_the_convention(caplog):
  # (A PyTorch name, tok_embeddings/weight, is refused: test_pytorch_layout.)
  params = {'tok_embeddings': {'embedding': jnp.ones((50, 8))},
            'out': {'kernel': jnp.ones((8, 50))}}
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    taco_optax.taco(LR).init(params)
  (message,) = _warnings(caplog)
  assert 'tok_embeddings/embedding (50, 8) look like embedding tables' in (
      message)
  assert ('TacoDimensionNumbers(reduction_axis=1, output_axis=0) and '
          'update_scale 1') in message
  # The routing itself is unchanged: the Flax layout, scale m / n.
  routing_checks.assert_one_per_input(
      _update(taco_optax.taco(LR), params)['tok_embeddings']['embedding'], 0, 1,
      LR, scale=8 / 50)


@pytest.mark.parametrize('framework, helper', [
    ('nnx', 'taco_optax.nnx.dimension_numbers(model)'),
    ('linen', 'taco_optax.linen.dimension_numbers(module, *init_args)'),
    ('other', 'taco_optax.trace_dimension_numbers(loss_fn, params, batch)'),
])
def test_the_rank3_warning_names_the_helper_of_the_framework(
    caplog, framework, helper):
  if framework == 'nnx':
    params = nnx.state(nnx.Einsum('BTD,DNH->BTNH', (8, 2, 4),
                                  rngs=nnx.Rngs(0)), nnx.Param)
  elif framework == 'linen':
    params = {'query': {'kernel': jnp.ones((8, 2, 4))}}
  else:
    params = {'query': {'w': jnp.ones((8, 2, 4))}}
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    taco_optax.taco(LR).init(params)
  (message,) = _warnings(caplog)
  assert 'rank >= 3 go to Adam' in message and helper in message


def test_negative_or_non_finite_update_scales_are_refused_by_name():
  params = {'layer': {'w': jnp.ones((8, 4))}}
  for bad in (-1.0, float('nan'), float('inf')):
    with pytest.raises(ValueError, match=(
        r"update_scale=.* for the TACO leaf 'layer/w': an update scale must "
        r'be finite and >= 0 \(a negative one turns every step into ascent')):
      taco_optax.taco(LR, update_scale={'layer': {'w': bad}}).init(params)
  # 0 is allowed: the matrix keeps its weights.
  updates = _update(taco_optax.taco(LR, update_scale=0.0), params)
  np.testing.assert_array_equal(updates['layer']['w'], 0.0)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_a_gradient_of_another_shape_is_refused_by_name(dtype):
  params = {'layer': {'w': jnp.ones((8, 4), dtype), 'b': jnp.ones((4,), dtype)}}
  tx = taco_optax.taco(LR)
  state = tx.init(params)
  wrong = {'layer': {'w': jnp.ones((4, 8), dtype), 'b': jnp.ones((4,), dtype)}}
  with pytest.raises(ValueError, match=(
      r"The gradient of 'layer/w' has shape \(4, 8\), its parameter "
      r'\(8, 4\)')):
    tx.update(wrong, state, params)
  if dtype == jnp.float32:  # 16-bit leaves need params (rounding)
    with pytest.raises(ValueError, match=(
        r"The gradient of the TACO leaf 'layer/w' has shape \(4, 8\).*"
        r'initialised for 1 matrices of 8 columns')):
      tx.update(wrong, state)
  wrong_bias = {'layer': {'w': jnp.ones((8, 4), dtype),
                          'b': jnp.ones((8,), dtype)}}
  with pytest.raises(ValueError, match="The gradient of 'layer/b' has shape"):
    tx.update(wrong_bias, state, params)


def test_to_adam_entries_mean_none_and_carry_their_reason():
  entry = routing.ToAdam('eqx.nn.Conv2d: no TACO rule')
  # Falsy and read as None, but not equal to it (no object equals None).
  assert not entry and entry != None  # noqa: E711
  assert routing.source_of(entry) == 'eqx.nn.Conv2d: no TACO rule'
  chosen = routing.decided(DN(1, 0), 'eqx.nn.Linear (out, in)')
  assert chosen == DN(1, 0) and repr(chosen) == repr(DN(1, 0))
  assert routing.source_of(chosen) == 'eqx.nn.Linear (out, in)'
  # The source is part of the entry: tree functions, copies, pickles and
  # _replace keep it.
  for kept in (jax.tree.map(lambda x: x, {'w': chosen})['w'],
               copy.deepcopy(chosen), pickle.loads(pickle.dumps(chosen)),
               chosen._replace(output_axis=0)):
    assert routing.source_of(kept) == 'eqx.nn.Linear (out, in)'
  assert chosen._replace(output_axis=0) == DN(1, 0)._replace(output_axis=0)
  params = {'conv': jnp.ones((3, 3, 4, 8)), 'w': jnp.ones((8, 4))}
  tx = taco_optax.taco(LR, weight_dimension_numbers={'conv': entry,
                                                     'w': chosen})
  updates = _update(tx, params)
  routing_checks.assert_adam_dense(updates['conv'], name='conv')
  routing_checks.assert_one_per_input(updates['w'], 1, 0, LR, name='w')
  why = {r.path: r.why for r in taco_optax.routing_report(tx, params).rows}
  assert why == {'conv': 'eqx.nn.Conv2d: no TACO rule',
                 'w': 'reduction (1,), output (0,); eqx.nn.Linear (out, in)'}
