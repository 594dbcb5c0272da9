"""Stochastic rounding of 16-bit parameters: unbiased, one ulp, reproducible."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax._src.transform import parts as _alias
from taco_optax._src.transform import rounding as _rounding
from tests.support import layerwise_case
from tests.support import tiers
from tests.support import toy_lm
from tests.support.bitwise import assert_bitwise_equal

DTYPES = [jnp.bfloat16, jnp.float16]


def _ulp_neighbours(x, dtype):
  """The two values of ``dtype`` around each float32 ``x``, as float64."""
  nearest = np.asarray(x.astype(dtype))
  up = np.asarray(jnp.nextafter(nearest, jnp.asarray(np.inf, dtype)))
  down = np.asarray(jnp.nextafter(nearest, jnp.asarray(-np.inf, dtype)))
  x = np.asarray(x, np.float64)
  near = nearest.astype(np.float64)
  low = np.where(near <= x, near, down.astype(np.float64))
  high = np.where(near <= x, up.astype(np.float64), near)
  return low, high


def _draws(target, dtype, count):
  keys = [_rounding.leaf_key(7, jnp.int32(step), 0) for step in range(count)]
  index = _rounding.dense_flat_index(target)
  draw = jax.jit(lambda key: _rounding.round_stochastically(
      target, dtype, _rounding.element_bits(key, index)))
  return np.stack([np.asarray(draw(key)).astype(np.float64) for key in keys])


@pytest.mark.parametrize('dtype', DTYPES)
def test_unbiased_and_within_one_ulp(dtype):
  rng = np.random.default_rng(0)
  weights = rng.normal(0, 0.02, 256).astype(np.float32)
  steps = rng.choice([1e-6, -3e-5, 1e-4, 2.5e-6], 256).astype(np.float32)
  target = jnp.asarray(weights.astype(dtype).astype(np.float32) + steps)
  draws = _draws(target, dtype, 2000)
  low, high = _ulp_neighbours(target, dtype)
  # Every draw is one of the two neighbours of the exact target.
  assert np.all((draws == low) | (draws == high))
  # The mean is the target, within 5 standard errors of a Bernoulli mean.
  chance = (np.asarray(target, np.float64) - low) / (high - low)
  stderr = (high - low) * np.sqrt(chance * (1 - chance) / len(draws))
  error = np.abs(draws.mean(0) - np.asarray(target, np.float64))
  assert np.all(error <= 5 * stderr + 1e-12), np.max(error / (high - low))
  # And it is not rounding to nearest in disguise.
  nearest = np.asarray(target.astype(dtype)).astype(np.float64)
  assert np.mean(draws != nearest) > 0.1


def test_float16_adam_leaves_stay_finite():
  # Adam's second moment of a 1e-3 gradient is 1e-9 after one step: below
  # float16's smallest subnormal, so a float16 Adam divides by zero.
  params = {'scale': jnp.ones((256,), jnp.float16)}
  grads = {'scale': jnp.full((256,), 1e-3, jnp.float16)}
  pure = optax.adam(1e-4)
  broken = optax.apply_updates(params, pure.update(grads, pure.init(params))[0])
  assert not np.all(np.isfinite(np.asarray(broken['scale'])))
  for rounding in ('stochastic', 'nearest'):
    tx = taco_optax.taco(1e-4, rounding=rounding)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)['scale']
    assert new.dtype == jnp.float16
    assert np.all(np.isfinite(np.asarray(new))), rounding


@pytest.mark.parametrize('dtype', DTYPES)
def test_exact_and_non_finite_targets_round_to_nearest(dtype):
  target = jnp.asarray([0.0, -0.0, 1.0, 0.5, jnp.inf, -jnp.inf, jnp.nan],
                       jnp.float32)
  draws = _draws(target, dtype, 20)
  expected = np.asarray(target.astype(dtype)).astype(np.float64)
  np.testing.assert_array_equal(draws, np.broadcast_to(expected, draws.shape))


def test_bits_are_deterministic_and_change_with_step_leaf_and_element():
  index = jnp.arange(4096, dtype=jnp.uint32)
  bits = lambda step, leaf: np.asarray(_rounding.element_bits(
      _rounding.leaf_key(0, jnp.int32(step), leaf), index))
  assert_bitwise_equal(bits(3, 1), bits(3, 1))
  assert np.mean(bits(3, 1) == bits(4, 1)) < 0.01
  assert np.mean(bits(3, 1) == bits(3, 2)) < 0.01
  assert len(np.unique(bits(3, 1))) > 4000
  # Each bit is set about half the time.
  ones = np.unpackbits(bits(0, 0).view(np.uint8)).mean()
  assert 0.48 < ones < 0.52


def _bf16_params(seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  return {'w': (0.02 * jax.random.normal(keys[0], (96, 64))).astype(
      jnp.bfloat16),
          'scale': jnp.ones((64,), jnp.bfloat16)}


def _grads(params, seed):
  return jax.tree.map(lambda p: jax.random.normal(
      jax.random.key(seed), p.shape).astype(p.dtype), params)


def test_apply_updates_lands_on_the_stochastic_target():
  params = _bf16_params()
  tx = taco_optax.taco(3e-5, k=4)
  nearest = taco_optax.taco(3e-5, k=4, rounding='nearest')
  state, near_state = tx.init(params), nearest.init(params)
  grads = _grads(params, 1)
  updates, _ = tx.update(grads, state, params)
  near_updates, _ = nearest.update(grads, near_state, params)
  assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(
      lambda p: p.dtype, params)
  # The same winners; the stochastic update lands on the target rounded up
  # or down from p + u (u: the update that nearest rounding applies).
  w, u = params['w'], near_updates['w']
  moved = np.asarray(u != 0)
  assert np.array_equal(np.asarray(updates['w'] != 0) | moved, moved)
  new = np.asarray(optax.apply_updates(params, updates)['w'], np.float64)
  low, high = _ulp_neighbours(w.astype(jnp.float32) + u.astype(jnp.float32),
                              jnp.bfloat16)
  assert np.all((new == low) | (new == high))
  # At the paper's rate most of these steps are below half an ulp: nearest
  # rounding lands few of them, stochastic rounding about their share.
  landed = lambda new_w: np.mean(np.asarray(new_w != w)[moved])
  near_new = optax.apply_updates(params, near_updates)['w']
  assert landed(near_new) < 0.5
  assert landed(jnp.asarray(new, jnp.bfloat16)) > landed(near_new)


def test_float32_parameters_are_untouched_by_rounding():
  params = jax.tree.map(lambda p: p.astype(jnp.float32), _bf16_params())
  results = []
  for rounding in ('stochastic', 'nearest'):
    tx = taco_optax.taco(1e-3, k=4, rounding=rounding)
    state = tx.init(params)
    p = params
    for seed in range(3):
      updates, state = jax.jit(tx.update)(_grads(p, seed), state, p)
      p = optax.apply_updates(p, updates)
    states = _alias.taco_states(state)
    results.append((p, states.direction, states.learning_rate))
  assert_bitwise_equal(*results)


def test_nearest_is_the_partition_of_optax_pieces():
  # TACO's branch in the 16-bit dtype; Adam's on float32 copies (its
  # moments would underflow in float16), its update cast back.
  params = _bf16_params()
  tx = taco_optax.taco(1e-3, k=4, rounding='nearest')
  reference = optax.partition(
      {'taco': optax.chain(taco_optax.scale_by_taco(k=4),
                           optax.scale_by_learning_rate(1e-3)),
       'adam': optax.chain(_rounding.in_float32(optax.adam(1e-3)),
                           _rounding.rounded_to_params())},
      lambda p: {'w': 'taco', 'scale': 'adam'})
  state, ref_state = tx.init(params), reference.init(params)
  updates, state = tx.update(_grads(params, 0), state, params)
  expected, ref_state = reference.update(_grads(params, 0), ref_state, params)
  assert_bitwise_equal(updates, expected)
  assert_bitwise_equal(jax.tree.leaves(state), jax.tree.leaves(ref_state))
  assert _alias.taco_states(state).adam[0].mu['scale'].dtype == jnp.float32


def test_adam_leaves_are_rounded_stochastically_too():
  # An RMSNorm scale of 1.0 has an ulp of 2**-7: Adam's ~lr steps never move
  # it when rounded to nearest, and move it about lr / ulp of the time here.
  params = {'scale': jnp.ones((4096,), jnp.bfloat16)}
  grads = {'scale': -jnp.ones((4096,), jnp.bfloat16)}
  for rounding, low, high in (('nearest', 0, 0), ('stochastic', 0.05, 0.2)):
    tx = taco_optax.taco(1e-3, rounding=rounding)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)['scale']
    share = float(np.mean(np.asarray(new != params['scale'])))
    assert low <= share <= high, (rounding, share)


def test_params_are_needed_only_for_16_bit_leaves():
  bf16 = _bf16_params()
  tx = taco_optax.taco(1e-3)
  with pytest.raises(ValueError, match="rounding='nearest'"):
    tx.update(_grads(bf16, 0), tx.init(bf16), None)
  f32 = jax.tree.map(lambda p: p.astype(jnp.float32), bf16)
  tx.update(_grads(f32, 0), tx.init(f32), None)
  with pytest.raises(ValueError, match="rounding='up'"):
    taco_optax.taco(1e-3, rounding='up')


def test_resumed_run_equals_an_uninterrupted_one():
  params = _bf16_params()

  def run(tx, p, s, seeds):
    @jax.jit
    def step(p, s, g):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s
    for seed in seeds:
      p, s = step(p, s, _grads(p, seed))
    return p, s

  tx = taco_optax.taco(3e-5, k=4)
  whole = run(tx, params, tx.init(params), range(4))
  half = run(tx, params, tx.init(params), range(2))
  # What a checkpoint keeps: host copies of every array.
  restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), half)
  assert_bitwise_equal(run(tx, *restored, range(2, 4)), whole)
  different_seed = taco_optax.taco(3e-5, k=4, rounding_seed=1)
  other = run(different_seed, params, different_seed.init(params), range(4))
  assert not np.array_equal(np.asarray(other[0]['w']),
                            np.asarray(whole[0]['w']))


@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
@pytest.mark.parametrize('chunked', tiers.first_fast([False, True]))
def test_layerwise_step_rounds_as_the_optax_path(scan_layers, chunked):
  # The paper's rate on weights of ~1/sqrt(width): most winners' steps are
  # below half an ulp, so the bits decide the result.
  loss = taco_optax.layerwise.LayeredLoss(
      toy_lm.embed, toy_lm.layer, toy_lm.untied_head,
      scan_layers=scan_layers)
  # chunked: every 2-D matrix through the column-block scan.
  train = layerwise_case.train(loss, 3e-4, mu=0.9, k=4,
                               weight_dimension_numbers=toy_lm.matrix_dims,
                               column_block_elements=48 if chunked else None)
  params = toy_lm.params(scan_layers, jnp.bfloat16)
  params = (dict(params[0], w_head=(
      jax.random.normal(jax.random.key(9), (toy_lm.WIDTH,
                                            toy_lm.VOCAB)) / 4
  ).astype(jnp.bfloat16)), params[1])
  plain = jax.jit(toy_lm.plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  expected = got = (params, train.optimizer.init(params))
  for step in range(3):
    expected = plain(*expected, toy_lm.tokens(step))[:2]
    got = fused(*got, toy_lm.tokens(step))[:2]
  assert_bitwise_equal(got, expected)
  assert int(_alias.taco_states(got[1]).rounding.count) == 3


def test_leaf_keys_are_each_leafs_fold_in():
  # Vectorised, the keys are those of folding the step and then the leaf
  # into the seed one leaf at a time (what checkpoints' runs were drawn
  # with); leaf_key is one of them.
  count = jnp.asarray(7, jnp.int32)
  keys = _rounding.leaf_keys(3, count, 40)
  assert keys.shape == (40, 2) and keys.dtype == jnp.uint32
  for leaf in (0, 1, 17, 39):
    expected = jax.random.key_data(jax.random.fold_in(
        jax.random.fold_in(jax.random.key(3), count), leaf))
    np.testing.assert_array_equal(keys[leaf], expected)
    np.testing.assert_array_equal(_rounding.leaf_key(3, count, leaf),
                                  expected)
  assert len({tuple(map(int, k)) for k in keys}) == 40


def _branch_params(dtype):
  keys = jax.random.split(jax.random.key(0), 3)
  return {'w': (jax.random.normal(keys[0], (64, 48)) * 0.02).astype(dtype),
          'stack': (jax.random.normal(keys[1], (3, 16, 8)) * 0.02).astype(
              dtype),
          'b': jnp.zeros((48,), dtype),
          'f32': jax.random.normal(keys[2], (8, 4))}


_BRANCH_DIMS = {'w': taco_optax.TacoDimensionNumbers(),
                'stack': taco_optax.TacoDimensionNumbers(1, 2), 'b': None,
                'f32': taco_optax.TacoDimensionNumbers(1, 0)}


@pytest.mark.parametrize('dtype', tiers.first_fast(DTYPES))
@pytest.mark.parametrize('learning_rate', tiers.first_fast([
    3e-4, optax.linear_schedule(1e-4, 1e-3, 10)]))
def test_taco_branch_is_the_chain_bit_for_bit(dtype, learning_rate):
  # taco() rounds a 16-bit leaf's update at its winners only; its updates
  # and state are chain(scale_by_taco, scale_by_learning_rate,
  # stochastic_rounding)'s, including a step whose gradient is not finite.
  tx = taco_optax.taco(learning_rate, k=4, update_topk=2,
                       weight_dimension_numbers=_BRANCH_DIMS)
  parts = _alias.parts_of(tx)
  chain = optax.partition(
      {_alias.TACO_LABEL: optax.chain(parts.direction, parts.learning_rate,
                                      parts.rounding),
       _alias.ADAM_LABEL: parts.adam}, parts.param_labels)
  params = _branch_params(dtype)
  state, chain_state = tx.init(params), chain.init(params)
  for step in range(4):
    grads = jax.tree.map(
        lambda x, step=step: jax.random.normal(jax.random.key(step), x.shape,
                                               x.dtype), params)
    if step == 2:
      grads['stack'] = grads['stack'].at[0, 0, 0].set(jnp.nan)
    updates, state = jax.jit(tx.update)(grads, state, params)
    expected, chain_state = jax.jit(chain.update)(grads, chain_state, params)
    assert_bitwise_equal((updates, state), (expected, chain_state))
    if step != 2:  # NaN weights would make every later update NaN
      params = optax.apply_updates(params, updates)
  moved = np.asarray(updates['w'] != 0).sum(axis=1)
  assert moved.max() <= 2 and moved.sum() > 0


def test_taco_branch_draws_bits_for_the_winners_only():
  # The chain hashes every element of a 16-bit matrix's update; the branch
  # only the r winners of each column: no uint32 array of the matrix's
  # shape is formed.
  tx = taco_optax.taco(3e-4, k=4, weight_dimension_numbers=_BRANCH_DIMS)
  params = _branch_params(jnp.bfloat16)
  grads = jax.tree.map(jnp.ones_like, params)
  jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(params), params)

  shapes = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      shapes.update(tuple(v.aval.shape) for v in eqn.outvars
                    if getattr(v.aval, 'dtype', None) == jnp.uint32)
      for param in eqn.params.values():
        inner = getattr(param, 'jaxpr', None)  # pjit's ClosedJaxpr
        if inner is not None:
          walk(getattr(inner, 'jaxpr', inner))

  walk(jaxpr.jaxpr)
  # (the chain forms (64, 48) and (3, 16, 8) here)
  assert not shapes & {(64, 48), (3, 16, 8)}, shapes
  assert (64, 1) in shapes, shapes  # one draw per column (row here)
