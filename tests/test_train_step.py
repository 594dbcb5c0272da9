"""The layer-wise TACO step equals the plain optax path and saves memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax._src.kernels import cpu_kernel as _cpu_kernel
from taco_optax._src.layerwise import backward as _backward
from taco_optax._src.layerwise import outer as _outer_step
from taco_optax._src.layerwise import winners as _winners
from taco_optax._src.layerwise.leaves import name_of
from taco_optax._src.routing.dimension_numbers import TacoDimensionNumbers
from taco_optax._src.routing.dimension_numbers import leaf_dimension_numbers
from taco_optax._src.routing.dimension_numbers import matrix_layout
from tests.support import layerwise_case
from tests.support import tiers
from tests.support import toy_lm
from tests.support.bitwise import assert_bitwise_equal

LayeredLoss = taco_optax.layerwise.LayeredLoss
layerwise_train_step = layerwise_case.train


def _run_both(scan_layers, dtype, learning_rate, steps=3, **kwargs):
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head,
                     scan_layers=scan_layers)
  train = layerwise_train_step(loss, learning_rate,
                               weight_dimension_numbers=toy_lm.matrix_dims,
                               **kwargs)
  params = toy_lm.params(scan_layers, dtype)
  state = train.optimizer.init(params)
  plain = jax.jit(toy_lm.plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  plain_params, plain_state = params, state
  fused_params, fused_state = params, state
  for step in range(steps):
    plain_params, plain_state, plain_loss = plain(plain_params, plain_state,
                                                  toy_lm.tokens(step))
    fused_params, fused_state, fused_loss = fused(fused_params, fused_state,
                                                  toy_lm.tokens(step))
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


@pytest.mark.parametrize('rounding', ['stochastic', 'nearest'])
@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
def test_equals_plain_optax_path_bf16_with_schedule(scan_layers, rounding):
  schedule = optax.linear_schedule(2e-2, 1e-2, 5)
  (plain_params, plain_state), (fused_params, fused_state), start = _run_both(
      scan_layers, jnp.bfloat16, learning_rate=schedule, update_topk=2,
      rounding=rounding)
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
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head, scan_layers=True)
  params = toy_lm.params(True, jnp.float32)
  dims = toy_lm.matrix_dims(params)
  dims[1]['scale'] = TacoDimensionNumbers(0, 1)
  train = layerwise_train_step(loss, 1e-2, weight_dimension_numbers=dims)
  state = train.optimizer.init(params)
  with pytest.raises(ValueError, match='leading .layer. axis'):
    jax.jit(train.step)(params, state, toy_lm.tokens(0))


def test_loss_call_matches_manual_composition():
  params = toy_lm.params(False, jnp.float32)
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head,
                     scan_layers=False, remat=False)
  hidden = toy_lm.embed(params[0], toy_lm.tokens(0))
  for p in params[1]:
    hidden = toy_lm.layer(p, hidden, toy_lm.tokens(0))
  np.testing.assert_allclose(loss(params, toy_lm.tokens(0)),
                             toy_lm.head(params[0], hidden, toy_lm.tokens(0)),
                             rtol=1e-6)


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


@pytest.mark.parametrize('scan_layers', tiers.first_fast(
    [True, False], jax_versions=[False]))
def test_layerwise_step_peak_memory_is_near_forward(scan_layers):
  """Compile-time peak: weights + a layer's gradients, not all gradients."""
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head,
                     scan_layers=scan_layers)
  train = layerwise_train_step(loss, 1e-3,
                               weight_dimension_numbers=toy_lm.matrix_dims)
  params = _big_params(scan_layers)
  state = train.optimizer.init(params)
  tokens = jnp.zeros((2, 16), jnp.int32) + jnp.arange(16) % 64
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  forward = toy_lm.peak_bytes(loss, params, tokens)
  fused = toy_lm.peak_bytes(train.step, params, state, tokens, donate=(0, 1))
  plain = toy_lm.peak_bytes(toy_lm.plain_step(loss, train.optimizer), params,
                            state, tokens, donate=(0, 1))
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


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('scan_layers', [False, True])
@pytest.mark.parametrize('implementation', ['auto', 'reference'])
def test_unrolled_weights_are_written_by_the_cpu_kernel(
    scan_layers, implementation, dtype):
  """One custom call per unrolled matrix instead of a scatter (for bfloat16,
  and its stochastic rounding) XLA:CPU would compile for each; a stacked
  leaf's slice and implementation='reference' keep the scatter (and the bits
  are the same either way: the equality tests above run both)."""
  if not _cpu_kernel.availability().ok:
    pytest.skip(_cpu_kernel.availability().reason)
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head,
                     scan_layers=scan_layers)
  train = layerwise_train_step(loss, 1e-3, implementation=implementation,
                               weight_dimension_numbers=toy_lm.matrix_dims)
  params = jax.tree.map(lambda x: x.astype(dtype),
                        _big_params(scan_layers, width=32, layers=3))
  tokens = jnp.zeros((2, 16), jnp.int32) + jnp.arange(16) % 64
  hlo = jax.jit(train.step, donate_argnums=(0, 1)).lower(
      params, train.optimizer.init(params), tokens).as_text()
  writes = hlo.count(_cpu_kernel.WRITE_TARGET_NAME if dtype == 'float32'
                     else _cpu_kernel.WRITE16_TARGET_NAME)
  # The embedding (a whole leaf either way), and two matrices per unrolled
  # layer.
  expected = 0 if implementation == 'reference' else (
      1 if scan_layers else 1 + 2 * 3)
  assert writes == expected, writes


def _transposed_embedding_dims(params):
  """Embedding with the vocabulary as rows (m), as the example model does."""
  outer_dims, layer_dims = toy_lm.matrix_dims(params)
  outer_dims = dict(outer_dims, embedding=TacoDimensionNumbers(1, 0))
  return outer_dims, layer_dims


@pytest.mark.parametrize('dims',
                         [toy_lm.matrix_dims, _transposed_embedding_dims])
def test_column_chunked_update_equals_plain_optax_path(dims):
  # Force every matrix through the column-block scan (2-, 4- or 8-column
  # blocks here); non-finite handling stays per leaf.
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head,
                     scan_layers=False)
  train = layerwise_train_step(loss, 1e-2, mu=0.9, k=3,
                               weight_dimension_numbers=dims,
                               update_topk=2, adam_learning_rate=1e-3,
                               column_block_elements=48)
  params = toy_lm.params(False, jnp.float32)
  for layout in [matrix_layout(x.shape, d) for x, d in zip(
      jax.tree.leaves(params), leaf_dimension_numbers(dims, params)) if d]:
    assert _winners.column_chunk(layout, 48) is not None, layout
  plain = jax.jit(toy_lm.plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  expected, got = (params, train.optimizer.init(params)), None
  got = expected
  for step in range(3):
    expected = plain(*expected[:2], toy_lm.tokens(step))
    got = fused(*got[:2], toy_lm.tokens(step))
  # Same winners and history; a moved weight may differ in its last bit,
  # since XLA's fusion decides whether ``p + (-lr) * s`` is one fused
  # multiply-add (observed: 3 of 384 embedding entries, 1 ulp).
  toy_lm.assert_same_step(got, expected, exact_params=False)


@pytest.mark.parametrize('scan_layers', [True, False])
def test_untied_head_is_updated_before_the_layers_and_equals_plain(
    scan_layers):
  params = toy_lm.untied_params(scan_layers)
  outer = params[0]
  embed_reads = _outer_step.read_keys(
      lambda o: toy_lm.embed(o, toy_lm.tokens(0)), outer)
  # The embedding reads its table only, not final_scale or w_head.
  assert sorted(map(name_of, embed_reads)) == ['outer/embedding']
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.untied_head,
                     scan_layers=scan_layers)
  train = layerwise_train_step(loss, 1e-2, mu=0.9, k=4,
                               weight_dimension_numbers=toy_lm.matrix_dims)
  plain = jax.jit(toy_lm.plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  expected = got = (params, train.optimizer.init(params))
  for step in range(3):
    expected = plain(*expected[:2], toy_lm.tokens(step))
    got = fused(*got[:2], toy_lm.tokens(step))
  toy_lm.assert_same_step(got, expected)
  assert not np.array_equal(got[0][0]['w_head'], outer['w_head'])


def test_a_misplaced_layer_leaf_is_caught_by_name(monkeypatch):
  # Plant the off-by-one that leaves keyed by path exist to prevent: each
  # layer's gradients updated with (and returned under) the next layer's
  # records. Every layer has the same shapes, so only the names tell.
  real = _backward.layer_leaves
  monkeypatch.setattr(_backward, 'layer_leaves', lambda step, layers, l: real(
      step, layers, min(l + 1, len(layers) - 1)))
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head,
                     scan_layers=False)
  train = layerwise_train_step(loss, 1e-2, k=3,
                               weight_dimension_numbers=toy_lm.matrix_dims)
  params = toy_lm.params(False, jnp.float32)
  with pytest.raises(ValueError, match=r'two results for layers/\d+/'):
    jax.eval_shape(train.step, params, train.optimizer.init(params),
                   toy_lm.tokens(0))


def test_a_lost_outer_update_is_caught_by_name(monkeypatch):
  # Plant a dropped update: the untied head's early update never returned.
  monkeypatch.setattr(
      _outer_step, 'update_early',
      lambda step, outer, early, grad_of, d_hidden: ({}, d_hidden))
  outer, layers = toy_lm.params(True, jnp.float32)
  params = (dict(outer, w_head=jnp.ones((toy_lm.WIDTH, toy_lm.VOCAB)) / 4),
            layers)
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.untied_head,
                     scan_layers=True)
  train = layerwise_train_step(loss, 1e-2, k=3,
                               weight_dimension_numbers=toy_lm.matrix_dims)
  with pytest.raises(ValueError,
                     match='outer/w_head: a TACO leaf was not updated'):
    jax.eval_shape(train.step, params, train.optimizer.init(params),
                   toy_lm.tokens(0))


def test_unrolled_layers_of_one_structure_are_traced_once():
  """Each unrolled layer's forward and backward are nested jits: the layer
  function is traced a fixed number of times however many layers there are
  (once per jit: the forward, the backward's recomputation), not once per
  layer, which was most of the step's tracing on 30 layers."""
  traced = []

  def layer(p, h, tokens):
    traced.append(None)
    return toy_lm.layer(p, h, tokens)

  def count(layers):
    loss = LayeredLoss(toy_lm.embed, layer, toy_lm.head, scan_layers=False)
    train = layerwise_train_step(loss, 1e-3,
                                 weight_dimension_numbers=toy_lm.matrix_dims)
    params = _big_params(False, width=16, layers=layers)
    tokens = jnp.zeros((2, 8), jnp.int32) + jnp.arange(8) % 64
    traced.clear()
    jax.jit(train.step).trace(params, train.optimizer.init(params), tokens)
    return len(traced)

  assert count(2) == count(6) == 2
