"""The README's usage examples run as written, and it stays a front door."""

import re

import jax
import jax.numpy as jnp
import pytest

from tests.support import docs_pages
from tests.support import routing_checks

README = docs_pages.ROOT / 'README.md'


def test_optax_example_runs():
  block = docs_pages.python_blocks('README.md')[0]
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  moved = (namespace['updates']['w'] != 0).sum(axis=1)
  assert (moved == 1).all()


def test_readme_states_the_two_commands():
  text = README.read_text()
  for marker in ('<!-- main-command -->', '<!-- test-command -->'):
    assert re.search(re.escape(marker) + r'\n```bash\n.+\n```', text), marker


def test_nnx_example_runs():
  nnx = pytest.importorskip('flax.nnx')
  block = docs_pages.block('README.md', 'def train_step')
  assert 'def train_step' in block
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  start = nnx.Linear(64, 32, rngs=nnx.Rngs(0))  # the example's initial model
  kernel = namespace['model'].kernel[...]
  # One entry in each row (input feature) of the (in, out) kernel moved.
  moved = (kernel != start.kernel[...]).sum(axis=1)
  assert moved.tolist() == [1] * 64
  assert bool(jnp.isfinite(namespace['loss']))
  assert int(namespace['optimizer'].step[...]) == 1


def _run(marker):
  namespace = {}
  exec(docs_pages.block('README.md', marker), namespace)  # pylint: disable=exec-used
  return namespace


def _one_update(tx, params, seed=0):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  grads = treedef.unflatten([jax.random.normal(k, x.shape, x.dtype)
                             for k, x in zip(keys, leaves)])
  updates, _ = tx.update(grads, tx.init(params), params)
  return updates


def test_equinox_routing_moves_one_weight_per_input_feature():
  namespace = _run('taco_optax.equinox.dimension_numbers')
  layers = namespace['updates'].layers
  # (out, in) weights: one nonzero per input feature, at lr * out / in.
  for layer, (out, inputs) in zip(layers, [(128, 64), (128, 128), (10, 128)]):
    routing_checks.assert_one_per_input(layer.weight, 1, 0, 1e-3,
                                        scale=out / inputs)
    routing_checks.assert_adam_dense(layer.bias)


def test_nnx_routing_reads_the_einsum_kernel():
  nnx = pytest.importorskip('flax.nnx')
  namespace = _run('taco_optax.nnx.dimension_numbers')
  params = nnx.state(namespace['model'], nnx.Param)
  updates = _one_update(namespace['tx'], params)
  routing_checks.assert_one_per_input(updates['kernel'][...], 0, (1, 2), 1e-3)


def test_linen_routing_reads_dense_general_kernels():
  namespace = _run('taco_optax.linen.dimension_numbers')
  updates = _one_update(namespace['tx'], namespace['params'])
  routing_checks.assert_one_per_input(updates['query']['kernel'], 0, (1, 2),
                                      1e-3, name='query')
  routing_checks.assert_one_per_input(updates['out']['kernel'], (0, 1), 2,
                                      1e-3, name='out')
  routing_checks.assert_adam_dense(updates['query']['bias'])


def test_traced_routing_reads_a_transposed_use():
  namespace = _run('trace_dimension_numbers')
  updates = _one_update(namespace['tx'], namespace['params'])
  routing_checks.assert_one_per_input(updates['w_in'], 1, 0, 1e-3,
                                      name='w_in')
  routing_checks.assert_one_per_input(updates['w_out'], 0, 1, 1e-3,
                                      name='w_out')


def test_readme_is_a_front_door():
  """Short; its python blocks the ones above (use, then routing by
  framework), the rest in docs/ pages."""
  assert len(README.read_text().splitlines()) <= 250
  assert len(docs_pages.python_blocks('README.md')) == 6


@pytest.mark.parametrize(
    'page', ['README.md'] + sorted(
        str(p.relative_to(docs_pages.ROOT))
        for p in (docs_pages.ROOT / 'docs').rglob('*.md')))
def test_relative_links_name_files_that_exist(page):
  path = docs_pages.ROOT / page
  for target in re.findall(r'\]\(([^)\s]+)\)', path.read_text()):
    if re.match(r'[a-z]+:', target):
      continue  # a web address
    target = target.split('#')[0]
    assert (path.parent / target).exists(), (page, target)


def _tables(text):
  """Each run of consecutive table lines of ``text``, joined."""
  tables, current = [], []
  for line in text.splitlines() + ['']:
    if line.startswith('|'):
      current.append(line)
    elif current:
      tables.append('\n'.join(current))
      current = []
  return tables


def test_quality_table_is_the_one_the_runs_script_wrote():
  # The README's TACO-against-AdamW table is the summary that
  # `python -m benchmarks.multiclass_runs --write
  # docs/measured/multiclass.md` wrote,
  # so it cannot drift from the recorded runs.
  text = README.read_text()
  section = text.split('## How well it trains')[1].split('\n## ')[0]
  table, = _tables(section)
  assert '| TACO − AdamW, paired |' in table.splitlines()[0]
  assert table in _tables(
      (docs_pages.ROOT / 'docs' / 'measured' / 'multiclass.md').read_text())
