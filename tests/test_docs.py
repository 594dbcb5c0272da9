"""The docs pages' code examples run as written (the README's twin)."""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import taco_optax
from tests.support import docs_pages

# Blocks that sketch a setup and are not run: the mesh recipe needs several
# processes and a model of the reader's.
_NOT_RUN = ('build_model_with_sharded_params',)
# What selects each block the tests below (and test_tunix.py) run.
_RUN = {'docs/layerwise.md': ('layerwise.train_step',),
        'docs/routing.md': ('routing_report', 'inject_hyperparams'),
        'docs/with_tunix.md': ('LayerwisePeftTrainer',),
        # Run on a run's export by tests/examples/test_export.py.
        'docs/example.md': ('AutoModelForCausalLM',)}


def test_every_python_block_of_the_docs_is_run():
  for path in sorted((docs_pages.ROOT / 'docs').rglob('*.md')):
    page = str(path.relative_to(docs_pages.ROOT))
    for block in docs_pages.python_blocks(page):
      if any(word in block for word in _NOT_RUN):
        continue
      assert any(word in block for word in _RUN.get(page, ())), (
          f'{page} has a python block no test runs:\n{block}')


def test_plain_loss_example_runs_and_matches_the_optax_path():
  block = docs_pages.block('docs/layerwise.md', 'jax.checkpoint')
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  tx, loss_fn, stepped = namespace['tx'], namespace['loss_fn'], namespace[
      'params']
  # The example donated its inputs; rebuild them and take one plain step.
  exec(block.split('tx =')[0], namespace)  # pylint: disable=exec-used
  start = namespace['params']
  x = jnp.ones((8, 16))
  updates, _ = tx.update(jax.grad(loss_fn)(start, x), tx.init(start), start)
  chex.assert_trees_all_close(stepped, optax.apply_updates(start, updates),
                              atol=1e-6)
  # One weight per column of each layer matrix moved.
  for before, after in zip(start['layers'], stepped['layers']):
    assert int((after['w'] != before['w']).sum(axis=-1).max()) == 1


def test_live_nnx_model_example_equals_nnx_optimizer_update():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  block = docs_pages.block('docs/layerwise.md', 'nnx.Optimizer(')
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  model = namespace['Model'](nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, namespace['tx'], wrt=nnx.Param)
  start = jax.tree.leaves(nnx.state(model, nnx.Param))

  @nnx.jit
  def reference(model, optimizer, x):
    loss, grads = nnx.value_and_grad(namespace['model_loss'])(model, x)
    optimizer.update(model, grads)
    return loss

  assert float(reference(model, optimizer, jnp.ones((8, 16)))) == float(
      namespace['loss'])
  got = jax.tree.leaves((nnx.state(namespace['model']),
                         nnx.state(namespace['optimizer'])))
  expected = jax.tree.leaves((nnx.state(model), nnx.state(optimizer)))
  assert len(got) == len(expected)
  for a, b in zip(got, expected):
    assert a.dtype == b.dtype and bool((a == b).all())
  assert int(namespace['optimizer'].step[...]) == 1
  moved = jax.tree.leaves(nnx.state(namespace['model'], nnx.Param))
  assert all(bool((a != b).any()) for a, b in zip(moved, start))


def test_layerwise_example_runs_and_matches_the_optax_path():
  block = docs_pages.block('docs/layerwise.md', 'LayeredLoss(',
                           excluding='TableLookup')
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  tx, loss = namespace['tx'], namespace['loss']
  x = jnp.ones((8, 16))
  params = namespace['params']
  # The example donated its inputs; rebuild them and take one plain step.
  exec(block.split('matrix =')[0], namespace)  # pylint: disable=exec-used
  start = (namespace['outer'], namespace['layers'])
  state = tx.init(start)
  grads = jax.grad(loss)(start, x)
  updates, _ = tx.update(grads, state, start)
  expected = optax.apply_updates(start, updates)
  chex.assert_trees_all_close(params, expected, atol=1e-6)
  # One weight per column of each layer matrix moved.
  moved = (params[1]['w'] != start[1]['w']).sum(axis=-1)
  assert int(moved.max()) == 1


def test_token_table_example_runs_and_matches_the_optax_path():
  block = docs_pages.block('docs/layerwise.md', 'TableLookup')
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  tx, loss = namespace['lm_tx'], namespace['lm_loss']
  stepped = namespace['lm_params']
  # The example donated its inputs; rebuild them and take one plain step.
  exec(block.split('lm_dims =')[0], namespace)  # pylint: disable=exec-used
  start = namespace['lm_params']
  tokens = jnp.arange(32).reshape(4, 8) * 31 % namespace['vocab']
  state = tx.init(start)
  updates, _ = tx.update(jax.grad(loss)(start, tokens), state, start)
  chex.assert_trees_all_close(stepped, optax.apply_updates(start, updates),
                              atol=1e-6)
  # One token's row moved in each feature column of the table.
  moved = (stepped[0]['embedding'] != start[0]['embedding']).sum(axis=0)
  assert int(moved.min()) == int(moved.max()) == 1


def test_routing_example_runs_as_it_says(capsys):
  nnx = pytest.importorskip('flax.nnx')
  block = docs_pages.block('docs/routing.md', 'routing_report')
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  dn = taco_optax.TacoDimensionNumbers
  dims = namespace['dims']
  assert (dims['q']['kernel'], dims['o']['kernel']) == (
      dn(0, (1, 2)), dn((0, 1), 2))
  assert dims['norm']['scale'] is None
  report = namespace['report']
  printed = capsys.readouterr().out
  claimed = re.search(r'# (TACO routing: .*) \(\.\.\.\); (optimizer state .*)',
                      block)
  assert printed.startswith(claimed[1]) and claimed[2] in printed
  assert [r.route for r in report.rows] == ['adam', 'taco', 'taco']
  assert isinstance(namespace['optimizer'], nnx.Optimizer)


def test_inject_hyperparams_recipe_routes_as_taco():
  block = docs_pages.block('docs/routing.md', 'inject_hyperparams')
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  params = {'w': jnp.ones((4, 3)), 'b': jnp.ones((3,))}
  grads = {'w': jnp.arange(12.0).reshape(4, 3), 'b': jnp.ones((3,))}
  tx = namespace['tx']
  updates, _ = tx.update(grads, tx.init(params), params)
  plain = taco_optax.taco(3e-5, k=16,
                          weight_dimension_numbers=namespace['dims_of'])
  expected, _ = plain.update(grads, plain.init(params), params)
  assert jnp.array_equal(updates['w'], expected['w'])
  assert int((updates['w'] != 0).sum()) == 4


def test_the_bad_input_table_is_what_the_code_answers():
  from benchmarks import bad_inputs  # pylint: disable=g-import-not-at-top
  page = (docs_pages.ROOT / 'docs' / 'api.md').read_text()
  assert bad_inputs.page_table(page) == bad_inputs.table(), (
      'docs/api.md is stale: python -m benchmarks.bad_inputs --write')
