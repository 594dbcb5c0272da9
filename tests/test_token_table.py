"""Token tables as TableLookup / TableProjection: same step, no dense gradient.

The layer-wise step forms a table's gradient from each use's factors, a block
of columns at a time inside the column-block update. It must equal the plain
optax path (the same winners and history), tied and untied, scanned and
unrolled, with and without column blocks, keep the history when the gradient
is not finite, refuse a loss that reads the table elsewhere, and hold less
memory than the dense gradient it replaces.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taco_optax
from taco_optax._src import kernels
from taco_optax._src.kernels import reference as _column_step
from taco_optax._src.layerwise import tied_table as _table_update
from taco_optax._src.layerwise import token_table as _token_table
from taco_optax._src.layerwise import weight_update as _leaf_update
from taco_optax._src.layerwise import winners as _winners
from taco_optax._src.transform import parts as _alias
from taco_optax._src.transform import plan as _leaf
from tests.support import layerwise_case
from tests.support import tiers
from tests.support import toy_lm
from tests.support.bitwise import assert_bitwise_equal

VOCAB, WIDTH = toy_lm.VOCAB, toy_lm.WIDTH


def _run(head, params, scan_layers, steps=3, batches=None, block=None):
  loss = taco_optax.layerwise.LayeredLoss(toy_lm.EMBED, toy_lm.layer, head,
                                          scan_layers=scan_layers)
  train = layerwise_case.train(
      loss, 1e-2, mu=0.9, k=3, update_topk=2, adam_learning_rate=1e-3,
      weight_dimension_numbers=toy_lm.embedding_rows_are_tokens,
      column_block_elements=block)
  plain = jax.jit(toy_lm.plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  expected = got = (params, train.optimizer.init(params))
  batches = batches or [toy_lm.tokens(step) for step in range(steps)]
  for tokens in batches:
    expected = plain(*expected[:2], tokens)
    got = fused(*got[:2], tokens)
    np.testing.assert_allclose(got[2], expected[2], rtol=1e-5)
  return got, expected


def test_calls_equal_the_hand_written_embed_and_head():
  outer, _ = toy_lm.untied_params(False)
  tokens = toy_lm.tokens(0)
  np.testing.assert_array_equal(toy_lm.EMBED(outer, tokens),
                                toy_lm.embed(outer, tokens))
  hidden = jax.random.normal(jax.random.key(1), (4, 8, WIDTH))
  np.testing.assert_allclose(toy_lm.TIED(outer, hidden, tokens),
                             toy_lm.head(outer, hidden, tokens),
                             rtol=1e-6)
  np.testing.assert_allclose(toy_lm.UNTIED(outer, hidden, tokens),
                             toy_lm.untied_head(outer, hidden, tokens),
                             rtol=1e-6)


@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
@pytest.mark.parametrize('tied', tiers.first_fast([True, False]))
def test_equals_plain_optax_path_in_one_pass(scan_layers, tied):
  # Small tables: the whole gradient is formed (TableGradient.dense) and
  # takes the one-pass update, so everything is bit for bit.
  params = (toy_lm.params(scan_layers, jnp.float32) if tied
            else toy_lm.untied_params(scan_layers))
  got, expected = _run(toy_lm.TIED if tied else toy_lm.UNTIED, params,
                       scan_layers)
  toy_lm.assert_same_step(got, expected)
  for name in ('embedding',) + (() if tied else ('w_head',)):
    assert not np.array_equal(got[0][0][name], params[0][name]), name


@pytest.mark.parametrize('tied', [True, False])
def test_column_blocks_equal_plain_optax_path(monkeypatch, tied):
  # 2- to 8-column blocks: every table is formed one block at a time, never
  # whole (dense() would be the fallback; it must not be called).
  def no_dense(self):
    raise AssertionError('a blockwise table gradient was formed whole')
  monkeypatch.setattr(_token_table.TableGradient, 'dense', no_dense)
  params = (toy_lm.params(False, jnp.float32) if tied
            else toy_lm.untied_params(False))
  got, expected = _run(toy_lm.TIED if tied else toy_lm.UNTIED, params,
                       scan_layers=False, block=48)
  # Same winners and history; a moved weight may differ in its last bit
  # (whether XLA fuses ``p + (-lr) * s``).
  toy_lm.assert_same_step(got, expected, exact_params=False)
  assert not np.array_equal(got[0][0]['embedding'], params[0]['embedding'])


@pytest.mark.parametrize('chunk', [None, 48])
def test_non_finite_gradient_keeps_the_history_as_the_optax_path(chunk):
  params = toy_lm.params(False, jnp.float32)
  batches = [toy_lm.tokens(0), toy_lm.tokens(1)]
  got, expected = _run(toy_lm.TIED, params, False, batches=batches,
                       block=chunk or None)
  # A step whose head gradient overflows: an infinite final scale.
  bad = (dict(got[0][0], final_scale=got[0][0]['final_scale'].at[0].set(
      jnp.inf)), got[0][1])
  got, expected = _run(toy_lm.TIED, bad, False, batches=[toy_lm.tokens(2)])
  table_got, table_expected = got[0][0]['embedding'], expected[0][0][
      'embedding']
  assert np.isnan(table_expected).all()
  np.testing.assert_array_equal(np.isnan(table_got), np.isnan(table_expected))
  parts = lambda state: _alias.taco_states(state).direction
  assert_bitwise_equal(parts(got[1]), parts(expected[1]))


def test_a_loss_that_reads_the_table_elsewhere_is_refused():
  reads_table = taco_optax.layerwise.TableProjection(
      ('embedding',), lambda outer, hidden, tokens: hidden + outer[
          'embedding'][0], toy_lm.next_token_loss)
  with pytest.raises(ValueError, match='features reads the token table'):
    _run(reads_table, toy_lm.params(False, jnp.float32), False, steps=1)


def test_unknown_table_path_is_refused():
  wrong = taco_optax.layerwise.TableProjection(
      ('lm_head', 'kernel'), toy_lm.features, toy_lm.next_token_loss)
  with pytest.raises(ValueError, match='no leaf at'):
    _run(wrong, toy_lm.params(False, jnp.float32), False, steps=1)


def test_no_dense_table_gradient_in_the_compiled_step():
  # A 4096 x 64 tied table (1 MiB) in 16-column blocks: the plain functions'
  # step holds its dense gradient through the layers, the table API's not.
  vocab, width = 4096, 64
  keys = jax.random.split(jax.random.key(0), 3)
  outer = {'embedding': jax.random.normal(keys[0], (vocab, width)) / 8,
           'final_scale': jnp.ones((width,))}
  layers = {'w_up': jax.random.normal(keys[1], (4, width, 2 * width)) / 8,
            'w_down': jax.random.normal(keys[2], (4, 2 * width, width)) / 8,
            'scale': jnp.ones((4, width))}
  params = (outer, layers)
  # 8 positions: the logits' cotangent that the blockwise step keeps instead
  # is 8 x 4096 floats (1/8 of the table).
  tokens = jnp.arange(2 * 4, dtype=jnp.int32).reshape(2, 4) * 97 % vocab

  def peak(embed, head):
    loss = taco_optax.layerwise.LayeredLoss(embed, toy_lm.layer, head)
    train = layerwise_case.train(
        loss, 1e-2, weight_dimension_numbers=toy_lm.embedding_rows_are_tokens,
        column_block_elements=4096 * 16)
    state = train.optimizer.init(params)
    return toy_lm.peak_bytes(train.step, params, state, tokens,
                             donate=(0, 1))

  table_bytes = vocab * width * 4
  dense = peak(toy_lm.embed, toy_lm.head)
  blockwise = peak(toy_lm.EMBED, toy_lm.TIED)
  # Measured with jax 0.10.2: 0.555 x the table (the blocks' history-step
  # transients set both peaks' floor); a dense gradient anywhere gives ~0.
  assert dense - blockwise > 0.4 * table_bytes, (dense, blockwise)


@pytest.mark.parametrize('bad_column', [0, WIDTH - 1])
def test_one_non_finite_block_keeps_the_whole_history(bad_column):
  # Only one block of the formed gradient is not finite; it is met before
  # (column 0) or after (the last column) the finite blocks have been
  # written, and the result must equal the dense gradient's: every weight
  # NaN, the history of every column kept.
  table = jax.random.normal(jax.random.key(0), (VOCAB, WIDTH))
  dims = taco_optax.TacoDimensionNumbers(1, 0)
  (plan,) = _leaf.leaf_plans(table, dims, None, 1)
  assert _winners.column_chunk(plan.layout, 48) is not None
  parts = _alias.parts_of(
      taco_optax.taco(1e-2, k=3, weight_dimension_numbers=dims))
  tx = taco_optax.taco(1e-2, k=3, weight_dimension_numbers=dims)
  ids = toy_lm.tokens(0)
  d_rows = jax.random.normal(jax.random.key(1), ids.shape + (WIDTH,))
  history = _alias.taco_states(tx.init(table)).direction
  # A first finite step, so that the kept history is not all zeros.
  @functools.partial(jax.jit, static_argnums=2)
  def update(d_rows, state, dense):
    grad = _token_table.lookup_gradient(toy_lm.EMBED, table, ids, d_rows)
    return _leaf_update.taco_leaf_update(
        table, grad.dense() if dense else grad, kernels.History(*state),
        _winners.WinnerWrite(
            plan=plan, mu=0.9, learning_rate=parts.learning_rate,
            learning_rate_state=parts.learning_rate.init(table),
            block_elements=48))
  state = update(d_rows, history, False).history
  history = history._replace(values=state[0], indices=state[1],
                             exponents=state[2])
  bad = d_rows.at[0, 0, bad_column].set(jnp.inf)
  formed = update(bad, history, False)
  dense = update(bad, history, True)
  assert np.isnan(formed[0]).all()
  assert_bitwise_equal(formed, dense)
  assert_bitwise_equal(tuple(formed[1]), (history.values, history.indices,
                                          history.exponents))


@pytest.mark.parametrize('update_topk', tiers.first_fast([1, 2]))
def test_tied_table_in_two_phases_equals_plain_optax_path(monkeypatch,
                                                          update_topk):
  # 256 rows, 32 looked-up tokens per batch (some repeated), 4-column
  # blocks: the rows outside the batch are selected at the head and merged
  # with the batch's rows after the layers (_table_update).
  vocab = 256
  calls = []
  select = _table_update.select_outside
  monkeypatch.setattr(_table_update, 'select_outside',
                      lambda *args, **kwargs: calls.append(1) or select(
                          *args, **kwargs))
  params = toy_lm.big_vocab_params(vocab)
  # Each step looks up half new tokens: rows outside the batch carry
  # history from the steps before and win on it, and rows in it merge their
  # history with both shares of the gradient.
  tokens = [jax.random.randint(jax.random.key(100 + s), (4, 8), 20 * s,
                               20 * s + 40) for s in range(3)]
  loss = taco_optax.layerwise.LayeredLoss(toy_lm.EMBED, toy_lm.layer,
                                          toy_lm.TIED, scan_layers=False)
  train = layerwise_case.train(
      loss, 1e-2, mu=0.9, k=3, update_topk=update_topk,
      adam_learning_rate=1e-3,
      weight_dimension_numbers=toy_lm.embedding_rows_are_tokens,
      column_block_elements=vocab * 4)
  plain = jax.jit(toy_lm.plain_step(loss, train.optimizer))
  fused = jax.jit(train.step)
  expected = got = (params, train.optimizer.init(params))
  for batch in tokens:
    table_before = got[0][0]['embedding']
    expected = plain(*expected[:2], batch)
    got = fused(*got[:2], batch)
  assert calls, 'the two-phase table update did not run'
  toy_lm.assert_same_step(got, expected, exact_params=False)
  # The last step moved rows of its batch's tokens and rows outside it.
  moved = np.asarray(got[0][0]['embedding'] != table_before).any(axis=1)
  assert moved[40:80].any() and moved[:40].any(), np.flatnonzero(moved)


@pytest.mark.parametrize('seed', tiers.first_fast(range(4)))
def test_two_phases_equal_the_column_step_on_ties_and_zero_columns(seed):
  # Gradients of few distinct values (many ties in magnitude, broken by the
  # lower row), a zero column and an empty history: the merged selection
  # must pick exactly the rows lax.top_k picks on the summed gradient.
  vocab, width, k, r = 64, 8, 4, 2
  rng = np.random.default_rng(seed)
  levels = lambda shape: jnp.asarray(rng.integers(-2, 3, shape) * 0.5,
                                     jnp.float32)
  table = jnp.zeros((vocab, width))
  ids = jnp.asarray(rng.integers(0, vocab, (3, 4)), jnp.int32)
  features = jax.nn.one_hot(rng.integers(0, width, 10), width)
  d_logits = levels((10, vocab))
  d_rows = levels((3, 4, width)).at[..., 0].set(0.0)
  features = features.at[:, 0].set(0.0)  # column 0 of the gradient is zero
  lookup = _token_table.lookup_gradient(toy_lm.EMBED, table, ids, d_rows)
  projection = _token_table.projection_gradient(toy_lm.TIED, table, features,
                                                d_logits)
  dims = taco_optax.TacoDimensionNumbers(1, 0)
  (plan,) = _leaf.leaf_plans(table, dims, None, r)
  tx = taco_optax.taco(1e-2, k=k, update_topk=r,
                       weight_dimension_numbers=dims)
  history = _alias.taco_states(tx.init(table)).direction
  state = kernels.History(history.values, history.indices, history.exponents)
  if seed % 2:  # a history to merge with
    dense = lookup.plus(projection).dense()
    step = _column_step.reference_column_step(
        dense.T * 3, state[0].T, state[1].T, state[2], 0.9, r)
    state = kernels.History(step.values.T, step.indices.T, step.exponents)
  expected = _column_step.reference_column_step(
      lookup.plus(projection).dense().T, state[0].T, state[1].T, state[2],
      0.9, r)
  rows, _ = _table_update.batch_tokens(ids, vocab)
  outside = _table_update.select_outside(projection, rows, state, plan, 0.9,
                                         2)
  inside = _token_table.lookup_gradient(toy_lm.EMBED, table, ids,
                                        d_rows).dense()
  got = _table_update.merge_batch_tokens(
      outside, rows, jnp.take(inside, rows, 0, mode='fill', fill_value=0).T,
      state, plan, 0.9)
  assert_bitwise_equal(got, expected)


def test_batch_tokens_meet_the_history_without_a_column_token_buffer():
  # Phase 2 on 8 x 512 looked-up tokens, 64 columns, k = 16: matching each
  # column's history with the batch's distinct tokens as an (n, k, U)
  # comparison held n * k * U floats (151 MiB at SmolLM2's 576 columns);
  # the merge needs a few (n, U) arrays (the lookup's share, the candidates).
  vocab, width, k = 8192, 64, 16
  table = jax.ShapeDtypeStruct((vocab, width), jnp.float32)
  ids = jax.ShapeDtypeStruct((8, 512), jnp.int32)
  dims = taco_optax.TacoDimensionNumbers(1, 0)
  (plan,) = _leaf.leaf_plans(table, dims, None, 1)
  tx = taco_optax.taco(1e-2, k=k, weight_dimension_numbers=dims)
  history = kernels.History(*_alias.taco_states(
      jax.eval_shape(tx.init, table)).direction[:3])
  features = jax.ShapeDtypeStruct((8, width), jnp.float32)
  d_logits = jax.ShapeDtypeStruct((8, vocab), jnp.float32)

  def merge(table, ids, features, d_logits, history):
    projection = _token_table.projection_gradient(toy_lm.TIED, table, features,
                                                  d_logits)
    tokens, _ = _table_update.batch_tokens(ids, vocab)
    outside = _table_update.select_outside(projection, tokens, history,
                                           plan, 0.9, 4)
    outside = jax.lax.optimization_barrier(outside)
    lookup_grads = jnp.zeros((width, tokens.size), jnp.float32)
    return _table_update.merge_batch_tokens(outside, tokens, lookup_grads,
                                            history, plan, 0.9)

  temp = jax.jit(merge).lower(
      table, ids, features, d_logits,
      history).compile().memory_analysis().temp_size_in_bytes
  column_by_token = width * ids.size * 4
  assert temp < k * column_by_token / 2, (temp, k * column_by_token)
