"""pytest: one compilation cache for the run; tunix's module only with tunix.

Tests build many programs that XLA has compiled before in the same run (a
fresh ``jax.jit`` of the same step per hypothesis example, the same tiny
model in several files, every process of a multi-process test, every pytest
worker): JAX's persistent compilation cache, in a folder made for this run
and shared by the workers and every subprocess a test starts (they inherit
the environment), compiles each only once. It is removed when the run ends; a
``JAX_COMPILATION_CACHE_DIR`` set by the user is used as it is.
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

_CACHE = 'JAX_COMPILATION_CACHE_DIR'
if _CACHE not in os.environ:  # the first process of the run (not a worker)
  os.environ[_CACHE] = tempfile.mkdtemp(prefix='taco-optax-tests-xla-')
  atexit.register(shutil.rmtree, os.environ[_CACHE], ignore_errors=True)
# Every compile is worth keeping here. No size bound: a bound makes JAX
# rescan the folder under a file lock at every write, which made a run with
# two workers slower than none (an entry read while another process writes
# it is a warning and a compile, not an error).
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

# JAX reads the variables when it is first imported; a plugin may have been
# first.
jax.config.update('jax_compilation_cache_dir', os.environ[_CACHE])
jax.config.update('jax_persistent_cache_min_compile_time_secs',
                  float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']))

# taco_optax/tunix.py subclasses tunix's trainer at import; its doctests and
# tests need ``pip install "taco_optax[tunix]"``.
collect_ignore = ([] if importlib.util.find_spec('tunix')
                  else ['taco_optax/tunix.py'])


def pytest_collection_modifyitems(items):
  """Tests marked ``long`` first (in their order), then the rest in theirs."""
  items.sort(key=lambda item: item.get_closest_marker('long') is None)
