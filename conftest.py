"""pytest: one compilation cache for the run; tunix's module only with tunix;
the order the workers take the files in.

Tests build many programs that XLA has compiled before in the same run (a
fresh ``jax.jit`` of the same step per hypothesis example, the same tiny
model in several files, every process of a multi-process test, every pytest
worker): JAX's persistent compilation cache, in a folder made for this run
and shared by the workers and every subprocess a test starts (they inherit
the environment), compiles each only once. It is removed when the run ends; a
``JAX_COMPILATION_CACHE_DIR`` set by the user is used as it is.
"""

import atexit
import collections
import importlib.util
import os
import shutil
import tempfile

import pytest

_CACHE = 'JAX_COMPILATION_CACHE_DIR'
if _CACHE not in os.environ:  # the first process of the run (not a worker)
  os.environ[_CACHE] = tempfile.mkdtemp(prefix='taco-optax-tests-xla-')
  atexit.register(shutil.rmtree, os.environ[_CACHE], ignore_errors=True)
# Every compile is worth keeping here. No size bound: a bound makes JAX
# rescan the folder under a file lock at every write, which made a run with
# two workers slower than none (an entry read while another process writes
# it is a warning and a compile, not an error).
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')

import jax  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position

# JAX reads the variables when it is first imported; a plugin may have been
# first.
jax.config.update('jax_compilation_cache_dir', os.environ[_CACHE])
jax.config.update('jax_persistent_cache_min_compile_time_secs',
                  float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']))

# taco_optax/tunix.py subclasses tunix's trainer at import; its doctests and
# tests need ``pip install "taco_optax[tunix]"``.
collect_ignore = ([] if importlib.util.find_spec('tunix')
                  else ['taco_optax/tunix.py'])


# Files whose long tests run for minutes in processes of their own (the
# 8-device rerun, the multi-process launches): they start first, so that the
# workers' other files fill the time beside them instead of after them.
SCHEDULED_FIRST = ('tests/test_multidevice.py', 'tests/test_multiprocess.py',
                   'tests/examples/test_multiprocess_cli.py',
                   'tests/examples/test_memory_plan.py')


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
  """Orders the files for the workers (``--no-loadscope-reorder`` in
  ``pyproject.toml`` keeps this order): those of ``SCHEDULED_FIRST`` that
  have a long test selected, then the others with the most tests first (as
  pytest-xdist orders them by itself); each file's tests in their order."""
  del config
  def path(item):
    return item.nodeid.split('::')[0]
  counts = collections.Counter(map(path, items))
  first = {path(item) for item in items
           if item.get_closest_marker('long') is not None}
  rank = {name: i for i, name in enumerate(SCHEDULED_FIRST) if name in first}
  order = {id(item): i for i, item in enumerate(items)}
  items.sort(key=lambda item: (rank.get(path(item), len(rank)),
                               -counts[path(item)], path(item),
                               order[id(item)]))
