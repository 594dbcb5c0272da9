"""taco()'s public pieces, its state structure, and the package's layout rules."""

import ast
import importlib
import pathlib
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax import _alias
from tests.bitwise import assert_bitwise_equal

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


def test_nnx_module_names_the_flax_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, 'flax', None)
  monkeypatch.delitem(sys.modules, 'taco_optax.nnx', raising=False)
  if 'nnx' in vars(taco_optax):  # imported already: forget it
    monkeypatch.delattr(taco_optax, 'nnx')
  with pytest.raises(ImportError, match=r'taco_optax\[flax\]'):
    importlib.import_module('taco_optax.nnx')
  with pytest.raises(ImportError, match=r'taco_optax\[flax\]'):
    getattr(taco_optax, 'nnx')


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


def _imports(path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
      yield from (f'{node.module}.{alias.name}' for alias in node.names)


def test_nothing_outside_the_package_imports_its_private_modules():
  offenders = [
      f'{path.relative_to(ROOT)}: {name}'
      for folder in ('examples', 'benchmarks')
      for path in sorted((ROOT / folder).rglob('*.py'))
      for name in _imports(path)
      if name.startswith('taco_optax._')]
  assert not offenders, offenders


def test_package_modules_have_no_import_cycle():
  package = ROOT / 'taco_optax'
  graph = {}
  for path in package.glob('*.py'):
    module = f'taco_optax.{path.stem}'
    graph[module] = {name for name in _imports(path)
                     if name.startswith('taco_optax.') and
                     (package / f'{name.split(".")[1]}.py').exists()}
    graph[module] = {'.'.join(name.split('.')[:2]) for name in graph[module]}
  graph.pop('taco_optax.__init__', None)
  visiting, done = set(), set()

  def visit(module, trail):
    if module in done:
      return
    assert module not in visiting, ' -> '.join(trail + [module])
    visiting.add(module)
    for child in graph.get(module, ()):
      visit(child, trail + [module])
    visiting.discard(module)
    done.add(module)

  for module in graph:
    visit(module, [])


def test_no_module_is_over_400_lines():
  long = [f'{path.relative_to(ROOT)} ({n} lines)'
          for folder in ('taco_optax', 'examples', 'benchmarks')
          for path in (ROOT / folder).rglob('*.py')
          if (n := len(path.read_text().splitlines())) > 400]
  assert not long, long


def test_top_level_is_what_optax_would_export():
  assert sorted(taco_optax.__all__) == [
      'TacoDimensionNumbers', 'TacoState', 'routing_report', 'scale_by_taco',
      'state_shardings', 'stochastic_rounding', 'taco']
  assert sorted(taco_optax.layerwise.__all__) == [
      'COLUMN_BLOCK_ELEMENTS', 'LayeredLoss', 'TableLookup',
      'TableProjection', 'TrainStep', 'train_step']
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
