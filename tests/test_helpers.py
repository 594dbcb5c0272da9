"""Tests share helpers through tests/support/, not through each other.

A test module imported for its private helpers couples two tests' files (a
rename in one breaks the other) and needs a ``protected-access`` disable at
every use; what more than one test file needs is a public name in
``tests/support/`` (or a fixture in a conftest).
"""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def _test_module_aliases(tree) -> dict[str, str]:
  """The names a module binds to test modules (``test_*``), by alias."""
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for name in node.names:
        if name.name.split('.')[-1].startswith('test_'):
          aliases[name.asname or name.name] = name.name
    elif isinstance(node, ast.ImportFrom):
      for name in node.names:
        if name.name.startswith('test_'):
          aliases[name.asname or name.name] = name.name
  return aliases


def _private_uses(source: str) -> list[str]:
  """``module._name`` for each private name of a test module ``source`` uses.
  """
  tree = ast.parse(source)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (
        node.module or '').split('.')[-1].startswith('test_'):
      found += [f'{node.module}.{name.name}' for name in node.names
                if name.name.startswith('_')]
  aliases = _test_module_aliases(tree)
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr.startswith('_') and
        isinstance(node.value, ast.Name) and node.value.id in aliases):
      found.append(f'{aliases[node.value.id]}.{node.attr}')
  return found


def test_no_test_module_is_imported_for_its_private_names():
  found = {str(path.relative_to(TESTS)): uses
           for path in sorted(TESTS.rglob('*.py'))
           if (uses := _private_uses(path.read_text()))}
  assert not found, found


def test_the_check_sees_a_private_use():
  source = ('from tests import test_train_step as case\n'
            'from tests.test_sharding import _place, specs\n'
            'import test_cli\n'
            'x = case._params(True), test_cli._text_args, case.WIDTH\n')
  assert sorted(_private_uses(source)) == [
      'test_cli._text_args', 'test_train_step._params',
      'tests.test_sharding._place']


def _test_module_imports(source: str) -> list[str]:
  """The test modules (``test_*``) ``source`` imports, by name."""
  tree = ast.parse(source)
  found = list(_test_module_aliases(tree).values())
  found += [node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and (node.module or '').split('.')[-1].startswith('test_')]
  return sorted(found)


def test_no_test_module_imports_another():
  """Not even for public names: shared cases live in tests/support/."""
  found = {str(path.relative_to(TESTS)): uses
           for path in sorted(TESTS.rglob('*.py'))
           if (uses := _test_module_imports(path.read_text()))}
  assert not found, found


def test_the_import_check_sees_every_form():
  source = ('from tests import test_train_step as case\n'
            'from tests.test_sharding import specs\n'
            'import tests.test_auto_mesh\n'
            'from tests.support import mesh_layered\n')
  assert _test_module_imports(source) == [
      'test_train_step', 'tests.test_auto_mesh', 'tests.test_sharding']
