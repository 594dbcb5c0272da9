"""What an installed ``taco_optax`` shows: type information and short
signatures."""

import inspect
import os
import shutil
import subprocess
import sys
import zipfile

import taco_optax

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_ships_py_typed(tmp_path):
  # Built from a copy: setuptools writes build/ and *.egg-info beside the
  # sources.
  source = tmp_path / 'source'
  shutil.copytree(_REPO_ROOT, source, ignore=shutil.ignore_patterns(
      '.*', 'build', '*.egg-info', '__pycache__', 'runs', 'tests',
      'benchmarks', 'examples', 'docs'))
  process = subprocess.run(
      [sys.executable, '-m', 'pip', 'wheel', '--no-deps',
       '--no-build-isolation', '-q', '-w', str(tmp_path), str(source)],
      capture_output=True, text=True, timeout=300)
  assert process.returncode == 0, process.stderr[-2000:]
  (wheel,) = tmp_path.glob('taco_optax-*.whl')
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
  assert 'taco_optax/py.typed' in names
  assert 'taco_optax/_src/kernels/csrc/column_step.cc' in names


def test_taco_signature_names_its_types_instead_of_expanding_them():
  signature = inspect.signature(taco_optax.taco)
  # Expanded aliases spelled optax's ScalarOrSchedule out twice (~1100
  # characters, jaxlib and numpy scalar types included): every annotation
  # stays a short name, however many arguments taco() takes.
  text = str(signature)
  assert 'jaxlib' not in text and 'numpy' not in text, text
  assert "learning_rate: 'optax.ScalarOrSchedule'" in text
  for name, parameter in signature.parameters.items():
    assert len(str(parameter.annotation)) < 60, (name, parameter.annotation)
