"""optax's common optimizer suites, run with taco_optax's optimizers.

optax checks every optimizer it ships with one common suite: convergence on
small targets, ``inject_hyperparams`` equivalence, updates in the params'
dtype, ``MultiSteps``, learning-rate schedules, extra ``update`` arguments, no
recompilation on the second step, state stable in shape and dtype. The suites
are ``optax/contrib/_common_test.py`` and the common part (``AliasTest``) of
``optax/_src/alias_test.py``; the optax wheel ships both. This file reads their
source from the installed optax (written against 0.2.8), puts our optimizers in
place of optax's lists and exposes the resulting test classes to pytest.

Assertions, tolerances and step counts are optax's. The only edits are the
suites' own extension points: the optimizer lists and name look-up, and the
hyperparameters that ``inject_hyperparams`` must keep static (``k`` and
``update_topk`` set state shapes, as muon's ``ns_steps`` sets its loop). Of
``alias_test.py`` the LBFGS tests (and their scipy/sklearn imports) are left
out, and ``test_explicit_dtype``, which checks optax's own sgd and adam.
"""

import importlib.util
import inspect
from typing import Optional, Union

import jax
import optax

import taco_optax

SUITE_OPTAX_VERSION = '0.2.8'

# Shape-determining ints: static under inject_hyperparams.
STATIC_ARGS = ('k', 'update_topk')


def _taco_matrices(params):
  """Rank-2 leaves are TACO matrices; other leaves pass through unchanged."""
  return jax.tree.map(
      lambda p: taco_optax.TacoDimensionNumbers() if p.ndim == 2 else None,
      params)


def chained_scale_by_taco(
    learning_rate: optax.ScalarOrSchedule,
    k: Optional[int] = 16,
    mu: Union[float, jax.Array] = 0.95,
) -> optax.GradientTransformation:
  """``scale_by_taco`` chained with a learning rate, SGD on non-matrices.

  The suites' targets are mostly vectors, which ``scale_by_taco`` passes
  through when their dimension numbers are ``None``; this covers the bare
  direction composed by hand, as a user of ``optax.chain`` would.

  Args:
    learning_rate: step size (or schedule) of every leaf.
    k: history entries per column.
    mu: history EMA decay.

  Returns:
    ``chain(scale_by_taco(k, mu), scale_by_learning_rate(learning_rate))``.
  """
  return optax.chain(
      taco_optax.scale_by_taco(k, mu, weight_dimension_numbers=_taco_matrices),
      optax.scale_by_learning_rate(learning_rate))


FACTORIES = {
    'taco': taco_optax.taco,
    'chained_scale_by_taco': chained_scale_by_taco,
}

# The paper's style of fixed learning rate. TACO's sign steps end in a limit
# cycle of about one step around the optimum, so the suites' 3e-2 tolerance
# needs a learning rate below it. On the contrib suite's 30,000 steps 1e-3 to
# 3e-2 pass, 1e-1 fails the matrix targets (mu=0.95) and 1e-4 is too slow.
TACO_OPTIMIZERS = (
    {'opt_name': 'taco', 'opt_kwargs': {'learning_rate': 1e-2}},
    {'opt_name': 'taco',
     'opt_kwargs': {'learning_rate': 1e-2, 'adam_weight_decay': 1e-4}},
    {'opt_name': 'taco', 'opt_kwargs': {'learning_rate': 1e-2, 'k': 1,
                                        'mu': 0.0}},
)
# Its vectors take plain SGD steps: stable on the Rosenbrock target only below
# 2e-3 (Hessian eigenvalue ~1002). Not in the alias suite, whose targets are
# all vectors (TACO would see a matrix in one test only) and include a complex
# Rosenbrock that SGD without momentum does not solve in its 10,000 steps at
# any stable learning rate (optax lists sgd there with momentum 0.9).
CHAINED_OPTIMIZERS = (
    {'opt_name': 'chained_scale_by_taco',
     'opt_kwargs': {'learning_rate': 1e-3}},
)


def _suite_mismatch(detail: str) -> RuntimeError:
  return RuntimeError(
      'tests/test_optax_suites.py edits the common suites of optax '
      f'{SUITE_OPTAX_VERSION}, and the installed optax {optax.__version__} '
      f'differs: {detail}. Install optax=={SUITE_OPTAX_VERSION} (the test '
      'extra pins it) or update this file to the new suites.')


def _installed_source(module_name: str) -> tuple[str, str]:
  """(path, source) of an optax test module, without importing it."""
  spec = importlib.util.find_spec(module_name)
  if spec is None or spec.origin is None:
    raise _suite_mismatch(f'{module_name} is not installed')
  with open(spec.origin, encoding='utf-8') as source_file:
    return spec.origin, source_file.read()


def _check_once(source: str, text: str, path: str):
  count = source.count(text)
  if count != 1:
    raise _suite_mismatch(f'{path} holds {text!r} {count} times, expected once')


def _replace_once(source: str, old: str, new: str, path: str) -> str:
  _check_once(source, old, path)
  return source.replace(old, new)


def _split(source: str, marker: str, path: str) -> tuple[str, str]:
  """The source before ``marker`` and from it on.

  The second part starts with as many blank lines as the first holds, so that
  tracebacks name the installed file's own line numbers.
  """
  _check_once(source, marker, path)
  before, _, after = source.partition(marker)
  return before, '\n' * before.count('\n') + marker + after


def _exec_suite(path, prelude, test_class, replaced, class_name):
  """Runs a suite's prelude, replaces names it defines, then builds its class.

  Args:
    path: the suite's file, named in tracebacks.
    prelude: its source before the test class (imports, lists, helpers).
    test_class: the source of the test class (see :func:`_split`).
    replaced: names the prelude must define, with our values for them.
    class_name: the test class's name.

  Returns:
    The test class, its parametrised tests generated from our lists.
  """
  namespace = {'__name__': __name__, '_static_args': _static_args}
  # pylint: disable-next=exec-used
  exec(compile(prelude, path, 'exec'), namespace)
  for name, value in replaced.items():
    if name not in namespace:
      raise _suite_mismatch(f'{path} no longer defines {name}')
    namespace[name] = value
  # pylint: disable-next=exec-used
  exec(compile(test_class, path, 'exec'), namespace)
  return namespace[class_name]


def _static_args(factory) -> tuple[str, ...]:
  """The contrib suite's rule: those of STATIC_ARGS that the factory takes."""
  parameters = inspect.signature(factory).parameters
  return tuple(name for name in STATIC_ARGS if name in parameters)


def _contrib_suite():
  """``ContribTest`` of ``optax/contrib/_common_test.py``, all our entries."""
  path, source = _installed_source('optax.contrib._common_test')
  source = _replace_once(
      source, "'ns_steps', 'rank', 'update_proj_gap']",
      "'ns_steps', 'rank', 'update_proj_gap', *_static_args(factory)]", path)
  prelude, test_class = _split(source, 'class ContribTest(', path)
  # No optax wrapper around ours: wrappers have their own entries there.
  optimizers = tuple(dict(entry, wrapper_name=None, wrapper_kwargs=None)
                     for entry in TACO_OPTIMIZERS + CHAINED_OPTIMIZERS)
  return _exec_suite(path, prelude, test_class, {
      '_MAIN_OPTIMIZERS_UNDER_TEST': optimizers,
      '_ALL_OPTIMIZERS_UNDER_TEST': optimizers,
      '_get_opt_factory': FACTORIES.__getitem__,
  }, 'ContribTest')


def _alias_suite():
  """``AliasTest`` of ``optax/_src/alias_test.py`` on TACO_OPTIMIZERS."""
  path, source = _installed_source('optax._src.alias_test')
  # scipy and sklearn serve the LBFGS tests only, which are not run here.
  for import_line in ('import scipy.optimize as scipy_optimize\n',
                      'from sklearn import datasets\n',
                      'from sklearn import linear_model\n'):
    source = _replace_once(source, import_line, '\n', path)
  # The suite gives adafactor its static argument by name; ours follow the
  # contrib suite's rule instead.
  source = _replace_once(
      source, 'opt_inject = _inject.inject_hyperparams(opt_factory)(',
      'opt_inject = _inject.inject_hyperparams('
      'opt_factory, _static_args(opt_factory))(', path)
  prelude, rest = _split(source, 'class AliasTest(', path)
  test_class, _ = _split(rest, '# ALGORITHM SPECIFIC TESTS', path)
  test_case = _exec_suite(path, prelude, test_class, {
      '_OPTIMIZERS_UNDER_TEST': TACO_OPTIMIZERS,
      '_get_opt': lambda self, opt_name: FACTORIES[opt_name],
  }, 'AliasTest')
  # test_explicit_dtype checks optax's own sgd and adam(w), not our list.
  for name in [name for name in vars(test_case)
               if name.startswith('test_explicit_dtype')]:
    delattr(test_case, name)
  return test_case


# pytest collects unittest.TestCase classes under these module-level names.
TestContribSuite = _contrib_suite()
TestAliasSuite = _alias_suite()


