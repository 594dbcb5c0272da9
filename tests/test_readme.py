"""The README's usage examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / 'README.md'


def _python_blocks():
  return re.findall(r'```python\n(.*?)```', README.read_text(), re.S)


def test_optax_example_runs():
  namespace = {}
  exec(_python_blocks()[0], namespace)  # pylint: disable=exec-used
  moved = (namespace['updates']['w'] != 0).sum(axis=1)
  assert (moved == 1).all()


def test_readme_states_the_two_commands():
  text = README.read_text()
  for marker in ('<!-- main-command -->', '<!-- test-command -->'):
    assert re.search(re.escape(marker) + r'\n```bash\n.+\n```', text), marker
