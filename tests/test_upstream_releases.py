"""The pins that break next: the release watch, run on demand.

``pyproject.toml`` caps optax below 0.2.9 because the inject guard
(``taco_optax/_src/transform/inject_guard.py``) reads one optax internal, the
``sched_hps`` of ``optax.inject_hyperparams``; it caps google-tunix below
0.1.9 because ``taco_optax.tunix`` replaces a train step it must know. Run
``python -m pytest -m upstream``: once a release above a cap is on the
package index, this test fails either way, so the cap is looked at before a
user meets it:

- optax: the release is installed into a temporary folder and the guard's
  probe runs against it in a subprocess; the failure says whether the guard
  still reads the release's schedules (then widen the cap) or not (then fix
  the guard first).
- google-tunix: the failure names the release and the tests to run against
  it before the cap is widened.

It asks the package index (``pip index versions``), whose answer changes
with no change here, so it is marked ``upstream``: no tier and no CI run
selects it (a release would otherwise stop every unrelated change from
landing); it skips where no index answers.
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.upstream

# The probe: optax.inject_hyperparams with a callable routing argument left
# out of static_args must be refused by the guard, and routing arguments in
# static_args must pass.
_PROBE = textwrap.dedent('''
    import json, optax, jax.numpy as jnp, taco_optax
    dims = lambda params: {'w': taco_optax.TacoDimensionNumbers()}
    params = {'w': jnp.ones((4, 3))}
    result = {'version': optax.__version__}
    try:
      optax.inject_hyperparams(taco_optax.taco, static_args=('k',))(
          1e-2, k=2, weight_dimension_numbers=dims).init(params)
      result['refused'] = 'no error'
    except ValueError as e:
      result['refused'] = 'static_args' in str(e) and 'ok'
    except RuntimeError as e:
      result['refused'] = f'guard cannot read: {e}'
    optax.inject_hyperparams(
        taco_optax.taco, static_args=('k', 'weight_dimension_numbers'))(
            1e-2, k=2, weight_dimension_numbers=dims).init(params)
    print(json.dumps(result))
''')


def _versions(package):
  """The releases the index offers, newest first (skips when offline)."""
  try:
    out = subprocess.run(
        [sys.executable, '-m', 'pip', 'index', 'versions', package],
        capture_output=True, text=True, timeout=120, check=False)
  except subprocess.TimeoutExpired:
    pytest.skip('the package index did not answer')
  match = re.search(r'Available versions: (.*)', out.stdout)
  if out.returncode or not match:
    pytest.skip(f'no package index: {out.stderr.strip()[-200:]}')
  return [v.strip() for v in match.group(1).split(',')]


def _release(version):
  return tuple(int(x) for x in re.findall(r'\d+', version)[:3])


def _cap(package):
  """The upper bound ``pyproject.toml`` puts on ``package`` (installed)."""
  for requirement in importlib.metadata.requires('taco_optax'):
    if re.match(rf'{re.escape(package)}\b', requirement):
      cap = re.search(r'<\s*([\d.]+)', requirement)
      if cap:
        return _release(cap.group(1))
  raise AssertionError(f'no upper bound on {package} in taco_optax\'s '
                       'requirements')


def _above(package):
  cap = _cap(package)
  return [v for v in _versions(package)
          if re.fullmatch(r'[\d.]+', v) and _release(v) >= cap], cap


def test_no_optax_release_above_the_cap_or_the_guard_is_checked(tmp_path):
  newer, cap = _above('optax')
  if not newer:
    return
  version = newer[0]
  target = tmp_path / 'optax'
  subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet',
                  '--no-deps', '--target', str(target), f'optax=={version}'],
                 check=True, timeout=300)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(target), os.environ.get('PYTHONPATH', '')]))
  out = subprocess.run([sys.executable, '-c', _PROBE], capture_output=True,
                       text=True, env=env, timeout=300, check=False)
  result = (json.loads(out.stdout.strip().splitlines()[-1])
            if out.returncode == 0 else {'refused': out.stderr[-2000:]})
  verdict = ('the guard still refuses a scheduled routing argument: widen '
             'the optax cap in pyproject.toml (and rerun the fast tier)'
             if result['refused'] == 'ok' else
             f'the guard does NOT work with it ({result["refused"]}): fix '
             'taco_optax/_src/transform/inject_guard.py before widening the '
             'cap')
  pytest.fail(f'optax {version} is released, above the cap '
              f'<{".".join(map(str, cap))}; {verdict}.')


def test_no_tunix_release_above_the_cap():
  newer, cap = _above('google-tunix')
  assert not newer, (
      f'google-tunix {newer[0]} is released, above the cap '
      f'<{".".join(map(str, cap))}: run tests/test_tunix.py and the long '
      'tier against it (pip install google-tunix==' + newer[0] + '), then '
      'widen the cap in pyproject.toml, or teach taco_optax.tunix its train '
      'step.')
