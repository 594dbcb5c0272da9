"""The built wheel, installed and tested from outside the repository.

As optax's CI runs ``pytest --pyargs optax`` from a temporary folder: the
package is built with ``python -m build`` (which must print no warning),
installed into a folder of its own, and its doctests run from a folder where
no source tree can shadow it. The C++ CPU kernel is then built on first use
from the sources the wheel ships, into an empty cache, and must give the
reference's bits. This is the one wheel a CI run builds (in its long tier).
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

pytestmark = pytest.mark.long

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

_SMOKE = textwrap.dedent('''
    import os, pathlib, sys
    import jax, jax.numpy as jnp, numpy as np
    import taco_optax
    from taco_optax._src.kernels import cpu_kernel
    where = pathlib.Path(taco_optax.__file__).resolve()
    assert where.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), where
    ok, reason = cpu_kernel.availability()
    assert ok, reason
    built = list(pathlib.Path(os.environ['TACO_OPTAX_CACHE_DIR']).rglob('*.so'))
    assert built, 'no kernel library in the empty cache after first use'
    params = {'w': jnp.asarray(np.random.default_rng(0).standard_normal(
        (64, 48)), jnp.float32)}
    grads = jax.tree.map(lambda p: jnp.sin(3.0 * p), params)
    out = {}
    for implementation in ('cpu', 'reference'):
      tx = taco_optax.taco(1e-2, implementation=implementation)
      updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
      out[implementation] = jax.tree.leaves((updates, state))
    for a, b in zip(out['cpu'], out['reference']):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    print('installed', where.parent, 'kernel', built[0].name)
''')


def _run(command, **kwargs):
  process = subprocess.run(command, capture_output=True, text=True,
                           timeout=900, check=False, **kwargs)
  output = process.stdout + process.stderr
  assert process.returncode == 0, output[-4000:]
  return output


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('wheel')
  source = tmp / 'source'
  shutil.copytree(_REPO_ROOT, source, ignore=shutil.ignore_patterns(
      '.*', 'build', 'dist', '*.egg-info', '__pycache__', 'runs'))
  env = {k: v for k, v in os.environ.items()
         if k != 'PYTHONDONTWRITEBYTECODE'}  # that one makes setuptools warn
  output = _run([sys.executable, '-m', 'build', '--outdir', str(tmp / 'dist'),
                 str(source)], env=env)
  warnings = [line for line in output.splitlines()
              if re.search(r'warn|deprecat', line, re.IGNORECASE)]
  assert not warnings, '\n'.join(warnings)
  (built,) = (tmp / 'dist').glob('taco_optax-*.whl')
  assert list((tmp / 'dist').glob('taco_optax-*.tar.gz'))
  return built


def test_wheel_ships_py_typed_and_the_kernel_sources(wheel):
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
  assert 'taco_optax/py.typed' in names  # PEP 561: annotations for mypy
  assert 'taco_optax/_src/kernels/csrc/column_step.cc' in names


def test_installed_wheel_passes_its_doctests_and_builds_its_kernel(
    wheel, tmp_path):
  site = tmp_path / 'site'
  _run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps',
        '--target', str(site), str(wheel)])
  away = tmp_path / 'elsewhere'
  away.mkdir()
  env = dict(os.environ, PYTHONPATH=str(site),
             TACO_OPTAX_CACHE_DIR=str(tmp_path / 'cache'))
  env.pop('PYTEST_ADDOPTS', None)
  output = _run([sys.executable, '-m', 'pytest', '--pyargs', 'taco_optax',
                 '--doctest-modules', '-p', 'no:cacheprovider', '-q',
                 '-p', 'no:xdist', '--rootdir', str(away)], cwd=away, env=env)
  assert re.search(r'\d+ passed', output), output[-2000:]
  assert 'failed' not in output, output[-2000:]
  output = _run([sys.executable, '-c', _SMOKE, str(site)], cwd=away, env=env)
  assert 'installed' in output, output
