"""What global-norm clipping means for TACO on each path (docs/layerwise.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from tests.support import tiers
from tests.support import toy_lm


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


def test_the_layerwise_step_refuses_a_chain_naming_the_argument():
  loss = taco_optax.layerwise.LayeredLoss(toy_lm.embed, toy_lm.layer,
                                          toy_lm.head)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   taco_optax.taco(1e-2,
                                   weight_dimension_numbers=toy_lm.matrix_dims))
  with pytest.raises(ValueError, match='pass taco.* and clip_global_norm=c'):
    taco_optax.layerwise.train_step(loss, tx)
  with pytest.raises(ValueError, match='clip_global_norm must be a number'):
    taco_optax.layerwise.train_step(loss, taco_optax.taco(1e-2),
                                    clip_global_norm=0.0)


def _clipped_runs(head, scan_layers, max_norm, dtype=jnp.float32,
                  extra_outer=None, steps=3):
  loss = taco_optax.layerwise.LayeredLoss(toy_lm.embed, toy_lm.layer, head,
                                          scan_layers=scan_layers)
  tx = taco_optax.taco(1e-2, mu=0.9, k=4, adam_learning_rate=1e-3,
                       weight_dimension_numbers=toy_lm.matrix_dims)
  outer, layers = toy_lm.params(scan_layers, dtype)
  params = (dict(outer, **(extra_outer or {})), layers)
  chain = optax.chain(optax.clip_by_global_norm(max_norm), tx)
  plain = jax.jit(toy_lm.plain_step(loss, chain))
  fused = jax.jit(taco_optax.layerwise.train_step(
      loss, tx, clip_global_norm=max_norm))
  expected = (params, chain.init(params))
  got = (params, tx.init(params))
  norms = []
  for step in range(steps):
    grads = jax.grad(loss)(expected[0], toy_lm.tokens(step))
    norms.append(float(optax.tree.norm(grads)))
    expected = plain(*expected[:2], toy_lm.tokens(step))
    got = fused(*got[:2], toy_lm.tokens(step))
  # chain's state is (clip's empty state, taco's state).
  return (got[0], got[1]), (expected[0], expected[1][1]), norms, params


@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
@pytest.mark.parametrize('tied', tiers.first_fast([True, False]))
def test_clip_global_norm_equals_the_optax_chain(scan_layers, tied):
  head, extra = toy_lm.head, None
  if not tied:
    head = toy_lm.untied_head
    extra = {'w_head': jax.random.normal(jax.random.key(7),
                                         (toy_lm.WIDTH, toy_lm.VOCAB)) / 4}
  got, expected, norms, start = _clipped_runs(head, scan_layers, 0.05,
                                              extra_outer=extra)
  assert min(norms) > 0.05  # clipping acts at every step
  # The norm is optax's, summed leaf by leaf in its order (a stacked
  # leaf's layers in layer order: its last bits may differ), so TACO's
  # winners and history match and the weights up to rounding.
  toy_lm.assert_same_step(got, expected, exact_params=False)
  for moved, before in zip(jax.tree.leaves(got[0]), jax.tree.leaves(start)):
    assert not np.array_equal(moved, before)


def test_clip_global_norm_above_the_norm_changes_nothing():
  got, expected, norms, _ = _clipped_runs(toy_lm.head, False, 1e6)
  assert max(norms) < 1e6
  toy_lm.assert_same_step(got, expected, exact_params=False)


def _clipped_table_runs(head, params, max_norm, tokens, block):
  loss = taco_optax.layerwise.LayeredLoss(toy_lm.EMBED, toy_lm.layer, head,
                                          scan_layers=False)
  tx = taco_optax.taco(1e-2, mu=0.9, k=3, update_topk=2,
                       adam_learning_rate=1e-3,
                       weight_dimension_numbers=toy_lm.embedding_rows_are_tokens)
  chain = optax.chain(optax.clip_by_global_norm(max_norm), tx)
  plain = jax.jit(toy_lm.plain_step(loss, chain))
  fused = jax.jit(taco_optax.layerwise.train_step(
      loss, tx, clip_global_norm=max_norm, column_block_elements=block))
  expected, got = (params, chain.init(params)), (params, tx.init(params))
  for batch in tokens:
    assert float(optax.tree.norm(jax.grad(loss)(expected[0], batch))) > (
        max_norm)
    expected = plain(*expected[:2], batch)
    got = fused(*got[:2], batch)
  return (got[0], got[1]), (expected[0], expected[1][1])


@pytest.mark.parametrize('tied', tiers.first_fast([True, False]))
def test_clipped_token_tables_formed_a_block_at_a_time(tied):
  # 2- to 8-column blocks: each block of a table's gradient is clipped as
  # it is formed; a tied table's two phases give way to the one-pass update.
  params = (toy_lm.params(False, jnp.float32) if tied
            else toy_lm.untied_params(False))
  got, expected = _clipped_table_runs(
      toy_lm.TIED if tied else toy_lm.UNTIED, params, 0.05,
      [toy_lm.tokens(step) for step in range(3)], block=48)
  toy_lm.assert_same_step(got, expected, exact_params=False)


def test_clipped_tied_table_where_two_phases_would_run():
  tokens = [jax.random.randint(jax.random.key(100 + s), (4, 8), 20 * s,
                               20 * s + 40) for s in range(3)]
  got, expected = _clipped_table_runs(toy_lm.TIED,
                                      toy_lm.big_vocab_params(256), 0.05,
                                      tokens, block=256 * 4)
  toy_lm.assert_same_step(got, expected, exact_params=False)


@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
def test_clip_with_accumulation_equals_multisteps_of_the_chain(scan_layers):
  loss = taco_optax.layerwise.LayeredLoss(toy_lm.embed, toy_lm.layer,
                                          toy_lm.untied_head,
                                          scan_layers=scan_layers)
  tx = taco_optax.taco(1e-2, mu=0.9, k=4, adam_learning_rate=1e-3,
                       weight_dimension_numbers=toy_lm.matrix_dims)
  params = toy_lm.untied_params(scan_layers, jnp.float32)
  chain = optax.chain(optax.clip_by_global_norm(0.05), tx)
  expected_params, expected_state = toy_lm.multisteps_run(
      loss, chain, params, steps=3)
  step = jax.jit(taco_optax.layerwise.train_step(
      loss, tx, accumulation_steps=toy_lm.MICRO, clip_global_norm=0.05))
  got = (params, tx.init(params))
  for s in range(3):
    got = step(*got[:2], toy_lm.micro_batches(s))
  # The mean gradient is clipped as MultiSteps clips it: TACO's history and
  # winners bit for bit, Adam and the weights up to rounding.
  toy_lm.assert_same_step(got, (expected_params, expected_state[1]),
                          exact_params=False)
