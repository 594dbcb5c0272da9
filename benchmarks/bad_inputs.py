"""Bad input to taco_optax and what it answers: the table of docs/api.md.

Each case is what a user passes; the script runs it and records the error's
type and message, or what the step did. ``tests/test_docs.py`` runs
:func:`table` and compares it with the committed page, so the page says what
the code does.

    python -m benchmarks.bad_inputs          # print the table
    python -m benchmarks.bad_inputs --write  # rewrite it in docs/api.md
"""

import argparse
import logging
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import taco_optax

PAGE = pathlib.Path(__file__).resolve().parents[1] / 'docs' / 'api.md'
BEGIN = '<!-- bad-inputs: written by python -m benchmarks.bad_inputs -->'
END = '<!-- bad-inputs: end -->'

DN = taco_optax.TacoDimensionNumbers
PARAMS = {'w': jnp.ones((8, 4)), 'b': jnp.zeros((4,))}
GRADS = {'w': jnp.arange(32.0).reshape(8, 4) - 9.0, 'b': jnp.ones((4,))}


def _step(tx, params=PARAMS, grads=GRADS, jit=False):
  update = jax.jit(tx.update) if jit else tx.update
  return update(grads, tx.init(params), params)


def _nan_step(name: str, value: float) -> Callable[[], str]:
  def run():
    tx = optax.inject_hyperparams(taco_optax.taco)(learning_rate=1e-3)
    state = tx.init(PARAMS)
    state = state._replace(hyperparams={**state.hyperparams,
                                        name: jnp.float32(value)})
    updates, _ = jax.jit(tx.update)(GRADS, state, PARAMS)
    nan = bool(jnp.isnan(updates['w']).all())
    return ('the step\'s updates are NaN, TACO\'s history kept '
            '(optax.apply_if_finite skips it)' if nan else 'a step')
  return run


def _schedule_negative_later():
  tx = taco_optax.taco(optax.linear_schedule(1e-3, -1e-3, 1))
  state = tx.init(PARAMS)
  _, state = jax.jit(tx.update)(GRADS, state, PARAMS)
  updates, _ = jax.jit(tx.update)(GRADS, state, PARAMS)
  return ('step 1\'s updates are NaN' if bool(jnp.isnan(updates['w']).all())
          else 'a step')


def _float0():
  params = {'w': jnp.ones((8, 4)), 'steps': jnp.array(3)}
  grads = jax.grad(lambda p: jnp.sum(p['w']) * p['steps'],
                   allow_int=True)(params)
  tx = taco_optax.taco(1e-3)
  tx.update(grads, tx.init(params), params)


def _equinox_scheduled():
  import equinox as eqx  # pylint: disable=g-import-not-at-top
  model = eqx.nn.Linear(8, 4, key=jax.random.key(0))
  dims = taco_optax.equinox.dimension_numbers(model)
  optax.inject_hyperparams(taco_optax.taco)(
      learning_rate=1e-3, weight_dimension_numbers=dims).init(
          eqx.filter(model, eqx.is_inexact_array))


def _numpy_reference():
  params = jax.tree.map(np.asarray, PARAMS)
  _step(taco_optax.taco(1e-3, implementation='reference'), params,
        jax.tree.map(np.asarray, GRADS))
  return 'a step, as optax.adamw takes NumPy arrays'


# (what the user passes, what runs it)
CASES = (
    ('`taco(-1e-3)`', lambda: taco_optax.taco(-1e-3)),
    ("`taco(float('nan'))`", lambda: taco_optax.taco(float('nan'))),
    ('`taco(1e-3, adam_learning_rate=-1.0)`',
     lambda: taco_optax.taco(1e-3, adam_learning_rate=-1.0)),
    ('`taco(optax.linear_schedule(-1e-3, 1e-3, 10)).init(params)`',
     lambda: taco_optax.taco(optax.linear_schedule(-1e-3, 1e-3, 10)).init(
         PARAMS)),
    ('`taco(optax.linear_schedule(1e-3, -1e-3, 1))`, two jitted steps',
     _schedule_negative_later),
    ('`taco(1e-3, mu=1.5)`', lambda: taco_optax.taco(1e-3, mu=1.5)),
    ('`inject_hyperparams(taco)(learning_rate=1e-3, mu=1.5).init(params)`',
     lambda: optax.inject_hyperparams(taco_optax.taco)(
         learning_rate=1e-3, mu=1.5).init(PARAMS)),
    ('injected `mu` set to 1.5 in the state, jitted update',
     _nan_step('mu', 1.5)),
    ('injected `learning_rate` set to -1e-3 in the state, jitted update',
     _nan_step('learning_rate', -1e-3)),
    ('`inject_hyperparams(taco)(learning_rate=1e-3, k=8).init(params)`',
     lambda: optax.inject_hyperparams(taco_optax.taco)(
         learning_rate=1e-3, k=8).init(PARAMS)),
    ('`taco(1e-3).init({\'fc\': {\'weight\': (32, 64), \'bias\': (32,)}})`',
     lambda: taco_optax.taco(1e-3).init(
         {'fc': {'weight': jnp.ones((32, 64)), 'bias': jnp.zeros(32)}})),
    ('`taco(1e-3).init({\'fc\': {\'w\': (32, 64), \'bias\': (32,)}})`',
     lambda: taco_optax.taco(1e-3).init(
         {'fc': {'w': jnp.ones((32, 64)), 'bias': jnp.zeros(32)}})),
    ('an Equinox routing tree under `inject_hyperparams` without '
     '`static_args`', _equinox_scheduled),
    ('`update` of a `(8, 5)` gradient for an `(8, 4)` weight, `params=None`',
     lambda: taco_optax.taco(1e-3).update(
         {'w': jnp.ones((8, 5))},
         taco_optax.taco(1e-3).init({'w': jnp.ones((8, 4))}))),
    ('NumPy params and gradients, `implementation=\'reference\'`',
     _numpy_reference),
    ('a `float0` gradient (`jax.grad(..., allow_int=True)`)', _float0),
    ("`weight_dimension_numbers={'W': TacoDimensionNumbers(), 'b': None}` "
     "for params `{'w', 'b'}`",
     lambda: taco_optax.taco(1e-3, weight_dimension_numbers={
         'W': DN(), 'b': None}).init(PARAMS)),
    ('`update_scale=-1.0`',
     lambda: taco_optax.taco(1e-3, update_scale=-1.0).init(PARAMS)),
    ('`taco(1e-3, k=0)`', lambda: taco_optax.taco(1e-3, k=0)),
)


def outcome(run: Callable[[], object]) -> str:
  """``'TypeName: message'`` of what ``run`` raises, or what it returns."""
  try:
    result = run()
  except (ValueError, TypeError) as error:
    return f'{type(error).__name__}: {error}'
  return str(result) if isinstance(result, str) else 'accepted'


def _cell(text: str) -> str:
  return ' '.join(text.split()).replace('|', '\\|')


def table() -> str:
  """The markdown table: one row per case."""
  logging.getLogger('taco_optax').setLevel(logging.ERROR)
  rows = ['| input | result |', '| --- | --- |']
  rows += [f'| {_cell(what)} | {_cell(outcome(run))} |'
           for what, run in CASES]
  return '\n'.join(rows)


def page_table(text: str) -> str:
  """The table between the markers of a page's text."""
  return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--write', action='store_true',
                      help='rewrite the table in docs/api.md')
  args = parser.parse_args()
  written = table()
  if not args.write:
    print(written)
    return
  text = PAGE.read_text()
  before, rest = text.split(BEGIN, 1)
  after = rest.split(END, 1)[1]
  PAGE.write_text(f'{before}{BEGIN}\n{written}\n{END}{after}')


if __name__ == '__main__':
  main()
