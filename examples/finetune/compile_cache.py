"""Warm compiles: JAX's persistent compilation cache for the example's runs.

Each run writes what it compiles (the train step, the evaluation passes, the
small programs around them) to a folder and reads it back in a later run
that compiles the same program with the same jax, backend and flags, so a
second identical run or a ``--resume`` loads its train step instead of
compiling it again. The folder is ``$TACO_OPTAX_CACHE_DIR/jax``, else
``$XDG_CACHE_HOME/taco_optax/jax``, else ``~/.cache/taco_optax/jax``: a
``jax`` folder in the place where ``taco_optax`` keeps its C++ kernel's build
(``taco_optax/_src/kernels/cpu_kernel.py``, ``cache_dir``), with the same
variables. ``--compilation-cache-dir`` moves it and ``--no-compilation-cache``
turns it off.

:func:`used` turns the cache on for one run (the CLI's, before anything
compiles) and :class:`Lookups` says whether a compile came from it, from
the events JAX records (``jax.monitoring``) as it looks a program up, not
from timing.
"""

import contextlib
import importlib.util
import os
from typing import Iterator, NamedTuple, Optional

import jax
from jax.experimental.compilation_cache import compilation_cache

from examples.finetune import flags as flags_lib

# Bounds the folder: JAX deletes the least recently read programs past it.
# With a bound JAX also locks the folder (the filelock package) around each
# read and write, so that runs started together never read an entry another
# is still writing, nor write one entry twice at once.
MAX_BYTES = 4 * 2**30

# What JAX records per compile once the cache is in use (jax/_src/compiler.py
# and compilation_cache.py): a lookup, a hit, an entry written.
_REQUEST = '/jax/compilation_cache/compile_requests_use_cache'
_HIT = '/jax/compilation_cache/cache_hits'
_WRITE = '/jax/compilation_cache/cache_misses'

_OPTIONS = ('jax_compilation_cache_dir', 'jax_enable_compilation_cache',
            'jax_persistent_cache_min_compile_time_secs',
            'jax_persistent_cache_min_entry_size_bytes',
            'jax_compilation_cache_max_size')


def default_dir() -> str:
  """The cache's folder without ``--compilation-cache-dir``."""
  if os.environ.get('TACO_OPTAX_CACHE_DIR'):
    root = os.environ['TACO_OPTAX_CACHE_DIR']
  elif os.environ.get('XDG_CACHE_HOME'):
    root = os.path.join(os.environ['XDG_CACHE_HOME'], 'taco_optax')
  else:
    root = os.path.join(os.path.expanduser('~'), '.cache', 'taco_optax')
  return os.path.join(root, 'jax')


# jax 0.12 gives each process of a multi-process run its own cache key (the
# CPU topology's fingerprint, hashed into the key, differs per process), so
# only process 0 finds the programs it wrote; and a train step process 0
# loads from the cache beside the one process 1 compiles never finishes its
# first collective (measured on jax 0.12.1, CPU, 2 processes over gloo; jax
# 0.10.2 gives both processes one key and both load). Such runs compile.
_SHARED_KEYS = jax.__version_info__ < (0, 12)


def directory(config: flags_lib.RunConfig,
              process_count: int = 1) -> Optional[str]:
  """The folder ``config`` caches compiled programs in; ``None``: off.

  Off for a run of several processes on a jax that keys the cache per
  process (jax 0.12 and later): see :data:`_SHARED_KEYS`.
  """
  if not config.compilation_cache:
    return None
  if process_count > 1 and not _SHARED_KEYS:
    return None
  return os.path.abspath(os.path.expanduser(
      config.compilation_cache_dir or default_dir()))


@contextlib.contextmanager
def used(config: flags_lib.RunConfig) -> Iterator[Optional[str]]:
  """JAX's persistent cache in :func:`directory` while inside (off with
  ``--no-compilation-cache``), JAX's previous settings after; yields the
  folder.

  Every program is kept, however fast it compiled or small it is: the
  evaluation passes are worth keeping too, and a test's tiny model compiles
  in under JAX's default threshold of a second. Set in every process of the
  run, once the processes are connected (their count decides) and before
  anything compiles (each reads the folder; JAX lets process 0 alone write to
  it).

  Raises:
    flags.FinetuneError: ``--compilation-cache-dir`` names a file.
  """
  wanted = directory(config)
  if wanted is not None and os.path.exists(wanted) and not os.path.isdir(
      wanted):
    raise flags_lib.FinetuneError(
        f'--compilation-cache-dir {wanted} is a file, not a folder')
  # Asked only of joined processes: the query starts JAX's backend.
  joined = jax.distributed.is_initialized()
  folder = directory(config, jax.process_count() if joined else 1)
  if wanted is not None and folder is None and jax.process_index() == 0:
    print(f'compilation cache off: jax {jax.__version__} keys it per process, '
          'and a train step one process loads from it hangs beside the one '
          'another process compiles')
  before = {name: getattr(jax.config, name) for name in _OPTIONS}
  settings = {'jax_compilation_cache_dir': folder,
              'jax_enable_compilation_cache': folder is not None}
  if folder is not None:
    settings.update({'jax_persistent_cache_min_compile_time_secs': 0.0,
                     'jax_persistent_cache_min_entry_size_bytes': -1})
    # Without filelock JAX would refuse a bounded cache: keep it unbounded.
    if importlib.util.find_spec('filelock') is not None:
      settings['jax_compilation_cache_max_size'] = MAX_BYTES
  _apply(settings)
  try:
    yield folder
  finally:
    _apply(before)


def _apply(settings: dict) -> None:
  for name, value in settings.items():
    jax.config.update(name, value)
  # JAX opens its cache once, at the first compile after this.
  compilation_cache.reset_cache()


class Lookup(NamedTuple):
  """What the persistent cache answered for the compiles of a span.

  Attributes:
    directory: the cache's folder; ``None``: no cache in use.
    requests: programs looked up in the cache.
    hits: programs loaded from it instead of compiled.
    writes: programs compiled and written to it.
  """
  directory: Optional[str]
  requests: int
  hits: int
  writes: int

  @property
  def verdict(self) -> str:
    """``hit`` (every program came from the cache), ``miss`` (something was
    compiled), ``off`` (no cache), or ``unused`` (a cache, but JAX looked
    nothing up in it: a backend that cannot save compiled programs)."""
    if self.directory is None:
      return 'off'
    if not self.requests:
      return 'unused'
    return 'hit' if self.hits == self.requests else 'miss'

  def as_json(self) -> dict:
    return {'directory': self.directory, 'train_step': self.verdict,
            'requests': self.requests, 'hits': self.hits,
            'writes': self.writes}


class Lookups:
  """Counts the cache's events while inside ``with``; :attr:`result` then.

  JAX records them in the thread that compiles, so a span around one
  ``compile()`` counts that program's lookups (and those of anything it
  compiles on the way).
  """

  def __init__(self):
    self._counts = {_REQUEST: 0, _HIT: 0, _WRITE: 0}
    self.result: Optional[Lookup] = None

  def _listen(self, event: str, **unused_kwargs) -> None:
    if event in self._counts:
      self._counts[event] += 1

  def __enter__(self) -> 'Lookups':
    jax.monitoring.register_event_listener(self._listen)
    return self

  def __exit__(self, *unused_exc_info) -> None:
    jax.monitoring.unregister_event_listener(self._listen)
    enabled = (jax.config.jax_enable_compilation_cache
               and jax.config.jax_compilation_cache_dir)
    self.result = Lookup(
        directory=jax.config.jax_compilation_cache_dir if enabled else None,
        requests=self._counts[_REQUEST], hits=self._counts[_HIT],
        writes=self._counts[_WRITE])

