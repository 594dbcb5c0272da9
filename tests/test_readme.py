"""The README's usage examples run as written."""

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

