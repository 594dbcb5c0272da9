"""The README's usage examples run as written, and it stays a front door."""

import re

import jax.numpy as jnp
import pytest

from tests import docs_pages

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
  block = docs_pages.block('README.md', 'nnx.Optimizer')
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


def test_readme_is_a_front_door():
  """Short, its two python blocks the ones above, the rest in docs/ pages."""
  assert len(README.read_text().splitlines()) <= 250
  assert len(docs_pages.python_blocks('README.md')) == 2


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
