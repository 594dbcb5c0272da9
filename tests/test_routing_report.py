"""routing_report and the default routing's warning: nothing routed silently."""

import logging

from flax import nnx
import jax
import jax.numpy as jnp
import optax
import pytest

import taco_optax
from taco_optax.nnx import for_nnx_optimizer

DN = taco_optax.TacoDimensionNumbers


def _params(dtype=jnp.float32):
  return {'w': jnp.ones((64, 32), dtype), 'b': jnp.ones((32,), dtype),
          'q': jnp.ones((32, 4, 8), dtype), 'steps': jnp.zeros((), jnp.int32),
          'ids': jnp.zeros((2, 3, 4), jnp.int32)}


def _warnings(caplog):
  return [r for r in caplog.records
          if r.name == 'taco_optax' and r.levelno == logging.WARNING]


def test_default_routing_warns_once_per_init_with_paths_and_fix(caplog):
  tx = taco_optax.taco(1e-3)
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    state = tx.init(_params())
    tx.update(_params(), state, _params())
  (record,) = _warnings(caplog)
  message = record.getMessage()
  assert 'q (32, 4, 8)' in message and 'ids' not in message
  # Plain dicts of no known framework: the helper that reads the computation.
  assert 'taco_optax.trace_dimension_numbers(loss_fn, params' in message
  assert 'TacoDimensionNumbers' in message
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    jax.jit(tx.init)(_params())
  assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize('params', [
    {'w': jnp.ones((4, 3)), 'b': jnp.ones((3,))},   # nothing left out
    {'ids': jnp.zeros((2, 3, 4), jnp.int32)}])       # not floating
def test_no_warning_when_nothing_floating_is_left_out(caplog, params):
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    taco_optax.taco(1e-3).init(params)
  assert not _warnings(caplog)


def test_no_warning_with_explicit_dimension_numbers(caplog):
  dims = {'w': DN(), 'b': None, 'q': None, 'steps': None, 'ids': None}
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    taco_optax.taco(1e-3, weight_dimension_numbers=dims).init(_params())
  assert not _warnings(caplog)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_report_rows_and_bytes(dtype):
  params = {name: x for name, x in _params(dtype).items()
            if name not in ('steps', 'ids')}
  dims = {'w': DN(), 'b': None, 'q': DN(0, (1, 2))}
  tx = taco_optax.taco(1e-3, k=8, weight_dimension_numbers=dims,
                       update_scale={'w': 1.0, 'b': None, 'q': None})
  report = taco_optax.routing_report(tx, params)
  rows = {row.path: row for row in report.rows}
  assert [r.path for r in report.rows] == ['b', 'q', 'w']
  assert (rows['w'].route, rows['w'].m, rows['w'].n, rows['w'].k,
          rows['w'].scale) == ('taco', 32, 64, 8, 1.0)
  assert (rows['q'].m, rows['q'].n, rows['q'].scale) == (32, 32, 1.0)
  assert rows['b'].route == 'adam' and rows['b'].why == 'vector'
  # TACO: k (values, float8) + k (indices, int32) + 1 (exponent) per column.
  assert rows['w'].state_bytes == 64 * (8 * (1 + 4) + 1)
  # Adam in taco keeps float32 moments; optax.adamw the parameter's dtype.
  assert rows['b'].state_bytes == 2 * 32 * 4
  itemsize = jnp.dtype(dtype).itemsize
  assert rows['b'].adamw_state_bytes == 2 * 32 * itemsize
  assert rows['w'].adamw_state_bytes == 2 * 64 * 32 * itemsize
  state = jax.eval_shape(tx.init, params)
  assert report.state_bytes == sum(
      x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  counts = report.state_bytes - sum(r.state_bytes for r in report.rows)
  assert 0 <= counts <= 32  # the step counts
  assert report.adamw_state_bytes >= sum(r.adamw_state_bytes
                                         for r in report.rows)
  text = str(report)
  assert text.startswith('TACO routing: 2 of 3 leaves to TACO')
  assert 'w     (64, 32)' in text and '32 x 64, k=8, s=1' in text


def test_report_names_why_a_leaf_went_to_adam():
  report = taco_optax.routing_report(taco_optax.taco(1e-3), _params())
  why = {row.path: row.why for row in report.rows if row.route == 'adam'}
  assert why['steps'] == 'scalar'
  assert why['q'].startswith(
      'default: rank 3, the default routes rank-2 leaves only')
  dims = {'w': None, 'b': None, 'q': None, 'steps': None, 'ids': None}
  report = taco_optax.routing_report(
      taco_optax.taco(1e-3, weight_dimension_numbers=dims), _params())
  assert {row.why for row in report.rows if row.path in ('w', 'q')} == {
      'weight_dimension_numbers gives None'}


def test_report_reads_nnx_states_and_wrapped_optimizers():
  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  tx = for_nnx_optimizer(taco_optax.taco(1e-3))
  report = taco_optax.routing_report(tx, nnx.state(model, nnx.Param))
  assert [(r.path, r.route) for r in report.rows] == [
      ('bias', 'adam'), ('kernel', 'taco')]
  with pytest.raises(ValueError, match='taco_optax.taco'):
    taco_optax.routing_report(
        optax.inject_hyperparams(taco_optax.taco)(1e-3), {'w': jnp.ones(2)})


def test_report_text_groups_layers_alike():
  params = {'layers': [{'w': jnp.ones((8, 4)), 'b': jnp.ones((4,))}
                       for _ in range(3)], 'head': jnp.ones((4, 2))}
  text = str(taco_optax.routing_report(taco_optax.taco(1e-3), params))
  assert 'layers/*/w (x3)' in text and 'layers/*/b (x3)' in text
  assert 'head ' in text and '(x' not in text.split('head ')[1].split('\n')[0]
  assert len(text.splitlines()) == 2 + 3
