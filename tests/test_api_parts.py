"""taco()'s public pieces, its state, and the package's layout rules."""

import ast
import importlib
import pathlib
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax._src.transform import parts as _alias
from tests.support.bitwise import assert_bitwise_equal

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _params():
  return {'w': jnp.arange(12.0).reshape(4, 3) / 7, 'b': jnp.ones((3,)),
          'stack': jnp.ones((2, 3, 4))}


def _grads(seed=0):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(seed), p.shape), _params())


def test_parts_rebuild_taco_bit_for_bit():
  parts = _alias.parts_of(
      taco_optax.taco(1e-2, k=2, mu=0.5, adam_weight_decay=1e-3))
  assert parts.param_labels(_params()) == {
      'w': _alias.TACO_LABEL, 'b': _alias.ADAM_LABEL,
      'stack': _alias.ADAM_LABEL}
  tx = taco_optax.taco(1e-2, k=2, mu=0.5, adam_weight_decay=1e-3)
  by_hand = optax.partition(
      {_alias.TACO_LABEL: optax.chain(parts.direction, parts.learning_rate,
                                      parts.rounding),
       _alias.ADAM_LABEL: parts.adam}, parts.param_labels)
  params = _params()
  state, hand_state = tx.init(params), by_hand.init(params)
  for seed in range(3):
    updates, state = tx.update(_grads(seed), state, params)
    hand_updates, hand_state = by_hand.update(_grads(seed), hand_state,
                                              params)
    assert_bitwise_equal((updates, state), (hand_updates, hand_state))
  assert np.any(np.asarray(updates['w']) != 0)


def test_taco_states_round_trip_by_label():
  tx = taco_optax.taco(1e-2, k=2)
  state = tx.init(_params())
  states = _alias.taco_states(state)
  assert isinstance(states.direction, taco_optax.TacoState)
  assert states.direction.values['w'].shape == (2, 4)
  assert states.direction.values['w'].dtype == jnp.float8_e4m3fn
  assert isinstance(states.adam[0], optax.ScaleByAdamState)
  assert states.adam[0].mu['b'].shape == (3,)
  changed = states._replace(
      direction=states.direction._replace(
          exponents=jax.tree.map(lambda e: e + 1,
                                 states.direction.exponents)))
  again = _alias.taco_states(_alias.with_taco_states(state, changed))
  assert_bitwise_equal(again, changed)
  assert jax.tree.structure(_alias.with_taco_states(state, states)) == (
      jax.tree.structure(state))


@pytest.mark.parametrize('decay', [None, 0.0, 1e-3])
def test_state_structure_does_not_depend_on_injection(decay):
  kwargs = {} if decay is None else {'adam_weight_decay': decay}
  plain = taco_optax.taco(1e-2, k=2, **kwargs)
  injected = optax.inject_hyperparams(taco_optax.taco, static_args=('k',))(
      1e-2, k=2, **kwargs)
  params = _params()
  plain_state = plain.init(params)
  injected_state = injected.init(params)
  assert (jax.tree.structure(injected_state.inner_state)
          == jax.tree.structure(plain_state))
  updates, plain_state = plain.update(_grads(), plain_state, params)
  injected_updates, injected_state = injected.update(_grads(), injected_state,
                                                     params)
  # Injected numbers become float32 arrays (1 - b2 is then rounded in
  # float32), so the two agree to optax's own inject_hyperparams tolerances.
  chex.assert_trees_all_close(injected_updates, updates, rtol=1e-5)
  chex.assert_trees_all_close(injected_state.inner_state, plain_state,
                              rtol=1e-5, atol=1e-5)


def test_params_none_with_injected_default_decay():
  injected = optax.inject_hyperparams(taco_optax.taco, static_args=('k',))(
      1e-2, k=2)
  params = _params()
  updates, _ = injected.update(_grads(), injected.init(params), None)
  plain = taco_optax.taco(1e-2, k=2)
  expected, _ = plain.update(_grads(), plain.init(params), None)
  chex.assert_trees_all_close(updates, expected, rtol=1e-5, atol=0)
  assert np.count_nonzero(np.asarray(updates['w'])) == 4  # one per column


@pytest.mark.parametrize('decay', [None, 1e-3])
def test_taco_is_a_partition_of_optax_pieces_bit_for_bit(decay):
  """The default branch is optax.adam, with a decay optax.adamw.

  Rounding to nearest: stochastic rounding (the default) leaves float32
  updates alone (test_rounding.py) but adds a step count to each branch.
  """
  params = _params()
  labels = lambda p: {'w': 'matrix', 'b': 'other', 'stack': 'other'}
  other = (optax.adam(1e-2) if decay is None
           else optax.adamw(1e-2, weight_decay=decay))
  reference = optax.partition(
      {'matrix': optax.chain(taco_optax.scale_by_taco(k=2),
                             optax.scale_by_learning_rate(1e-2)),
       'other': other}, labels)
  tx = taco_optax.taco(1e-2, k=2, adam_weight_decay=decay, rounding='nearest')
  state, reference_state = tx.init(params), reference.init(params)
  step = jax.jit(lambda tx, g, s: tx.update(g, s, params), static_argnums=0)
  for seed in range(3):
    updates, state = step(tx, _grads(seed), state)
    expected, reference_state = step(reference, _grads(seed), reference_state)
    assert_bitwise_equal(updates, expected)
  states = _alias.taco_states(state)
  inner = reference_state.inner_states
  assert_bitwise_equal((states.direction, states.learning_rate),
                       inner['matrix'].inner_state)
  assert_bitwise_equal(jax.tree.leaves(states.adam),
                       jax.tree.leaves(inner['other'].inner_state))


@pytest.mark.parametrize('factory', [taco_optax.taco, lambda lr, **kw:
                                     taco_optax.scale_by_taco(**kw)])
def test_complex_matrix_is_refused(factory):
  params = {'w': jnp.ones((3, 2), jnp.complex64)}
  tx = factory(1e-2, k=2)
  with pytest.raises(ValueError, match='complex-valued leaf of shape'):
    tx.init(params)


@pytest.mark.parametrize('module, missing, extra', [
    ('nnx', 'flax', 'flax'), ('linen', 'flax', 'flax'),
    ('equinox', 'equinox', 'equinox')])
def test_framework_modules_name_their_extra(monkeypatch, module, missing,
                                            extra):
  monkeypatch.setitem(sys.modules, missing, None)
  monkeypatch.delitem(sys.modules, f'taco_optax.{module}', raising=False)
  if module in vars(taco_optax):  # imported already: forget it
    monkeypatch.delattr(taco_optax, module)
  with pytest.raises(ImportError, match=rf'taco_optax\[{extra}\]'):
    importlib.import_module(f'taco_optax.{module}')
  with pytest.raises(ImportError, match=rf'taco_optax\[{extra}\]'):
    getattr(taco_optax, module)


def test_tunix_module_names_the_tunix_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, 'tunix.sft', None)
  monkeypatch.delitem(sys.modules, 'taco_optax.tunix', raising=False)
  if 'tunix' in vars(taco_optax):  # imported already: forget it
    monkeypatch.delattr(taco_optax, 'tunix')
  with pytest.raises(ImportError, match=r'taco_optax\[tunix\]'):
    getattr(taco_optax, 'tunix')


def test_tunix_module_exports_the_trainer():
  pytest.importorskip('tunix')
  assert list(taco_optax.tunix.__all__) == ['LayerwisePeftTrainer']


PACKAGE = ROOT / 'taco_optax'
SRC = PACKAGE / '_src'
SUBPACKAGES = sorted(p.name for p in SRC.iterdir()
                     if (p / '__init__.py').exists())


def _imports(path):
  """``(module, names)`` of every import in ``path`` (names: ``()`` for a
  plain ``import``)."""
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from ((alias.name, ()) for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module, tuple(alias.name for alias in node.names)


def _package_of(path):
  """The subpackage ``path`` belongs to, or None for a public module."""
  parts = path.relative_to(PACKAGE).parts
  return parts[1] if parts[0] == '_src' and len(parts) > 2 else None


def _surface(package):
  return importlib.import_module(f'taco_optax._src.{package}')


def test_nothing_outside_the_package_imports_its_private_modules():
  offenders = [
      f'{path.relative_to(ROOT)}: {module}'
      for folder in ('examples', 'benchmarks')
      for path in sorted((ROOT / folder).rglob('*.py'))
      for module, names in _imports(path)
      for name in (module, *(f'{module}.{n}' for n in names))
      if name.startswith('taco_optax._')]
  assert not offenders, offenders


def test_the_six_rooms():
  assert SUBPACKAGES == ['integrations', 'kernels', 'layerwise', 'routing',
                         'sharding', 'transform']
  assert sorted(p.name for p in PACKAGE.glob('*.py')) == [
      '__init__.py', 'equinox.py', 'layerwise.py', 'linen.py', 'nnx.py',
      'tunix.py']


def _reaches(path):
  """Every import of another subpackage (or, from a public module, of any)
  that does not go through that subpackage's surface."""
  own = _package_of(path)
  for module, names in _imports(path):
    if not module.startswith('taco_optax._src'):
      continue
    parts = module.split('.')
    if module == 'taco_optax._src':  # from taco_optax._src import kernels
      bad = [n for n in names if n not in SUBPACKAGES]
      if bad:
        yield f'{module}: {bad}'
      continue
    target = parts[2]
    if target == own:
      continue
    if len(parts) > 3:  # a module behind another subpackage's surface
      yield module
      continue
    surface = _surface(target)
    allowed = set(surface.__all__) | set(getattr(surface, 'OPTIONAL_MODULES',
                                                 ()))
    bad = [n for n in names if n not in allowed]
    if bad:
      yield f'{module}: {bad} (not in its __all__)'


def _offenders(finds):
  """``finds(path)``'s findings over every module, each named by its file."""
  return [f'{path.relative_to(ROOT)}: {found}'
          for path in sorted(PACKAGE.rglob('*.py')) for found in finds(path)]


def test_subpackages_meet_only_through_their_surfaces():
  offenders = _offenders(_reaches)
  assert not offenders, offenders


def test_optional_modules_are_imported_by_their_public_module_only():
  optional = {f'taco_optax._src.{package}.{name}': name
              for package in SUBPACKAGES
              for name in getattr(_surface(package), 'OPTIONAL_MODULES', ())}
  importers = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    for module, names in _imports(path):
      for name in (module, *(f'{module}.{n}' for n in names)):
        if name in optional:
          importers.setdefault(optional[name], set()).add(
              str(path.relative_to(PACKAGE)))
  assert importers == {'equinox_routes': {'equinox.py'},
                       'linen_routes': {'linen.py'},
                       'nnx_routes': {'nnx.py'},
                       'tunix_api': {'tunix.py'},
                       'tunix_model': {'tunix.py'}}


def _private_uses(path):
  """``module._name`` and ``from module import _name`` across modules."""
  tree = ast.parse(path.read_text())
  modules = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.startswith('taco_optax')):
      for alias in node.names:
        if alias.name.startswith('_') and not alias.name.startswith('__'):
          yield f'from {node.module} import {alias.name}'
        modules.add(alias.asname or alias.name)
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in modules and node.attr.startswith('_')
        and not node.attr.startswith('__')):
      yield f'{node.value.id}.{node.attr} (line {node.lineno})'


def test_no_module_reaches_into_another_modules_private_names():
  offenders = _offenders(_private_uses)
  assert not offenders, offenders


def test_surfaces_only_re_export():
  for package in SUBPACKAGES:
    tree = ast.parse((SRC / package / '__init__.py').read_text())
    for node in tree.body:
      assert isinstance(node, (ast.ImportFrom, ast.Assign, ast.Expr)), (
          package, ast.dump(node)[:80])
    surface = _surface(package)
    assert sorted(surface.__all__) == sorted(set(surface.__all__)), package
    for name in surface.__all__:
      assert hasattr(surface, name), (package, name)


def _graph(node_of_path, node_of_import):
  """Import edges between nodes (``None``: not a node) of the package."""
  graph = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    node = node_of_path(path)
    if node is None:
      continue
    graph.setdefault(node, set())
    for module, names in _imports(path):
      for name in (module, *(f'{module}.{n}' for n in names)):
        target = node_of_import(name)
        if target is not None and target != node:
          graph[node].add(target)
  return graph


def _assert_acyclic(graph):
  visiting, done = set(), set()

  def visit(node, trail):
    if node in done:
      return
    assert node not in visiting, ' -> '.join(trail + [node])
    visiting.add(node)
    for child in sorted(graph.get(node, ())):
      visit(child, trail + [node])
    visiting.discard(node)
    done.add(node)

  for node in sorted(graph):
    visit(node, [])


def _src_parts(name):
  parts = name.split('.')
  return parts[2:] if parts[:2] == ['taco_optax', '_src'] else []


def test_subpackages_have_no_import_cycle():
  def package_of_import(name):
    parts = _src_parts(name)
    return parts[0] if parts and parts[0] in SUBPACKAGES else None
  graph = _graph(_package_of, package_of_import)
  _assert_acyclic(graph)
  assert graph == {'routing': set(), 'sharding': set(),
                   'kernels': {'sharding'},
                   'transform': {'kernels', 'routing', 'sharding'},
                   'layerwise': {'kernels', 'routing', 'sharding', 'transform'},
                   'integrations': {'layerwise'}}


def test_modules_have_no_import_cycle():
  def module_of_path(path):
    if path.name == '__init__.py' or _package_of(path) is None:
      return None
    return '.'.join(path.relative_to(SRC).with_suffix('').parts)

  def module_of_import(name):
    parts = _src_parts(name)
    if len(parts) < 2 or not (SRC / parts[0] / f'{parts[1]}.py').exists():
      return None
    return f'{parts[0]}.{parts[1]}'
  _assert_acyclic(_graph(module_of_path, module_of_import))


def _module_lengths(folders):
  return {f'{path.relative_to(ROOT)}': len(path.read_text().splitlines())
          for folder in folders for path in (ROOT / folder).rglob('*.py')}


def test_no_library_module_is_over_400_lines():
  long = [f'{p} ({n} lines)' for p, n in _module_lengths(['taco_optax']).items()
          if n > 400]
  assert not long, long


def test_example_and_benchmark_modules_stay_one_concept():
  # Concepts decide their files; 400 lines is a hint to look (warned), twice
  # that is two concepts in one file (an error).
  lengths = _module_lengths(['examples', 'benchmarks'])
  hinted = [f'{p} ({n} lines)' for p, n in lengths.items() if 400 < n <= 800]
  if hinted:
    warnings.warn(f'modules over the 400-line hint: {hinted}')
  long = [f'{p} ({n} lines)' for p, n in lengths.items() if n > 800]
  assert not long, long


def test_no_function_is_over_80_code_lines():
  long = []
  for folder in ('taco_optax', 'examples'):
    for path in (ROOT / folder).rglob('*.py'):
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
          lines = node.end_lineno - node.lineno + 1
          first = node.body[0]
          if isinstance(first, ast.Expr) and isinstance(first.value,
                                                        ast.Constant):
            lines -= first.end_lineno - first.lineno + 1
          if lines > 80:
            long.append(f'{path.relative_to(ROOT)}:{node.lineno} '
                        f'{node.name} ({lines} lines)')
  assert not long, long


def test_top_level_is_what_optax_would_export():
  assert sorted(taco_optax.__all__) == [
      'TacoDimensionNumbers', 'TacoState', 'routing_report', 'scale_by_taco',
      'state_shardings', 'stochastic_rounding', 'taco',
      'trace_dimension_numbers']
  assert sorted(taco_optax.layerwise.__all__) == [
      'LayeredLoss', 'TableLookup', 'TableProjection', 'TrainStep',
      'layered_loss_of', 'remat_layers', 'table_mean_bytes', 'train_step']
  with pytest.raises(AttributeError, match='column_block_elements='):
    taco_optax.layerwise.COLUMN_BLOCK_ELEMENTS  # pylint: disable=pointless-statement
  with pytest.raises(AttributeError, match=r'layerwise\.train_step'):
    taco_optax.layerwise_train_step  # pylint: disable=pointless-statement
  with pytest.raises(AttributeError, match='has no attribute'):
    taco_optax.taco_parts  # pylint: disable=pointless-statement


def test_layerwise_step_refuses_anything_but_taco_itself():
  loss = taco_optax.layerwise.LayeredLoss(
      embed=lambda outer, x: x, layer=lambda p, h, x: h,
      head=lambda outer, h, x: h.sum())
  tx = taco_optax.taco(1e-2)
  for wrapped in (optax.chain(tx), optax.adamw(1e-2),
                  optax.inject_hyperparams(taco_optax.taco)(1e-2)):
    with pytest.raises(ValueError, match='taco_optax.taco'):
      taco_optax.layerwise.train_step(loss, wrapped)
  assert callable(taco_optax.layerwise.train_step(loss, tx))


@pytest.mark.parametrize('wrap, named, instead', [
    (lambda tx: optax.chain(optax.clip_by_global_norm(1.0), tx),
     'optax.chain', 'clip_global_norm=c'),
    (lambda tx: optax.inject_hyperparams(taco_optax.taco,
                                         static_args=('k',))(1e-2),
     'optax.inject_hyperparams', 'taco(learning_rate=schedule)'),
    (lambda tx: optax.MultiSteps(tx, 2), 'optax.MultiSteps',
     'accumulation_steps=A'),
    (lambda tx: optax.adamw(1e-2), 'optax.chain', 'no layer-wise'),
    (lambda tx: tx._replace(update=lambda *args: tx.update(*args)),
     'a transformation built by', 'taco_optax.taco'),
])
def test_wrappers_are_refused_naming_the_wrapper(wrap, named, instead):
  wrapped = wrap(taco_optax.taco(1e-2))
  with pytest.raises(ValueError) as error:
    _alias.parts_of(wrapped, user='This test')
  message = str(error.value)
  assert message.startswith('This test applies the pieces'), message
  assert named in message and instead in message, message


def test_parts_travel_with_the_transformation():
  tx = taco_optax.taco(1e-2, k=2, mu=0.5)
  parts = _alias.parts_of(tx)
  assert parts.mu == 0.5 and parts.update_topk == 1
  assert _alias.parts_of(taco_optax.taco(1e-2, k=2, mu=0.5)) is not parts
  nnx = pytest.importorskip('taco_optax.nnx')
  assert _alias.parts_of(nnx.for_nnx_optimizer(tx)) is parts
  state = tx.init(_params())
  assert jax.tree.structure(_alias.with_taco_states(
      state, _alias.taco_states(state))) == jax.tree.structure(state)
