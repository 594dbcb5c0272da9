"""optax.inject_hyperparams cannot misroute taco's leaves.

A callable ``weight_dimension_numbers`` / ``update_scale`` must be in
``static_args`` (then it routes exactly as ``taco(...)``); left out, optax
would call it with the step count, so taco refuses it. Trees need nothing.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from tests.support import bitwise

DN = taco_optax.TacoDimensionNumbers
TACO_LEAVES = ('emb', 'stack', 'w')


def _params():
  rng = np.random.default_rng(0)
  shapes = {'w': (6, 10), 'stack': (2, 6, 10), 'b': (10,), 'emb': (12, 6)}
  return {name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
          for name, shape in shapes.items()}


def _dims(params):
  del params
  return {'w': DN(), 'stack': DN(1, 2), 'b': None, 'emb': DN(1, 0)}


def _scales(params):
  del params
  return {'w': None, 'stack': 0.5, 'b': None, 'emb': 1.0}


ROUTING = {'weight_dimension_numbers': _dims, 'update_scale': _scales}


def _run(tx, steps=3):
  params = _params()
  state, update = tx.init(params), jax.jit(tx.update)
  out = []
  for step in range(steps):
    grads = jax.tree.map(
        lambda p, s=step: jax.random.normal(jax.random.key(s), p.shape),
        params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    out.append(updates)
  return out


@pytest.mark.parametrize('form', ['callable', 'tree'])
@pytest.mark.parametrize('names', [('weight_dimension_numbers',),
                                   ('update_scale',),
                                   ('weight_dimension_numbers',
                                    'update_scale')])
def test_the_recipe_routes_exactly_as_taco(names, form):
  routing = {name: ROUTING[name] if form == 'callable'
             else ROUTING[name](_params()) for name in names}
  static = ('k',) + (names if form == 'callable' else ())
  injected = optax.inject_hyperparams(taco_optax.taco, static_args=static)(
      1e-2, k=4, **routing)
  plain = taco_optax.taco(1e-2, k=4, **routing)
  taco_leaves = (TACO_LEAVES if 'weight_dimension_numbers' in names
                 else ('emb', 'w'))  # the default: rank-2 leaves only
  for got, expected in zip(_run(injected), _run(plain)):
    bitwise.assert_bitwise_equal({n: got[n] for n in taco_leaves},
                                 {n: expected[n] for n in taco_leaves})
    # Adam's numbers become float32 arrays under injection (1 - b2 rounds).
    chex.assert_trees_all_close(
        {n: got[n] for n in got if n not in taco_leaves},
        {n: expected[n] for n in got if n not in taco_leaves}, rtol=1e-5)
  default = _run(taco_optax.taco(1e-2, k=4))[0]
  routed = _run(plain)[0]
  assert any(not np.array_equal(routed[n], default[n]) for n in TACO_LEAVES)


def test_a_number_update_scale_becomes_an_array_and_routes_the_same():
  injected = optax.inject_hyperparams(taco_optax.taco, static_args=('k',))(
      1e-2, k=4, update_scale=0.25)
  plain = taco_optax.taco(1e-2, k=4, update_scale=0.25)
  for got, expected in zip(_run(injected), _run(plain)):
    bitwise.assert_bitwise_equal(got['w'], expected['w'])
    assert set(np.unique(np.abs(got['w']))) == {0.0, np.float32(2.5e-3)}


@pytest.mark.parametrize('factory', [taco_optax.taco,
                                     taco_optax.scale_by_taco])
@pytest.mark.parametrize('names', [('weight_dimension_numbers',),
                                   ('update_scale',),
                                   ('weight_dimension_numbers',
                                    'update_scale')])
def test_a_callable_left_out_of_static_args_is_refused(factory, names):
  args = (1e-2,) if factory is taco_optax.taco else ()
  tx = optax.inject_hyperparams(factory, static_args=('k',))(
      *args, k=4, **{name: ROUTING[name] for name in names})
  static = ', '.join(repr(name) for name in ('k',) + names)
  with pytest.raises(ValueError, match=(
      f'treats {", ".join(names)} as a schedule.*'
      rf'static_args=\({static}\)')):
    tx.init(_params())


def test_a_callable_dtype_left_out_of_static_args_is_refused():
  tx = optax.inject_hyperparams(taco_optax.taco, static_args=('k',))(
      1e-2, k=4, values_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="static_args=\\('k', 'values_dtype'\\)"):
    tx.init(_params())
  tx = optax.inject_hyperparams(taco_optax.taco,
                                static_args=('k', 'values_dtype'))(
                                    1e-2, k=4, values_dtype=jnp.bfloat16)
  state = tx.init(_params())
  values = state.inner_state.inner_states['taco'].inner_state[0].values
  assert values['w'].dtype == jnp.bfloat16


def test_an_optax_caller_without_its_schedules_is_loud():
  """An optax that renamed inject_hyperparams's local (or any optax function
  that builds taco without it) makes the guard raise, never pass silently."""
  namespace = {'__name__': 'optax.schedules._renamed',
               'taco': taco_optax.taco, 'scale_by_taco':
               taco_optax.scale_by_taco}
  exec('def build_taco():\n  return taco(1e-2)\n'  # pylint: disable=exec-used
       'def build_direction():\n  return scale_by_taco()\n', namespace)
  for build in ('build_taco', 'build_direction'):
    with pytest.raises(RuntimeError, match='no `sched_hps`.*pyproject.toml'):
      namespace[build]()


def test_runtime_optax_is_pinned_to_the_range_the_guard_knows():
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  requirements = importlib.metadata.requires('taco_optax')
  (optax_pin,) = [r for r in requirements if re.match(r'optax\b', r)
                  and 'extra' not in r]
  specifiers = set(optax_pin[len('optax'):].replace(' ', '').split(','))
  assert specifiers == {'>=0.2.6', '<0.2.9'}, optax_pin
  release = tuple(int(x) for x in optax.__version__.split('.')[:3])
  assert (0, 2, 6) <= release < (0, 2, 9), optax.__version__
