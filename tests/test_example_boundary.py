"""The benchmarks use the fine-tuning example only through its public surface.

``examples/finetune/api.py`` is that surface: a benchmark that imports another
of the example's modules, or reads another object's private attribute, breaks
when the example's insides change.
"""

import ast
import pathlib
import types

from examples.finetune import api

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / 'benchmarks').rglob('*.py'))
SURFACE = 'examples.finetune.api'
# Methods every namedtuple has: public, despite their leading underscore.
NAMEDTUPLE_METHODS = frozenset({'_replace', '_asdict', '_fields', '_make',
                                '_field_defaults'})


def _imported_modules(tree):
  """Every module (or ``package.name``) an ``import`` statement names."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield node.lineno, {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.lineno, {f'{node.module}.{alias.name}'
                          for alias in node.names}


def test_benchmarks_import_the_example_only_through_its_api():
  offenders = [
      f'{path.relative_to(ROOT)}:{line}: {name}'
      for path in BENCHMARKS
      for line, names in _imported_modules(ast.parse(path.read_text()))
      for name in sorted(names)
      if name.split('.')[0] == 'examples' and name != SURFACE]
  assert not offenders, offenders


def _private_attributes(tree):
  """``(line, 'x._y')`` for every ``x._y`` where ``x`` is not self or cls."""
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    name = node.attr
    if not name.startswith('_') or name.startswith('__'):
      continue
    if name in NAMEDTUPLE_METHODS:
      continue
    if isinstance(node.value, ast.Name) and node.value.id in ('self', 'cls'):
      continue
    yield node.lineno, f'{ast.unparse(node.value)}.{name}'


def test_benchmarks_read_no_private_attribute_of_another_object():
  offenders = [
      f'{path.relative_to(ROOT)}:{line}: {access}'
      for path in BENCHMARKS
      for line, access in _private_attributes(ast.parse(path.read_text()))]
  assert not offenders, offenders


def test_the_scans_catch_what_they_forbid():
  bad = ast.parse('from examples.finetune import data\n'
                  'import examples.finetune.flags\n'
                  'from examples.finetune.model import config\n'
                  'from examples.finetune import api\n'
                  'runner._compiled.items()\n'
                  'self._compiled, cls._cache, state._replace(x=1)\n'
                  'self.runner._steps\n')
  imported = {name for _, names in _imported_modules(bad) for name in names}
  assert imported - {SURFACE} == {
      'examples.finetune.data', 'examples.finetune.flags',
      'examples.finetune.model.config'}
  assert {access for _, access in _private_attributes(bad)} == {
      'runner._compiled', 'self.runner._steps'}


def _own_docstring(value) -> str:
  """The docstring written for ``value``: not inherited, and not the one
  ``namedtuple`` generates (``Name(field, ...)``)."""
  doc = vars(value).get('__doc__') if isinstance(value, type) else (
      value.__doc__)
  if not doc or doc.startswith(f'{value.__name__}('):
    return ''
  return doc


def test_every_name_of_the_api_is_documented_and_none_is_a_module():
  constants = {'GB', 'TWEETS_LABEL_WORDS', 'BATCH_AXES',
               'COLUMN_BLOCK_ELEMENTS'}  # documented in its docstring
  for name in api.__all__:
    value = getattr(api, name)
    assert not isinstance(value, types.ModuleType), name
    assert f'`{name}`' in api.__doc__, f'api\'s docstring omits {name}'
    if name not in constants:
      assert _own_docstring(value), f'api.{name} has no docstring'
  public = {name for name in vars(api) if not name.startswith('_')
            and not isinstance(getattr(api, name), types.ModuleType)}
  typing_names = {'Any', 'Callable', 'NamedTuple', 'Optional', 'Sequence'}
  assert public - typing_names == set(api.__all__)
