"""The layer-wise step's global gradient norm (``with_grad_norm=True``).

Each leaf's ``sum(g**2)`` is taken where its gradient exists: a layer's in
its backward pass, a token table's a block of columns at a time, a tied
table's in its two phases. The norm must be ``optax.global_norm`` of
``jax.grad`` of the same loss (float order aside), with the step's other
results unchanged, for every one of those paths; with accumulation the mean
gradient's; with clipping the unclipped gradient's; NaN only when the
gradient is.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax._src.layerwise import token_table as _token_table
from tests.support import tiers
from tests.support import toy_lm

LayeredLoss = taco_optax.layerwise.LayeredLoss


def _float32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _expected_norm(loss, params, batch):
  return optax.tree.norm(_float32(jax.grad(loss)(params, batch)))


def _steps(loss, optimizer, **kwargs):
  plain = taco_optax.layerwise.train_step(loss, optimizer, **kwargs)
  measured = taco_optax.layerwise.train_step(loss, optimizer,
                                             with_grad_norm=True, **kwargs)
  return jax.jit(plain), jax.jit(measured)


def _check(loss, optimizer, params, batches, expected_norm, **kwargs):
  """Three steps: the same results as without the norm, and the norm."""
  plain, measured = _steps(loss, optimizer, **kwargs)
  state = optimizer.init(params)
  got = expected = (params, state)
  for batch in batches:
    norm = expected_norm(got[0], batch)
    expected = plain(*expected[:2], batch)
    *got, got_norm = measured(*got[:2], batch)
    np.testing.assert_allclose(got_norm, norm, rtol=2e-5)
    assert float(got_norm) > 0
    for mine, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(expected),
                            strict=True):
      np.testing.assert_array_equal(mine, theirs)


def _dense_case(scan_layers):
  loss = LayeredLoss(toy_lm.embed, toy_lm.layer, toy_lm.head,
                     scan_layers=scan_layers)
  tx = taco_optax.taco(1e-2, k=3, weight_dimension_numbers=(
      toy_lm.matrix_dims))
  return loss, tx, toy_lm.params(scan_layers, jnp.float32)


@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
def test_dense_layers(scan_layers):
  loss, tx, params = _dense_case(scan_layers)
  batches = [toy_lm.tokens(s) for s in range(3)]
  _check(loss, tx, params, batches,
         lambda p, b: _expected_norm(loss, p, b))


def _table_case(tied, scan_layers, params=None):
  head = toy_lm.TIED if tied else toy_lm.UNTIED
  loss = LayeredLoss(toy_lm.EMBED, toy_lm.layer, head,
                     scan_layers=scan_layers)
  tx = taco_optax.taco(1e-2, mu=0.9, k=3, update_topk=2,
                       adam_learning_rate=1e-3,
                       weight_dimension_numbers=(
                           toy_lm.embedding_rows_are_tokens))
  if params is None:
    params = (toy_lm.params(scan_layers, jnp.float32) if tied
              else toy_lm.untied_params(scan_layers))
  return loss, tx, params


@pytest.mark.parametrize('block', tiers.first_fast([None, 48]))
@pytest.mark.parametrize('scan_layers', tiers.first_fast([True, False]))
@pytest.mark.parametrize('tied', tiers.first_fast([True, False]))
def test_token_tables(tied, scan_layers, block, monkeypatch):
  if block is not None:  # every table formed a block of columns at a time
    monkeypatch.setattr(_token_table.TableGradient, 'dense', _no_dense)
  loss, tx, params = _table_case(tied, scan_layers)
  kwargs = {} if block is None else {'column_block_elements': block}
  batches = [toy_lm.tokens(s) for s in range(3)]
  _check(loss, tx, params, batches,
         lambda p, b: _expected_norm(loss, p, b), **kwargs)


def _no_dense(self):
  raise AssertionError('a blockwise table gradient was formed whole')


def test_tied_table_in_two_phases(monkeypatch):
  calls = []
  from taco_optax._src.layerwise import tied_table  # pylint: disable=import-outside-toplevel
  select = tied_table.select_outside
  monkeypatch.setattr(tied_table, 'select_outside',
                      lambda *a, **k: calls.append(1) or select(*a, **k))
  vocab = 256
  loss, tx, params = _table_case(True, False,
                                 toy_lm.big_vocab_params(vocab))
  # Repeated tokens, and half of each batch new: both phases have rows.
  batches = [jax.random.randint(jax.random.key(100 + s), (4, 8), 20 * s,
                                20 * s + 40) for s in range(3)]
  _check(loss, tx, params, batches,
         lambda p, b: _expected_norm(loss, p, b),
         column_block_elements=vocab * 4)
  assert calls, 'the two-phase table update did not run'


@pytest.mark.parametrize('tables', tiers.first_fast([False, True]))
def test_accumulation_is_the_mean_gradients_norm(tables):
  loss, tx, params = (_table_case(True, False) if tables
                      else _dense_case(False))
  steps = 3

  def expected(p, batches):
    grads = [jax.grad(loss)(p, jax.tree.map(lambda x, i=i: x[i], batches))
             for i in range(steps)]
    return optax.tree.norm(jax.tree.map(lambda *g: sum(g) / steps,
                                          *grads))

  batches = [jnp.stack([toy_lm.tokens(3 * s + i) for i in range(steps)])
             for s in range(2)]
  _check(loss, tx, params, batches, expected, accumulation_steps=steps)


def test_clipping_reports_the_unclipped_norm():
  loss, tx, params = _table_case(False, False)
  batches = [toy_lm.tokens(s) for s in range(2)]
  _check(loss, tx, params, batches,
         lambda p, b: _expected_norm(loss, p, b), clip_global_norm=1e-3)


def test_a_non_finite_gradient_gives_a_non_finite_norm():
  loss, tx, params = _table_case(True, False)
  outer, layers = params
  bad = (dict(outer, final_scale=outer['final_scale'].at[0].set(jnp.inf)),
         layers)
  _, measured = _steps(loss, tx)
  *_, norm = measured(bad, tx.init(bad), toy_lm.tokens(0))
  assert not np.isfinite(norm)
  *_, norm = measured(params, tx.init(params), toy_lm.tokens(0))
  assert np.isfinite(norm)


def test_with_grad_norm_must_be_a_bool():
  loss, tx, _ = _dense_case(False)
  with pytest.raises(ValueError, match='with_grad_norm must be a bool'):
    taco_optax.layerwise.train_step(loss, tx, with_grad_norm=1)
