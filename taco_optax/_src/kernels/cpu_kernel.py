"""TACO's column step as one fused C++ kernel on CPU, through XLA's FFI.

:func:`cpu_column_step` gives bit for bit the results of
:func:`reference.reference_column_step` on XLA:CPU, in one pass
over each gradient row, with rows split across XLA's CPU threads: the merge
``mu M + (1 - mu) G``, the top-k (ties to the lowest row), the FP8 encode and
the winners. XLA's own ``lax.top_k`` on CPU sorts an index array per row on
one thread, which made the step the slowest part of training.

The source (``csrc/column_step.cc`` and its headers) ships with the package
and is compiled at first use against the installed jaxlib's FFI headers, so
the handler always matches the runtime's FFI version. The library is cached
per user in ``$TACO_OPTAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/taco_optax``,
else ``~/.cache/taco_optax``, under a name keyed by the source, jaxlib,
compiler and machine. Without a working C++ compiler :func:`availability`
says why (``dispatch`` then chooses the reference); nothing fails at import or
install time. This module never falls back on its own.
"""

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from taco_optax._src.kernels import reference

TARGET_NAME = 'taco_optax_column_step'
WRITE_TARGET_NAME = 'taco_optax_winner_write'
WRITE16_TARGET_NAME = 'taco_optax_winner_write_bf16'
_SOURCES = pathlib.Path(__file__).parent / 'csrc'
_SYMBOLS = {TARGET_NAME: 'TacoColumnStep',
            WRITE_TARGET_NAME: 'TacoWinnerWrite',
            WRITE16_TARGET_NAME: 'TacoWinnerWrite16'}
# The weights the winner write takes.
WRITE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# No -march=native: the cache may be shared by machines with other CPUs.
# -ffp-contract=off: the reference rounds each product and sum separately.
_FLAGS = ('-O3', '-shared', '-fPIC', '-std=c++17', '-ffp-contract=off')
_BUILD_TIMEOUT_S = 600

_GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_INDEX_DTYPES = (jnp.dtype(jnp.int32), jnp.dtype(jnp.int16))



class Availability(NamedTuple):
  """Whether the kernel can run here, and why (or why not).

  Attributes:
    ok: the library was built (or found) and loaded.
    reason: its path when ``ok``, else the error that stopped it.
  """
  ok: bool
  reason: str


# The kernel library is built, loaded and registered with XLA once per
# process (a registered FFI target is process-wide): this is its
# Availability, None until first tried, guarded by the lock.
_lock = threading.Lock()
_status = None


def cache_dir() -> pathlib.Path:
  """Where compiled kernels are kept (see the module docstring)."""
  if os.environ.get('TACO_OPTAX_CACHE_DIR'):
    return pathlib.Path(os.environ['TACO_OPTAX_CACHE_DIR'])
  if os.environ.get('XDG_CACHE_HOME'):
    return pathlib.Path(os.environ['XDG_CACHE_HOME']) / 'taco_optax'
  return pathlib.Path.home() / '.cache' / 'taco_optax'


def _compiler() -> tuple[str, str]:
  """The C++ compiler to use and its version line."""
  compiler = (os.environ.get('CXX') or shutil.which('g++')
              or shutil.which('c++') or shutil.which('clang++'))
  if not compiler:
    raise RuntimeError('no C++ compiler found (g++, c++, clang++ or $CXX)')
  version = subprocess.run([compiler, '--version'], capture_output=True,
                           text=True, timeout=60, check=True).stdout
  return compiler, version.strip().splitlines()[0] if version.strip() else ''


def _build() -> pathlib.Path:
  """Compiles the kernel into the cache unless an identical build is there."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  files = [path for path in sorted(_SOURCES.iterdir())
           if path.suffix in ('.cc', '.h')]
  sources = [path.read_bytes() for path in files]
  compiler, version = _compiler()
  key = hashlib.sha256(b'\0'.join([
      *sources, jaxlib.__version__.encode(), compiler.encode(),
      version.encode(), ' '.join(_FLAGS).encode(),
      platform.machine().encode()])).hexdigest()
  directory = cache_dir()
  library = directory / f'taco_column_step_{key[:20]}.so'
  if library.exists():
    return library
  directory.mkdir(parents=True, exist_ok=True)
  # Build under a private name, then rename: concurrent processes never see
  # (or load) a half-written library.
  handle, partial = tempfile.mkstemp(dir=directory, suffix='.so.partial')
  os.close(handle)
  try:
    command = [compiler, *_FLAGS, f'-I{jax.ffi.include_dir()}',
               *(str(path) for path in files if path.suffix == '.cc'),
               '-o', partial]
    result = subprocess.run(command, capture_output=True, text=True,
                            timeout=_BUILD_TIMEOUT_S, check=False)
    if result.returncode != 0:
      tail = ' '.join(result.stderr.strip().splitlines()[-3:])
      raise RuntimeError(f'{os.path.basename(compiler)} failed: {tail}')
    os.replace(partial, library)
  finally:
    if os.path.exists(partial):
      os.remove(partial)
  return library


def _load(library: pathlib.Path) -> None:
  loaded = ctypes.CDLL(str(library))
  for target, symbol in _SYMBOLS.items():
    jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(getattr(loaded, symbol)), platform='cpu')


def availability() -> Availability:
  """Whether the CPU kernel can run, building and loading it on first call.

  Tried once per process; never raises.
  """
  global _status
  with _lock:
    if _status is None:
      try:
        library = _build()
        _load(library)
        _status = Availability(True, f'built in {library}')
      except Exception as error:  # pylint: disable=broad-except
        _status = Availability(False, f'{type(error).__name__}: {error}')
    return _status


def supports(grad_rows: jax.Array, values: jax.Array, indices: jax.Array,
             update_topk: int = 1) -> bool:
  """Whether the kernel handles these dtypes and shapes (not availability).

  Args:
    grad_rows: ``(N, m)`` float32 or bfloat16 gradient rows.
    values: ``(N, k)`` float8_e4m3fn history values.
    indices: ``(N, k)`` int32 or int16 history indices.
    update_topk: winners per row.

  Returns:
    True when :func:`cpu_column_step` accepts them.
  """
  if grad_rows.ndim != 2 or values.ndim != 2 or indices.shape != values.shape:
    return False
  n, m = grad_rows.shape
  k = values.shape[1]
  return (jnp.dtype(grad_rows.dtype) in _GRAD_DTYPES
          and jnp.dtype(values.dtype) == jnp.dtype(jnp.float8_e4m3fn)
          and jnp.dtype(indices.dtype) in _INDEX_DTYPES
          and values.shape[0] == n and 1 <= update_topk <= k <= m < 2**31
          # int16 indices only address rows below 2**15 (as in the reference).
          and (jnp.dtype(indices.dtype) == jnp.int32 or m <= 2**15))


def cpu_column_step(grad_rows: jax.Array, values: jax.Array,
                    indices: jax.Array, exponents: jax.Array,
                    mu: Union[float, jax.Array],
                    update_topk: int) -> reference.ColumnStep:
  """One TACO step on rows with the fused CPU kernel.

  Same arguments and results as
  :func:`reference.reference_column_step` (single device), for
  the inputs :func:`supports` accepts and a ``mu`` whose ``1 - mu`` XLA does
  not fold away (``reference.decay_folds_away``; ``dispatch`` chooses the
  reference then). Works under ``jax.jit`` and
  ``jax.vmap`` (batch axes are passed to the kernel, which treats each batch
  entry as its own leaf: its own ``mu`` and finiteness).

  Args:
    grad_rows: ``(N, m)`` float32 or bfloat16 gradient, one row per column.
    values: ``(N, k)`` float8_e4m3fn history values.
    indices: ``(N, k)`` int32 or int16 history row indices.
    exponents: ``(N,)`` int8 history scales.
    mu: EMA decay, a Python float or a 0-d array.
    update_topk: ``r``, winners per row, ``1 <= r <= k``.

  Returns:
    A :class:`reference.ColumnStep`.

  Raises:
    RuntimeError: if the kernel is not available (see :func:`availability`).
    ValueError: for inputs :func:`supports` rejects.
  """
  available = availability()
  if not available.ok:
    raise RuntimeError(
        f'The TACO CPU kernel is not available: {available.reason}')
  if not supports(grad_rows, values, indices, update_topk):
    raise ValueError(
        'The TACO CPU kernel takes (N, m) f32/bf16 gradients and (N, k) '
        'float8_e4m3fn/int32|int16 history with 1 <= update_topk <= k <= m; '
        f'got {grad_rows.shape} {grad_rows.dtype}, {values.shape} '
        f'{values.dtype}, {indices.dtype}, update_topk={update_topk}.')
  n, k = values.shape
  # The reference's arithmetic: for a Python float, 1 - mu is formed in
  # float64 and rounded once to float32 (weak typing), not 1.0f - f32(mu).
  one_minus_mu = jnp.asarray(1 - mu, jnp.float32)
  mu = jnp.asarray(mu, jnp.float32)
  results = (
      jax.ShapeDtypeStruct((n, k), values.dtype),
      jax.ShapeDtypeStruct((n,), jnp.int8),
      jax.ShapeDtypeStruct((n, k), indices.dtype),
      jax.ShapeDtypeStruct((n, update_topk), jnp.int32),
      jax.ShapeDtypeStruct((n, update_topk), jnp.float32),
      jax.ShapeDtypeStruct((), jnp.bool_),
  )
  call = jax.ffi.ffi_call(TARGET_NAME, results, vmap_method='broadcast_all')
  outputs = call(grad_rows, values, indices, exponents.astype(jnp.int8), mu,
                 one_minus_mu, update_topk=np.int64(update_topk))
  return reference.ColumnStep(*outputs)


def cpu_winner_write(weight: jax.Array, winners: jax.Array, delta: jax.Array,
                     finite: jax.Array, column_axis: int,
                     rounding_key: Optional[jax.Array] = None) -> jax.Array:
  """``weight`` with each column's winners' ``delta`` added, in place.

  The layer-wise step's write of one leaf (``csrc/winner_write.cc``):
  ``weight[winner] + delta`` rounded once to the weight's dtype where column
  ``i``'s winners ``winners[i]`` are, every other entry as it was, and the
  whole weight NaN when not ``finite``. A bfloat16 weight with
  ``rounding_key`` is written as the optax path's stochastic rounding writes
  it (``transform.rounded_update`` with ``transform.element_bits`` of each
  element's flat index under the key). The result aliases ``weight`` (donate
  it, or XLA copies it first).

  Args:
    weight: a 2-D float32 or bfloat16 weight; its columns (the paper's) are
      its rows when ``column_axis`` is 0, its columns when 1.
    winners: ``(n, r)`` int32 positions in ``[0, m)`` of each column's
      winners.
    delta: ``(n, r)`` what each winner adds (taken as float32).
    finite: a bool scalar, the gradient's finiteness.
    column_axis: the weight's axis that indexes the paper's columns.
    rounding_key: the leaf's ``(2,)`` uint32 stochastic-rounding key
      (``transform.leaf_key``), bfloat16 weights only; ``None`` rounds to
      nearest.

  Raises:
    RuntimeError: if the kernel is not available (see :func:`availability`).
    ValueError: for a weight dtype other than float32 or bfloat16, or a
      ``rounding_key`` with a float32 weight.
  """
  available = availability()
  if not available.ok:
    raise RuntimeError(
        f'The TACO CPU kernel is not available: {available.reason}')
  dtype = jnp.dtype(weight.dtype)
  if dtype not in WRITE_DTYPES or (rounding_key is not None
                                   and dtype == jnp.float32):
    raise ValueError(
        'The winner write takes float32 or bfloat16 weights (a rounding key '
        f'for bfloat16 only); got {dtype}, rounding_key='
        f'{"set" if rounding_key is not None else None}.')
  operands = [weight, winners.astype(jnp.int32), delta.astype(jnp.float32),
              jnp.asarray(finite, jnp.bool_)]
  attributes = {'column_axis': np.int64(column_axis)}
  target = WRITE_TARGET_NAME
  if dtype == jnp.bfloat16:
    target = WRITE16_TARGET_NAME
    operands.append(jnp.zeros((2,), jnp.uint32) if rounding_key is None
                    else jnp.asarray(rounding_key, jnp.uint32))
    attributes['stochastic'] = np.int64(rounding_key is not None)
  call = jax.ffi.ffi_call(target,
                          jax.ShapeDtypeStruct(weight.shape, weight.dtype),
                          input_output_aliases={0: 0})
  return call(*operands, **attributes)
