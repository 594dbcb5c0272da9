"""Every name the prose gives exists: paths, modules and dotted names.

The README, the docs pages (guides and ``docs/measured/``), the docstrings of
``taco_optax/``, ``examples/`` and ``benchmarks/`` and the comments of
``pyproject.toml`` name files, modules and attributes in backticks. A rename
leaves them pointing at nothing unless something reads them; this test does,
with the rules below (a token that fits none is not a name and is skipped):

* a path: a token of path characters whose first part is a top-level folder
  of the repository (``docs/memory.md``, ``taco_optax/_src/kernels/csrc/``),
  with an optional ``:line`` or ``::test`` suffix, must exist from the root;
  in a markdown page a bare ``NAME.md``, backticked or not, must exist beside
  the page, in ``docs/`` or at the root;
* a dotted name starting with ``taco_optax``, ``examples``, ``benchmarks`` or
  ``tests`` (call parentheses dropped) must be a module, or an attribute of
  one, read from the source without importing it (so a benchmark's optional
  dependency is not needed): a top-level name of the module (a def, a class,
  an assignment, an import), then a name in that class's body or an
  attribute of the imported object;
* ``python -m MODULE`` must name a module of the repository;
* in a docstring, a dotted token whose first part is a module-level name of
  the docstring's own module, or a sibling module, is resolved from there;
  a token ``_name`` or ``_name.attr`` (a private module or object) must be a
  top-level name of its module or a module of its package.

Names of other libraries (``jax.grad``), flags and shell text are not
checked. In ``pyproject.toml`` comments, unquoted paths count as well.
"""

import ast
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ('taco_optax', 'examples', 'benchmarks', 'tests')
# Folders a run writes (runs/, checkpoints/, ...) are ignored by git: a path
# into one names an output, which need not exist when the tests run.
_OUTPUT_DIRS = frozenset(
    line.strip().strip('/') for line in
    (ROOT / '.gitignore').read_text().splitlines()
    if line.strip().endswith('/') and not line.startswith('#'))
TOP_DIRS = frozenset(p.name for p in ROOT.iterdir()
                     if p.is_dir() and not p.name.startswith(('.', '_'))
                     and p.name not in _OUTPUT_DIRS) | {'.ci'}
_SPAN = re.compile(r'``([^`]+?)``|`([^`\n]+)`')
_PATH = re.compile(r'[\w.\-/]+')
_DOTTED = re.compile(r'[A-Za-z_]\w*(\.[A-Za-z_]\w*)*')
_LINE_SUFFIX = re.compile(r'(:\d+([-,]\d+)*|::[\w\[\]-]+)$')
_CALL = re.compile(r'^([\w.]+)\(.*\)$', re.S)
_PYTHON_M = re.compile(r'python3? -m ([\w.]+)')
_FENCE = re.compile(r'^\s*```')
_PROSE_PAGE = re.compile(
    r'(?<![\w/.\-(\[`])((?:[\w.\-]+/)*[\w\-]+\.md)\b(?![\w/`)\]])')
_FILE_SUFFIXES = frozenset(('md', 'py', 'json', 'jsonl', 'toml', 'txt', 'cc',
                            'h', 'png', 'gguf', 'safetensors', 'sh', 'cfg'))
# Private names that are not ours: a NamedTuple's methods, a throwaway.
_NOT_NAMES = frozenset(('_', '_replace', '_asdict', '_fields', '_make'))


# --- resolving names from source ------------------------------------------

def _module_file(dotted):
  """The file (or package ``__init__``) of a repository module, or None."""
  base = ROOT.joinpath(*dotted.split('.'))
  for candidate in (base.with_suffix('.py'), base / '__init__.py'):
    if candidate.is_file():
      return candidate
  if base.is_dir() and dotted.split('.')[0] in PACKAGES:
    return base  # a namespace package (examples/, benchmarks/, tests/)
  return None


@functools.lru_cache(maxsize=None)
def _top_level(path):
  """Name -> its defining node (or the dotted origin of an import)."""
  if path.is_dir():
    return {}
  tree = ast.parse(path.read_text())
  names = {}
  package = _package_of(path)

  def visit(body):
    for node in body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                           ast.ClassDef)):
        names[node.name] = node
      elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [
            node.target]
        for target in targets:
          for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
              names[sub.id] = node
      elif isinstance(node, ast.Import):
        for alias in node.names:
          if alias.asname:
            names[alias.asname] = alias.name
          else:
            top = alias.name.split('.')[0]
            names[top] = top
      elif isinstance(node, ast.ImportFrom):
        origin = node.module or ''
        if node.level:
          parts = package.split('.')
          parts = parts[:len(parts) - node.level + 1]
          origin = '.'.join(parts + ([node.module] if node.module else []))
        for alias in node.names:
          names[alias.asname or alias.name] = f'{origin}.{alias.name}'
      elif isinstance(node, (ast.If, ast.Try)):
        visit(node.body)
        visit(getattr(node, 'orelse', []))
        for handler in getattr(node, 'handlers', []):
          visit(handler.body)
        visit(getattr(node, 'finalbody', []))

  visit(tree.body)
  return names


def _package_of(path):
  rel = path.relative_to(ROOT).with_suffix('')
  parts = list(rel.parts)
  if parts[-1] == '__init__':
    parts = parts[:-1]
    return '.'.join(parts)
  return '.'.join(parts[:-1])


def _class_has(node, name):
  for child in node.body:
    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                          ast.ClassDef)) and child.name == name:
      return True
    if isinstance(child, ast.AnnAssign) and isinstance(
        child.target, ast.Name) and child.target.id == name:
      return True
    if isinstance(child, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in child.targets):
      return True
  # A base class of the repository may define it; one we cannot read
  # (a NamedTuple's _replace, a flax Module's methods) is given the benefit.
  return bool(node.bases)


def _resolves(dotted, depth=0):
  """Whether `dotted` (first part a repository package) names something."""
  if depth > 8:
    return False
  parts = dotted.split('.')
  if parts[0] not in PACKAGES:
    return True  # an object of another library: not ours to check
  for cut in range(len(parts), 0, -1):
    path = _module_file('.'.join(parts[:cut]))
    if path is not None:
      return _attribute_chain(path, '.'.join(parts[:cut]), parts[cut:], depth)
  return False


def _attribute_chain(path, module, rest, depth):
  if not rest:
    return True
  if path.is_dir():
    return False
  names = _top_level(path)
  if rest[0] not in names:
    # A package's __init__ leaves its submodules importable without naming
    # them.
    sub = _module_file(f'{module}.{rest[0]}')
    return (path.name == '__init__.py' and sub is not None
            and _attribute_chain(sub, f'{module}.{rest[0]}', rest[1:], depth))
  target = names[rest[0]]
  if isinstance(target, str):  # imported: follow it
    return _resolves('.'.join([target] + rest[1:]), depth + 1)
  if len(rest) == 1:
    return True
  if isinstance(target, ast.ClassDef):
    return _class_has(target, rest[1])
  return True  # an attribute of a value: not followed


# --- finding the names ------------------------------------------------------

def _spans(text, first_line):
  """(line, token) for every backticked span of `text`."""
  for match in _SPAN.finditer(text):
    token = (match.group(1) or match.group(2)).strip()
    yield first_line + text.count('\n', 0, match.start()), token


def _markdown_spans(path):
  """(line, token) for every backticked span outside code blocks, and every
  page name (``NAME.md``, ``docs/NAME.md``) the prose gives outside them."""
  lines = path.read_text().splitlines()
  in_fence = False
  for number, line in enumerate(lines, 1):
    if _FENCE.match(line):
      in_fence = not in_fence
      continue
    if not in_fence:
      yield from _spans(line, number)
      # Link targets are tests/test_readme.py's to check.
      prose = re.sub(r'\]\([^)]*\)', '', re.sub(r'`[^`]*`', '', line))
      for match in _PROSE_PAGE.finditer(prose):
        yield number, match.group(1)


def _docstrings(path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr)
          and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
        yield body[0].lineno, body[0].value.value


def _problem(token, *, page_dir=None, module_path=None):
  """Why `token` names nothing (a string), or None when it resolves or is
  not a name."""
  command = _PYTHON_M.search(token)
  if command:
    name = command.group(1)
    if name.split('.')[0] in PACKAGES and _module_file(name) is None:
      return f'no module {name}'
    return None
  called = _CALL.match(token)
  if called:
    token = called.group(1)
  token = token.rstrip('.,;')
  if not _PATH.fullmatch(token):
    return None
  bare = _LINE_SUFFIX.sub('', token)
  first = bare.split('/')[0]
  if '/' in bare and first in TOP_DIRS:
    return None if (ROOT / bare).exists() else f'no file {bare}'
  if '/' not in bare and bare.endswith('.md') and page_dir is not None:
    if any((where / bare).exists()
           for where in (page_dir, ROOT / 'docs', ROOT)):
      return None
    return f'no file {bare} (beside the page, in docs/ or at the root)'
  if not _DOTTED.fullmatch(token) or token in _NOT_NAMES:
    return None
  parts = token.split('.')
  if len(parts) > 1 and parts[-1] in _FILE_SUFFIXES:
    return None  # a file name (``config.json``), not an attribute
  if parts[0] in PACKAGES:
    return None if _resolves(token) else f'no name {token}'
  if module_path is not None:
    names = _top_level(module_path)
    package = _package_of(module_path)
    if parts[0] in names:
      origin = names[parts[0]]
      if isinstance(origin, str):
        return (None if _resolves('.'.join([origin] + parts[1:]))
                else f'no name {token} (via {origin})')
      if len(parts) > 1 and isinstance(origin, ast.ClassDef):
        return None if _class_has(origin, parts[1]) else f'no name {token}'
      return None
    sibling = f'{package}.{parts[0]}'
    if _module_file(sibling) is not None:
      return None if _resolves('.'.join([sibling] + parts[1:])) else (
          f'no name {token} (in {sibling})')
    if parts[0].startswith('_') and not parts[0].startswith('__'):
      return f'no module or name {parts[0]} in {package}'
  return None


def _markdown_pages():
  pages = [ROOT / 'README.md'] + sorted((ROOT / 'docs').rglob('*.md'))
  return [p for p in pages if p.is_file()]


def _python_modules():
  return sorted(p for package in ('taco_optax', 'examples', 'benchmarks')
                for p in (ROOT / package).rglob('*.py'))


def _stale_names():
  """'file:line: missing name' for every name that does not resolve."""
  found = []
  for page in _markdown_pages():
    for line, token in _markdown_spans(page):
      why = _problem(token, page_dir=page.parent)
      if why:
        found.append(f'{page.relative_to(ROOT)}:{line}: {why}')
  for module in _python_modules():
    for first_line, doc in _docstrings(module):
      for line, token in _spans(doc, first_line):
        why = _problem(token, module_path=module)
        if why:
          found.append(f'{module.relative_to(ROOT)}:{line}: {why}')
  pyproject = ROOT / 'pyproject.toml'
  for number, text in enumerate(pyproject.read_text().splitlines(), 1):
    if '#' not in text:
      continue
    comment = text.split('#', 1)[1]
    tokens = [token for _, token in _spans(comment, number)]
    tokens += re.findall(r'[\w.\-]+(?:/[\w.\-]*)+', comment)
    for token in tokens:
      why = _problem(token, page_dir=ROOT)
      if why:
        found.append(f'pyproject.toml:{number}: {why}')
  return sorted(set(found))


def test_every_backticked_name_exists():
  stale = _stale_names()
  assert not stale, 'names that do not exist:\n' + '\n'.join(stale)


@pytest.mark.parametrize('token, stale', [
    ('docs/measured/memory.md', False),
    ('docs/memory.md', True),
    ('FACTS.md', True),
    ('layerwise.md', False),
    ('taco_optax/_src/kernels/csrc/', False),
    ('taco_optax/csrc/', True),
    ('tests/test_readme.py::test_relative_links', False),
    ('taco_optax.layerwise.train_step', False),
    ('taco_optax.layerwise_train_step(loss, lr)', True),
    ('taco_optax.TacoState', False),
    ('python -m benchmarks.memory --write docs/x.md', False),
    ('python -m benchmarks.no_such_script', True),
    ('examples.finetune', False),
    ('jax.grad', False),
    ('--grad-accum', False),
])
def test_the_rules_tell_a_stale_name(token, stale):
  # The checker itself can fail: a planted stale name of each kind is caught.
  assert (_problem(token, page_dir=ROOT / 'docs') is not None) == stale
