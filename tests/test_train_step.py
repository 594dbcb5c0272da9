"""The layerwise TACO train step equals the plain optax path and saves memory."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax._src.transform import parts as _alias
from taco_optax._src.layerwise import winners as _winners
from taco_optax._src.layerwise import backward as _backward
from taco_optax._src.layerwise import outer as _outer_step
from taco_optax._src.layerwise.leaves import name_of
from taco_optax._src.transform.dimension_numbers import leaf_dimension_numbers
from taco_optax._src.transform.dimension_numbers import matrix_layout
from taco_optax._src.transform.dimension_numbers import TacoDimensionNumbers
from tests.support.bitwise import assert_bitwise_equal
from tests.support import layerwise_case
from tests.support import tiers

LayeredLoss = taco_optax.layerwise.LayeredLoss
layerwise_train_step = layerwise_case.train

WIDTH, VOCAB, LAYERS = 16, 24, 3


def _embed(outer, tokens):
  return outer['embedding'][tokens]


def _layer(p, hidden, tokens):
  del tokens
  normed = hidden * p['scale']
  return hidden + jnp.tanh(normed @ p['w_up']) @ p['w_down']


def _head(outer, hidden, tokens):
  logits = (hidden * outer['final_scale']) @ outer['embedding'].T
  logits = logits.astype(jnp.float32)
  targets = jnp.roll(tokens, -1, axis=-1)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _params(scan_layers, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 2 * LAYERS + 1)
  init = lambda key, shape: (jax.random.normal(key, shape) /
                             np.sqrt(shape[-2])).astype(dtype)
  outer = {'embedding': init(keys[0], (VOCAB, WIDTH)),
           'final_scale': jnp.ones((WIDTH,), dtype)}
  layers = [{'w_up': init(keys[1 + 2 * l], (WIDTH, 2 * WIDTH)),
             'w_down': init(keys[2 + 2 * l], (2 * WIDTH, WIDTH)),
             'scale': jnp.ones((WIDTH,), dtype)} for l in range(LAYERS)]
  if scan_layers:
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return outer, layers


def _matrix_dims(params):
  """Matrices are rank 2, plus a leading layer axis when layers are stacked."""
  outer, layers = params
  stacked = not isinstance(layers, list)
  matrix = lambda rank: lambda x: (
      TacoDimensionNumbers(rank - 2, rank - 1) if x.ndim == rank else None)
  return (jax.tree.map(matrix(2), outer),
          jax.tree.map(matrix(3 if stacked else 2), layers))


def _tokens(step):
  return jax.random.randint(jax.random.key(100 + step), (4, 8), 0, VOCAB)


def _plain_step(loss, tx):
  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def _run_both(scan_layers, dtype, learning_rate, steps=3, **kwargs):
  loss = LayeredLoss(_embed, _layer, _head, scan_layers=scan_layers)
  train = layerwise_train_step(loss, learning_rate,
                               weight_dimension_numbers=_matrix_dims,
                               **kwargs)
  params = _params(scan_layers, dtype)
  state = train.optimizer.init(params)
  plain = jax.jit(_plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  plain_params, plain_state = params, state
  fused_params, fused_state = params, state
  for step in range(steps):
    plain_params, plain_state, plain_loss = plain(plain_params, plain_state,
                                                  _tokens(step))
    fused_params, fused_state, fused_loss = fused(fused_params, fused_state,
                                                  _tokens(step))
    np.testing.assert_allclose(fused_loss, plain_loss, rtol=1e-5)
  return (plain_params, plain_state), (fused_params, fused_state), params


def _adam_moments(state):
  """The Adam moments in a state (``mu``/``nu`` paths), by path."""
  return {jax.tree_util.keystr(path): leaf for path, leaf
          in jax.tree_util.tree_leaves_with_path(state)
          if any(getattr(key, 'name', None) in ('mu', 'nu') for key in path)}


@pytest.mark.parametrize('scan_layers', [True, False])
def test_equals_plain_optax_path_f32(scan_layers):
  (plain_params, plain_state), (fused_params, fused_state), start = _run_both(
      scan_layers, jnp.float32, learning_rate=1e-2, mu=0.9, k=4,
      adam_learning_rate=1e-3)
  moments = _adam_moments(plain_state)
  assert moments  # the norm scales' Adam state is in the comparison
  if scan_layers:
    # Identical winners, identical arithmetic: params and the whole state
    # (float8 history, indices, exponents, Adam moments, counts) bit for bit.
    assert_bitwise_equal((fused_params, fused_state),
                         (plain_params, plain_state))
  else:
    # Unrolled, XLA:CPU (jax >= 0.11) orders the norm scales' gradient sums
    # (over batch x tokens) differently in one layer's backward program than
    # in jax.grad's: float order, not a change of what is computed (in
    # float64 the same moments differ by 3.6e-14 relative, in float32 by
    # 7.3e-6). Everything else is bit for bit; the moments are within
    # 2**-16 of each leaf's largest entry, where a missing or misplaced
    # gradient term would differ by O(1).
    blank = lambda state: jax.tree_util.tree_map_with_path(
        lambda path, x: (jnp.zeros_like(x) if jax.tree_util.keystr(path)
                         in moments else x), state)
    assert_bitwise_equal((fused_params, blank(fused_state)),
                         (plain_params, blank(plain_state)))
    fused_moments = _adam_moments(fused_state)
    for path, plain in moments.items():
      bound = 2.0**-16 * float(jnp.max(jnp.abs(plain)))
      np.testing.assert_allclose(fused_moments[path], plain, rtol=0,
                                 atol=bound, err_msg=path)
  # Every TACO matrix moved, so the comparison is not of untouched weights.
  matrices = lambda params: [x for x in jax.tree.leaves(params) if x.ndim >= 2]
  for moved, before in zip(matrices(fused_params), matrices(start)):
    assert not np.array_equal(moved, before)


@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
def test_equals_plain_optax_path_bf16_with_schedule(scan_layers):
  schedule = optax.linear_schedule(2e-2, 1e-2, 5)
  (plain_params, plain_state), (fused_params, fused_state), start = _run_both(
      scan_layers, jnp.bfloat16, learning_rate=schedule, update_topk=2)
  for fused, plain in zip(jax.tree.leaves(fused_params),
                          jax.tree.leaves(plain_params)):
    assert fused.dtype == plain.dtype == jnp.bfloat16
  assert_bitwise_equal((fused_params, fused_state),
                       (plain_params, plain_state))
  for moved, before in zip(jax.tree.leaves(fused_params),
                           jax.tree.leaves(start)):
    assert not np.array_equal(moved, before)


def test_stacked_leaf_needs_its_layer_axis_as_a_batch_axis():
  # Dimension numbers that make the stacked (L, width) norm scales a matrix
  # whose rows are layers: not expressible layer by layer. (The default
  # sends a leaf named 'scale' to Adam, so they are given here.)
  loss = LayeredLoss(_embed, _layer, _head, scan_layers=True)
  params = _params(True, jnp.float32)
  dims = _matrix_dims(params)
  dims[1]['scale'] = TacoDimensionNumbers(0, 1)
  train = layerwise_train_step(loss, 1e-2, weight_dimension_numbers=dims)
  state = train.optimizer.init(params)
  with pytest.raises(ValueError, match='leading .layer. axis'):
    jax.jit(train.step)(params, state, _tokens(0))


def test_loss_call_matches_manual_composition():
  params = _params(False, jnp.float32)
  loss = LayeredLoss(_embed, _layer, _head, scan_layers=False, remat=False)
  hidden = _embed(params[0], _tokens(0))
  for p in params[1]:
    hidden = _layer(p, hidden, _tokens(0))
  np.testing.assert_allclose(loss(params, _tokens(0)),
                             _head(params[0], hidden, _tokens(0)), rtol=1e-6)


def _peak_bytes(fn, *args, donate=()):
  compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  stats = compiled.memory_analysis()
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def _big_params(scan_layers, width=256, layers=8):
  keys = jax.random.split(jax.random.key(0), 2 * layers + 1)
  init = lambda key, shape: jax.random.normal(key, shape) / np.sqrt(shape[0])
  outer = {'embedding': init(keys[0], (64, width)),
           'final_scale': jnp.ones((width,))}
  stack = [{'w_up': init(keys[1 + 2 * l], (width, 2 * width)),
            'w_down': init(keys[2 + 2 * l], (2 * width, width)),
            'scale': jnp.ones((width,))} for l in range(layers)]
  if scan_layers:
    stack = jax.tree.map(lambda *xs: jnp.stack(xs), *stack)
  return outer, stack


@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
def test_layerwise_step_peak_memory_is_near_forward(scan_layers):
  """Compile-time peak: weights + a layer's gradients, not all gradients."""
  loss = LayeredLoss(_embed, _layer, _head, scan_layers=scan_layers)
  train = layerwise_train_step(loss, 1e-3,
                               weight_dimension_numbers=_matrix_dims)
  params = _big_params(scan_layers)
  state = train.optimizer.init(params)
  tokens = jnp.zeros((2, 16), jnp.int32) + jnp.arange(16) % 64
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  forward = _peak_bytes(loss, params, tokens)
  fused = _peak_bytes(train.step, params, state, tokens, donate=(0, 1))
  plain = _peak_bytes(_plain_step(loss, train.optimizer), params, state,
                      tokens, donate=(0, 1))
  fused_overhead = (fused - forward - state_bytes) / param_bytes
  plain_overhead = (plain - forward - state_bytes) / param_bytes
  # Eight layers of 2 x 512 KiB matrices: one layer's gradient is 1/8 of the
  # weights; the column step holds up to four gradient-sized buffers.
  print(f'overhead layerwise={fused_overhead:.3f} plain={plain_overhead:.3f}')
  if scan_layers:
    # Measured: 0.20 layerwise, 1.07 plain with the fused CPU kernel (0.27
    # and 1.89 with the reference's top-k transients). The plain path keeps
    # every gradient of the scan alive (> 1x the weights); the layerwise
    # step about one layer's.
    assert fused_overhead < 0.35, fused_overhead
    assert plain_overhead > 1.0, plain_overhead
    assert plain_overhead > fused_overhead + 0.8, (plain_overhead,
                                                   fused_overhead)
  else:
    # Unrolled, XLA frees most gradients early by itself; without
    # _data_dependency the layer-wise step was at 1.46. Measured 0.195
    # layerwise on jax 0.10.2 and 0.12 alike; plain 0.257 on jax 0.10.2 and
    # 0.168 on jax 0.12, whose XLA:CPU frees the plain path's gradients
    # earlier still. The step stays within 0.05 x the weights of it.
    assert fused_overhead < 0.25, fused_overhead
    assert fused_overhead < plain_overhead + 0.05, (plain_overhead,
                                                    fused_overhead)


def _assert_same_step(got, expected, exact_params=True):
  """TACO history and learning-rate state bit for bit, Adam moments close.

  The vectors' gradients (hence Adam's moments) come from backward passes
  that sum in another order; TACO's winners and stored history must not
  differ at all. Without ``exact_params`` a moved weight may differ by the
  rounding of ``lr * s`` (whether XLA fuses ``p - lr * s`` into one FMA),
  far below the step ``lr * s`` a wrong winner would leave.
  """
  (got_params, got_state), (expected_params, expected_state) = (got[:2],
                                                                expected[:2])
  got_parts = _alias.taco_states(got_state)
  expected_parts = _alias.taco_states(expected_state)
  assert_bitwise_equal(got_parts.direction, expected_parts.direction)
  assert_bitwise_equal(got_parts.learning_rate, expected_parts.learning_rate)
  chex.assert_trees_all_close(got_parts.adam, expected_parts.adam, rtol=1e-5,
                              atol=1e-9)
  if exact_params:
    assert_bitwise_equal(got_params, expected_params)
  else:
    chex.assert_trees_all_close(got_params, expected_params, rtol=1e-6,
                                atol=1e-8)


def _transposed_embedding_dims(params):
  """Embedding with the vocabulary as rows (m), as the example model does."""
  outer_dims, layer_dims = _matrix_dims(params)
  outer_dims = dict(outer_dims, embedding=TacoDimensionNumbers(1, 0))
  return outer_dims, layer_dims


@pytest.mark.parametrize('dims', [_matrix_dims, _transposed_embedding_dims])
def test_column_chunked_update_equals_plain_optax_path(dims):
  # Force every matrix through the column-block scan (2-, 4- or 8-column
  # blocks here); non-finite handling stays per leaf.
  loss = LayeredLoss(_embed, _layer, _head, scan_layers=False)
  train = layerwise_train_step(loss, 1e-2, mu=0.9, k=3,
                               weight_dimension_numbers=dims,
                               update_topk=2, adam_learning_rate=1e-3,
                               column_block_elements=48)
  params = _params(False, jnp.float32)
  for layout in [matrix_layout(x.shape, d) for x, d in zip(
      jax.tree.leaves(params), leaf_dimension_numbers(dims, params)) if d]:
    assert _winners.column_chunk(layout, 48) is not None, layout
  plain = jax.jit(_plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  expected, got = (params, train.optimizer.init(params)), None
  got = expected
  for step in range(3):
    expected = plain(*expected[:2], _tokens(step))
    got = fused(*got[:2], _tokens(step))
  # Same winners and history; a moved weight may differ in its last bit,
  # since XLA's fusion decides whether ``p + (-lr) * s`` is one fused
  # multiply-add (observed: 3 of 384 embedding entries, 1 ulp).
  _assert_same_step(got, expected, exact_params=False)


def _untied_head(outer, hidden, tokens):
  logits = (hidden * outer['final_scale']) @ outer['w_head']
  targets = jnp.roll(tokens, -1, axis=-1)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@pytest.mark.parametrize('scan_layers', [True, False])
def test_untied_head_is_updated_before_the_layers_and_equals_plain(
    scan_layers):
  outer, layers = _params(scan_layers, jnp.float32)
  outer = dict(outer, w_head=jax.random.normal(jax.random.key(7),
                                               (WIDTH, VOCAB)) / 4)
  params = (outer, layers)
  embed_reads = _outer_step.read_keys(lambda o: _embed(o, _tokens(0)),
                                      outer)
  # The embedding reads its table only, not final_scale or w_head.
  assert sorted(map(name_of, embed_reads)) == ['outer/embedding']
  loss = LayeredLoss(_embed, _layer, _untied_head, scan_layers=scan_layers)
  train = layerwise_train_step(loss, 1e-2, mu=0.9, k=4,
                               weight_dimension_numbers=_matrix_dims)
  plain = jax.jit(_plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  expected = got = (params, train.optimizer.init(params))
  for step in range(3):
    expected = plain(*expected[:2], _tokens(step))
    got = fused(*got[:2], _tokens(step))
  _assert_same_step(got, expected)
  assert not np.array_equal(got[0][0]['w_head'], outer['w_head'])


def test_a_misplaced_layer_leaf_is_caught_by_name(monkeypatch):
  # Plant the off-by-one that leaves keyed by path exist to prevent: each
  # layer's gradients updated with (and returned under) the next layer's
  # records. Every layer has the same shapes, so only the names tell.
  real = _backward.layer_leaves
  monkeypatch.setattr(_backward, 'layer_leaves', lambda step, layers, l: real(
      step, layers, min(l + 1, len(layers) - 1)))
  loss = LayeredLoss(_embed, _layer, _head, scan_layers=False)
  train = layerwise_train_step(loss, 1e-2, k=3,
                               weight_dimension_numbers=_matrix_dims)
  params = _params(False, jnp.float32)
  with pytest.raises(ValueError, match=r'two results for layers/\d+/'):
    jax.eval_shape(train.step, params, train.optimizer.init(params),
                   _tokens(0))


def test_a_lost_outer_update_is_caught_by_name(monkeypatch):
  # Plant a dropped update: the untied head's early update never returned.
  monkeypatch.setattr(
      _outer_step, 'update_early',
      lambda step, outer, early, grad_of, d_hidden: ({}, d_hidden))
  outer, layers = _params(True, jnp.float32)
  params = (dict(outer, w_head=jnp.ones((WIDTH, VOCAB)) / 4), layers)
  loss = LayeredLoss(_embed, _layer, _untied_head, scan_layers=True)
  train = layerwise_train_step(loss, 1e-2, k=3,
                               weight_dimension_numbers=_matrix_dims)
  with pytest.raises(ValueError,
                     match='outer/w_head: a TACO leaf was not updated'):
    jax.eval_shape(train.step, params, train.optimizer.init(params),
                   _tokens(0))
