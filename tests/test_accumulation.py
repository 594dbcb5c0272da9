"""Accumulation in the layer-wise step equals optax.MultiSteps(taco)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax._src.transform import parts as _alias
from tests.support import reference
from tests.support import tiers
from tests.support import toy_lm
from tests.support.bitwise import assert_bitwise_equal

LayeredLoss = taco_optax.layerwise.LayeredLoss


def _layerwise_run(loss, tx, params, steps, count=toy_lm.MICRO, **kwargs):
  step_fn = jax.jit(taco_optax.layerwise.train_step(
      loss, tx, accumulation_steps=count, **kwargs))
  state = tx.init(params)
  for step in range(steps):
    params, state, _ = step_fn(params, state, toy_lm.micro_batches(step, count))
  return params, state


@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
@pytest.mark.parametrize('dtype', tiers.first_fast([jnp.float32, jnp.bfloat16]))
def test_untied_equals_multisteps_bit_for_bit(scan_layers, dtype):
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.untied_head,
                     scan_layers=scan_layers)
  tx = taco_optax.taco(1e-2, mu=0.9, k=4, adam_learning_rate=1e-3,
                       weight_dimension_numbers=toy_lm.matrix_dims)
  params = toy_lm.untied_params(scan_layers, dtype)
  expected = toy_lm.multisteps_run(loss, tx, params, steps=3)
  got = _layerwise_run(loss, tx, params, steps=3)
  # Every leaf's gradient comes from one part of the model and the mean is
  # MultiSteps' own running mean: TACO's history, winners and learning-rate
  # state match bit for bit. In float32 the vectors' gradients (Adam) are
  # reduced in another order by the per-layer backward, and XLA may fuse a
  # winner's ``p - lr * s`` into one FMA, exactly as without accumulation
  # (test_train_step); in bfloat16 everything matches bit for bit.
  if dtype == jnp.bfloat16:
    assert_bitwise_equal(got, expected)
  else:
    toy_lm.assert_same_step(got, expected, exact_params=False)
  for moved, before in zip(jax.tree.leaves(got[0]), jax.tree.leaves(params)):
    assert not np.array_equal(moved, before)


def test_one_micro_batch_equals_the_plain_step():
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head, scan_layers=True)
  tx = taco_optax.taco(1e-2, mu=0.9, k=4,
                       weight_dimension_numbers=toy_lm.matrix_dims)
  params = toy_lm.params(True, jnp.float32)
  state = tx.init(params)
  batch = toy_lm.tokens(0)
  plain = jax.jit(taco_optax.layerwise.train_step(loss, tx))(
      params, state, batch)
  one = jax.jit(taco_optax.layerwise.train_step(loss, tx,
                                                accumulation_steps=1))(
      params, state, batch[None])
  assert_bitwise_equal(one, plain)


def _mean_gradient(loss, params, micro_batches, path):
  """float64 mean gradient of one outer leaf over the micro-batches."""
  grads = [np.asarray(jax.grad(loss)(params, b)[0][path], np.float64)
           for b in micro_batches]
  return np.mean(grads, axis=0)


@pytest.mark.parametrize('scan_layers', [True, False])
def test_tied_table_matches_multisteps_winners_and_float64_reference(
    scan_layers):
  # The tied table's mean is mean(head) + mean(embedding), MultiSteps' is
  # mean(head + embedding): same value, other rounding. Its winners and
  # indices must still be MultiSteps' and the float64 rule's; the layers'
  # matrices are bit for bit. Their norm scales' gradients are sums over
  # tokens that XLA orders per program (per layer here, in one backward
  # there): equal to the last bits (one element one ulp apart at step 3 on
  # an AVX2 CPU).
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head,
                     scan_layers=scan_layers)
  tx = taco_optax.taco(1e-2, mu=0.9, k=4,
                       weight_dimension_numbers=toy_lm.matrix_dims)
  params = toy_lm.params(scan_layers, jnp.float32)
  expected = toy_lm.multisteps_run(loss, tx, params, steps=3)
  got = _layerwise_run(loss, tx, params, steps=3)
  layers = lambda p: p[0][1] if isinstance(p[0][1], list) else [p[0][1]]
  for have, want in zip(layers(got), layers(expected), strict=True):
    assert_bitwise_equal({k: v for k, v in have.items() if k != 'scale'},
                         {k: v for k, v in want.items() if k != 'scale'})
    np.testing.assert_array_max_ulp(np.asarray(have['scale']),
                                    np.asarray(want['scale']), maxulp=2)
  got_dir = _alias.taco_states(got[1]).direction
  want_dir = _alias.taco_states(expected[1]).direction
  assert_bitwise_equal(got_dir.indices, want_dir.indices)
  for g, w in zip(jax.tree.leaves(got_dir.values),
                  jax.tree.leaves(want_dir.values)):
    np.testing.assert_allclose(np.asarray(g, np.float32),
                               np.asarray(w, np.float32), rtol=0.07)
  # The table moved at the same winners by the same step.
  np.testing.assert_allclose(got[0][0]['embedding'],
                             expected[0][0]['embedding'], rtol=0, atol=1e-6)

  # The numpy rule (tests/support/reference.py, the library's FP8 storage) on
  # the float64 mean gradient: the same indices (winners first) at every step.
  current, state = params, tx.init(params)
  step_fn = jax.jit(taco_optax.layerwise.train_step(
      loss, tx, accumulation_steps=toy_lm.MICRO))
  history = reference.init(toy_lm.WIDTH, toy_lm.VOCAB, k=4)
  for step in range(3):
    # (vocab, width) with dims (0, 1): the paper's G is its transpose.
    mean = _mean_gradient(loss, current, toy_lm.micro_batches(step),
                          'embedding')
    _, history = reference.step(mean.T.astype(np.float32), history, mu=0.9,
                                scale=1.0)
    current, state, _ = step_fn(current, state, toy_lm.micro_batches(step))
    table = _alias.taco_states(state).direction
    np.testing.assert_array_equal(table.indices[0]['embedding'],
                                  history.indices)
    np.testing.assert_array_equal(table.exponents[0]['embedding'],
                                  history.exponents)


def test_refuses_a_batch_without_the_micro_batch_axis():
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head, scan_layers=True)
  tx = taco_optax.taco(1e-2, weight_dimension_numbers=toy_lm.matrix_dims)
  params = toy_lm.params(True, jnp.float32)
  step = taco_optax.layerwise.train_step(loss, tx, accumulation_steps=4)
  with pytest.raises(ValueError, match='accumulation_steps=4 but the batch '
                     'has 3 micro-batches'):
    step(params, tx.init(params), toy_lm.micro_batches(0))
  with pytest.raises(ValueError, match='accumulation_steps must be an int'):
    taco_optax.layerwise.train_step(loss, tx, accumulation_steps=0)


@pytest.mark.parametrize('tied', [True, False])
def test_token_tables_equal_multisteps(tied):
  # TableLookup / TableProjection (the example's model): the tables'
  # gradients are accumulated dense; an untied head's and the embedding's
  # are MultiSteps' bit for bit in TACO's state, a tied table's indices are.
  loss = LayeredLoss(toy_lm.EMBED, toy_lm.layer,
                     toy_lm.TIED if tied else toy_lm.UNTIED,
                     scan_layers=False)
  tx = taco_optax.taco(1e-2, mu=0.9, k=3, update_topk=2,
                       adam_learning_rate=1e-3,
                       weight_dimension_numbers=toy_lm.embedding_rows_are_tokens)
  params = (toy_lm.params(False, jnp.float32) if tied
            else toy_lm.untied_params(False))
  expected = toy_lm.multisteps_run(loss, tx, params, steps=3)
  got = _layerwise_run(loss, tx, params, steps=3)
  if tied:
    assert_bitwise_equal(_alias.taco_states(got[1]).direction.indices,
                         _alias.taco_states(expected[1]).direction.indices)
    np.testing.assert_allclose(got[0][0]['embedding'],
                               expected[0][0]['embedding'], atol=1e-6)
  else:
    toy_lm.assert_same_step(got, expected, exact_params=False)


# A classification head (one scored position per sequence) over a vocabulary
# larger than the micro-batches' tokens: the tables' factors (features and
# logits' cotangent, ids and rows' cotangent) of all micro-batches are
# smaller than a table, so the step keeps them instead of an accumulator.
WIDE_VOCAB = 512


def _last_position_features(outer, hidden, tokens):
  del tokens
  return hidden[:, -1] * outer['final_scale']


def _first_token_nll(logits, tokens):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), tokens[:, 0]).mean()


def _wide_case(tied):
  table = ('embedding',) if tied else ('w_head',)
  head = taco_optax.layerwise.TableProjection(
      table, _last_position_features, _first_token_nll,
      **({} if tied else dict(project=lambda features, kernel: (
          features @ kernel), table_axis=0)))
  loss = LayeredLoss(toy_lm.EMBED, toy_lm.layer, head, scan_layers=False)
  outer, layers = toy_lm.params(False, jnp.float32)
  keys = jax.random.split(jax.random.key(11), 2)
  outer = dict(outer, embedding=jax.random.normal(
      keys[0], (WIDE_VOCAB, toy_lm.WIDTH)) / 4)
  if not tied:
    outer['w_head'] = jax.random.normal(keys[1],
                                        (toy_lm.WIDTH, WIDE_VOCAB)) / 4
  return loss, (outer, layers), toy_lm.embedding_rows_are_tokens


def _wide_micro_batches(step, count=toy_lm.MICRO):
  return jax.random.randint(jax.random.key(300 + step), (count, 2, 8), 0,
                            WIDE_VOCAB)


@pytest.mark.parametrize('tied', [True, False])
def test_tables_kept_as_factors_when_smaller(tied):
  from taco_optax._src.layerwise import micro_batch_table  # pylint: disable=g-import-not-at-top
  loss, (outer, layers), _ = _wide_case(tied)
  batch = _wide_micro_batches(0)[0]
  hidden = loss.embed(outer, batch)
  key = lambda name: (jax.tree_util.SequenceKey(0),
                      jax.tree_util.DictKey(name))
  # What the head reads.
  reads = frozenset({key('embedding' if tied else 'w_head'),
                     key('final_scale')})
  kept = micro_batch_table.kept_as_factors(loss, outer, hidden, batch,
                                           toy_lm.MICRO, reads)
  assert kept == ({key('embedding')} if tied
                  else {key('embedding'), key('w_head')})
  # Sixteen times as many micro-batches outweigh the table: accumulated.
  assert not micro_batch_table.kept_as_factors(loss, outer, hidden, batch,
                                               16 * toy_lm.MICRO, reads)


def _wide_multisteps(loss, tx, params, steps=3):
  """``MultiSteps(tx, toy_lm.MICRO)`` on the wide case's micro-batches."""
  multi = optax.MultiSteps(tx, toy_lm.MICRO)
  state = multi.init(params)

  @jax.jit
  def micro_step(params, state, batch):
    updates, state = multi.update(jax.grad(loss)(params, batch), state,
                                  params)
    return optax.apply_updates(params, updates), state

  for step in range(steps):
    for batch in _wide_micro_batches(step):
      params, state = micro_step(params, state, batch)
  return params, state.inner_opt_state


def _assert_wide_step(got, expected, tied):
  """test_token_tables_equal_multisteps' criteria."""
  if tied:
    assert_bitwise_equal(_alias.taco_states(got[1]).direction.indices,
                         _alias.taco_states(expected[1]).direction.indices)
    np.testing.assert_allclose(got[0][0]['embedding'],
                               expected[0][0]['embedding'], atol=1e-6)
  else:
    toy_lm.assert_same_step(got, expected, exact_params=False)


@pytest.mark.parametrize('block', [None, 64])
@pytest.mark.parametrize('tied', [True, False])
def test_tables_kept_as_factors_equal_multisteps(tied, block, monkeypatch):
  # The path that keeps the micro-batches' factors; block=64: the tables'
  # means formed a column at a time inside the column-block update, never
  # whole.
  from taco_optax._src.layerwise import micro_batch_table  # pylint: disable=g-import-not-at-top
  kwargs = {}
  if block is not None:
    kwargs['column_block_elements'] = block
    monkeypatch.setattr(micro_batch_table.MeanGradient, 'dense',
                        lambda self: pytest.fail('a mean formed whole'))
  loss, params, dims = _wide_case(tied)
  tx = taco_optax.taco(1e-2, mu=0.9, k=3, update_topk=2,
                       adam_learning_rate=1e-3, weight_dimension_numbers=dims)
  expected = _wide_multisteps(loss, tx, params)
  step_fn = jax.jit(taco_optax.layerwise.train_step(
      loss, tx, accumulation_steps=toy_lm.MICRO, **kwargs))
  got = (params, tx.init(params))
  for step in range(3):
    got = step_fn(*got, _wide_micro_batches(step))[:2]
  _assert_wide_step(got, expected, tied)
  moved = lambda name: not np.array_equal(got[0][0][name], params[0][name])
  assert moved('embedding') and (tied or moved('w_head'))


@pytest.mark.parametrize('tied', [True, False])
def test_tables_kept_as_factors_clip_and_norm(tied):
  # Clipping the mean gradient as MultiSteps(chain(clip, taco)) does, and the
  # mean gradient's norm, on the path that keeps the factors.
  loss, params, dims = _wide_case(tied)
  tx = taco_optax.taco(1e-2, mu=0.9, k=3, update_topk=2,
                       adam_learning_rate=1e-3, weight_dimension_numbers=dims)
  expected = _wide_multisteps(
      loss, optax.chain(optax.clip_by_global_norm(0.05), tx), params)
  step_fn = jax.jit(taco_optax.layerwise.train_step(
      loss, tx, accumulation_steps=toy_lm.MICRO, clip_global_norm=0.05,
      with_grad_norm=True))
  got = (params, tx.init(params))
  for step in range(3):
    batches = _wide_micro_batches(step)
    grads = [jax.grad(loss)(got[0], b) for b in batches]
    mean = jax.tree.map(lambda *g: sum(g) / toy_lm.MICRO, *grads)
    *got, _, norm = step_fn(*got, batches)
    np.testing.assert_allclose(norm, optax.tree.norm(mean), rtol=2e-5)
  _assert_wide_step(got, (expected[0], expected[1][1]), tied)
