"""The python code blocks of the README and the docs pages, for tests."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def python_blocks(page):
  """Every ```python block of `page` (a path from the repository root)."""
  return re.findall(r'```python\n(.*?)```', (ROOT / page).read_text(), re.S)


def block(page, containing, excluding=None):
  """The one python block of `page` that holds `containing`, not `excluding`."""
  found = [b for b in python_blocks(page)
           if containing in b and (excluding is None or excluding not in b)]
  assert len(found) == 1, (page, containing, len(found))
  return found[0]
