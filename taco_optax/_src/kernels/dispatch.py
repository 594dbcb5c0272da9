"""The one place that chooses what runs TACO's column step, and runs it.

The implementations are leaves that never call each other or fall back on
their own: :func:`reference.reference_column_step` (plain ``jax.numpy``,
the oracle), ``cpu_kernel`` (fused C++ through XLA's FFI) and
``pallas_kernel`` (Pallas/Triton). :func:`choose` picks one from the
``implementation`` argument of :func:`taco_optax.taco` /
:func:`taco_optax.scale_by_taco`:

* ``'auto'``: the fused CPU kernel when the step runs on CPU, the kernel is
  available and it takes the inputs; otherwise the reference (a warning when
  the kernel should have run but cannot be built);
* ``'cpu'``: the CPU kernel, and an error if it is unavailable or does not
  take the inputs;
* ``'pallas'``: the Pallas kernel (interpret mode off GPU; slow, for tests),
  an error for inputs it does not take. Not yet checked on a GPU, so
  ``'auto'`` never picks it;
* ``'reference'``: always the reference.

``None`` reads ``$TACO_OPTAX_KERNEL`` (default ``'auto'``) when the
transformation is built, so a built optimizer keeps one choice. Either kernel
gives way to the reference, with a log line, where its result would not be
the reference's bit for bit: a Python ``mu`` whose ``1 - mu`` rounds to 1
(XLA folds the reference's multiply), Pallas rows over
``pallas_kernel.MAX_ROW_LENGTH``, and a leaf split over an Explicit mesh
(per-shard selection). Each choice is logged once per process on the
``taco_optax`` logger, and the traced step carries it as the name scope
``taco_column_step_<implementation>``.

The history's stored ``batch + (k, n)`` layout is converted to and from the
kernels' ``(N, k)`` rows here too (:func:`history_rows`,
:func:`stored_history`).
"""

import logging
import math
import os
from typing import Literal, NamedTuple, Optional, Union, cast, get_args

import jax
import jax.numpy as jnp

from taco_optax._src import sharding
from taco_optax._src.kernels import codec
from taco_optax._src.kernels import cpu_kernel
from taco_optax._src.kernels import reference
from taco_optax._src.kernels import sharded_step

ENV = 'TACO_OPTAX_KERNEL'
# What runs the column step: 'auto' chooses among the others.
Implementation = Literal['auto', 'cpu', 'pallas', 'reference']
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
_logger = logging.getLogger('taco_optax')
# The choices logged so far: process-wide on purpose, as the logger is (each
# choice is said once per process, not once per trace).
_logged: set[str] = set()


def resolve(implementation: Optional[Implementation]) -> Implementation:
  """``implementation``, or ``$TACO_OPTAX_KERNEL`` (default auto) for None.

  Raises:
    ValueError: for a name outside :data:`IMPLEMENTATIONS`.
  """
  source = 'implementation'
  chosen: Optional[str] = implementation
  if chosen is None:
    source = ENV
    chosen = os.environ.get(ENV, '').strip().lower() or 'auto'
  if chosen not in IMPLEMENTATIONS:
    raise ValueError(f'{source}={chosen!r}; expected one of '
                     f'{IMPLEMENTATIONS}.')
  return cast(Implementation, chosen)


class Choice(NamedTuple):
  """What runs a column step, and why.

  Attributes:
    implementation: ``'cpu'``, ``'pallas'`` or ``'reference'``.
    reason: why, in words (for the log).
    fallback: whether a kernel should have run but could not (logged as a
      warning; every other choice is logged as info).
  """
  implementation: str
  reason: str
  fallback: bool = False


def _pallas():
  """The Pallas kernel's module, imported on use (Pallas adds ~0.4 s to
  import and only this choice uses it)."""
  try:
    from taco_optax._src.kernels import pallas_kernel  # pylint: disable=g-import-not-at-top
  except ImportError as error:
    # jax deprecated the Pallas Triton backend in 0.12; a jax without it
    # leaves this choice unavailable, never the package.
    raise RuntimeError(
        "implementation='pallas' needs jax's Pallas Triton backend "
        f'(jax.experimental.pallas.triton), which jax {jax.__version__} does '
        f"not provide ({error}); use implementation='auto' or "
        "'reference'.") from error
  return pallas_kernel


def _unsupported(name: str, grad_rows, values, indices,
                 update_topk: int) -> ValueError:
  return ValueError(
      f'implementation={name!r}, but that kernel does not take gradients '
      f'{grad_rows.dtype} {grad_rows.shape} with a {values.dtype}/'
      f'{indices.dtype} history and update_topk={update_topk}; use '
      "implementation='auto' or 'reference'.")


def choose(implementation: str, grad_rows: jax.Array, values: jax.Array,
           indices: jax.Array, mu: Union[float, jax.Array],
           update_topk: int) -> Choice:
  """The implementation that runs the step on these whole rows.

  Args:
    implementation: a resolved name (:func:`resolve`).
    grad_rows, values, indices, mu, update_topk: the step's inputs.

  Returns:
    A :class:`Choice`.

  Raises:
    RuntimeError: ``'cpu'`` asked for and the kernel cannot be built.
    ValueError: ``'cpu'`` or ``'pallas'`` asked for and the kernel does not
      take these dtypes or shapes.
  """
  if implementation == 'reference':
    return Choice('reference', "implementation='reference'")
  if implementation == 'pallas':
    pallas = _pallas()
    if not pallas.supports(grad_rows, values, indices, update_topk):
      raise _unsupported('pallas', grad_rows, values, indices, update_topk)
    if grad_rows.shape[1] > pallas.MAX_ROW_LENGTH:
      return Choice('reference', f'rows of {grad_rows.shape[1]} exceed the '
                    f'Pallas kernel\'s {pallas.MAX_ROW_LENGTH}')
  elif implementation == 'auto' and jax.default_backend() != 'cpu':
    return Choice('reference', f'no verified kernel for '
                  f'{jax.default_backend()} yet')
  else:  # 'cpu', or 'auto' on CPU
    available = cpu_kernel.availability()
    if not available.ok:
      if implementation == 'cpu':
        raise RuntimeError(f"implementation='cpu', but the CPU kernel cannot "
                           f'be built or loaded: {available.reason}')
      return Choice('reference', f'the CPU kernel is unavailable '
                    f'({available.reason})', fallback=True)
    if not cpu_kernel.supports(grad_rows, values, indices, update_topk):
      if implementation == 'cpu':
        raise _unsupported('cpu', grad_rows, values, indices, update_topk)
      return Choice('reference', f'the CPU kernel does not take '
                    f'{grad_rows.dtype} gradients with {values.dtype}/'
                    f'{indices.dtype} history')
    implementation = 'cpu'
  if reference.decay_folds_away(mu):
    return Choice('reference', f'mu={mu}: XLA folds the reference\'s '
                  '(1 - mu) * g, which a kernel would round')
  if implementation == 'cpu':
    return Choice('cpu', f'fused C++ kernel, {available.reason}')
  return Choice('pallas', 'Pallas Triton kernel' if jax.default_backend()
                == 'gpu' else 'Pallas kernel in interpret mode (no GPU)')


def _log(choice: Choice) -> None:
  message = (f'taco_optax: TACO column step runs the {choice.implementation} '
             f'implementation: {choice.reason}.')
  if message not in _logged:
    _logged.add(message)
    _logger.log(logging.WARNING if choice.fallback else logging.INFO, message)


def _pallas_step(grad_rows, values, indices, exponents, mu, update_topk):
  return _pallas().pallas_column_step(
      grad_rows, values, indices, exponents, mu, update_topk,
      interpret=jax.default_backend() != 'gpu')


# Module-level functions: the Auto-mesh op is cached per step function.
_LOCAL_STEPS = {
    'cpu': cpu_kernel.cpu_column_step,
    'pallas': _pallas_step,
    'reference': reference.reference_column_step,
}


def _sharded_step(grad_rows, values, indices, exponents, mu, update_topk,
                  shards: sharding.LeafSharding) -> reference.ColumnStep:
  """The step on one device's slice of rows split over a mesh (exact)."""
  return reference.reference_column_step(
      grad_rows, values, indices, exponents, mu, update_topk,
      sharded_step.selection(shards))


def column_step(grad_rows: jax.Array, values: jax.Array, indices: jax.Array,
                exponents: jax.Array, mu: Union[float, jax.Array],
                update_topk: int, implementation: str = 'auto',
                shards: Optional[sharding.LeafSharding] = None
                ) -> reference.ColumnStep:
  """One TACO step on rows by the chosen implementation.

  Same arguments and results as :func:`reference.reference_column_step`,
  plus the resolved ``implementation`` and, inside ``shard_map`` on an
  Explicit mesh, the leaf's ``shards`` (the rows are this device's slices).
  On an Auto mesh XLA partitions the step by :func:`sharding.partitioned_step`.
  """
  if shards is not None:
    choice = Choice('reference', 'a leaf split over an Explicit mesh merges '
                    'each shard\'s top k (exact)')
  else:
    choice = choose(implementation, grad_rows, values, indices, mu,
                    update_topk)
  _log(choice)
  with jax.named_scope(f'taco_column_step_{choice.implementation}'):
    if shards is not None:
      return _sharded_step(grad_rows, values, indices, exponents, mu,
                           update_topk, shards)
    return reference.ColumnStep(*sharding.partitioned_step(
        grad_rows, values, indices, exponents, mu, update_topk,
        _LOCAL_STEPS[choice.implementation], _sharded_step))


def history_rows(stored: jax.Array) -> jax.Array:
  """The stored ``batch + (k, n)`` history as ``(N, k)`` rows, ``N = B n``."""
  # Explicit sizes: ``-1`` is undefined when ``k`` is 0 (a matrix of 0 rows).
  rows = math.prod(stored.shape[:-2]) * stored.shape[-1]
  return jnp.swapaxes(stored, -1, -2).reshape(rows, stored.shape[-2])


def stored_history(rows: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """:func:`history_rows`' inverse, for a stored history of ``shape``."""
  transposed = shape[:-2] + (shape[-1], shape[-2])
  return jnp.swapaxes(rows.reshape(transposed), -1, -2)


def _empty_step(grad_rows: jax.Array, values: jax.Array, indices: jax.Array,
                exponents: jax.Array, update_topk: int
                ) -> reference.ColumnStep:
  """A matrix with a zero dimension: no winners, the (empty) state kept.

  As optax's optimizers do with empty leaves: nothing to select, no error.
  """
  winners = (grad_rows.shape[0], update_topk)
  return reference.ColumnStep(
      values=history_rows(values), exponents=exponents.reshape(-1),
      indices=history_rows(indices),
      winner_indices=jnp.zeros(winners, jnp.int32),
      winner_signs=jnp.zeros(winners, jnp.float32),
      finite=jnp.array(True))


def winner_write(weight: jax.Array, winners: jax.Array, delta: jax.Array,
                 finite: jax.Array, column_axis: int, implementation: str,
                 rounding_key: Optional[jax.Array] = None
                 ) -> Optional[jax.Array]:
  """The layer-wise step's winner write by the CPU kernel, where it runs.

  ``cpu_kernel.cpu_winner_write`` for a whole 2-D float32 or bfloat16 weight
  (stochastically rounded with ``rounding_key``) on a one-device CPU run
  whose column step may use the kernel (``'auto'`` or ``'cpu'``) and where
  the kernel is available; else ``None``, and the caller scatters the
  winners with XLA. Both give the same bits.
  """
  dtype = jnp.dtype(weight.dtype)
  if (implementation not in ('auto', 'cpu') or weight.ndim != 2
      or dtype not in cpu_kernel.WRITE_DTYPES
      or (rounding_key is not None and dtype != jnp.bfloat16)
      or jnp.dtype(delta.dtype) not in (jnp.dtype(jnp.float32), dtype)
      or jax.default_backend() != 'cpu' or jax.device_count() != 1
      or not cpu_kernel.availability().ok):
    return None
  return cpu_kernel.cpu_winner_write(weight, winners, delta, finite,
                                     column_axis, rounding_key)


def history_step(grad_rows: jax.Array, history: codec.History, *,
                 update_topk: int,
                 mu: Union[float, jax.Array], implementation: str,
                 shards: Optional[sharding.LeafSharding] = None
                 ) -> tuple[reference.ColumnStep, codec.History]:
  """The column step on rows, with the history in its stored layout.

  Args:
    grad_rows: ``(N, m)`` rows of the gradient (or of a block of columns).
    history: the :class:`codec.History` of the same columns.
    update_topk: winners per row.
    mu: EMA decay.
    implementation: a resolved name (:func:`resolve`).
    shards: set inside ``shard_map``: the rows are this device's slices.

  Returns:
    ``(step, history)``: the :class:`ColumnStep` on rows and the new history.
  """
  values, indices, exponents = history
  if grad_rows.size == 0:
    step = _empty_step(grad_rows, values, indices, exponents, update_topk)
  else:
    step = column_step(grad_rows, history_rows(values), history_rows(indices),
                       exponents.reshape(-1), mu, update_topk, implementation,
                       shards)
  new = codec.History(stored_history(step.values, values.shape),
                      stored_history(step.indices, indices.shape),
                      step.exponents.reshape(exponents.shape))
  if isinstance(mu, jax.core.Tracer):
    # A mu known only inside jit (optax.inject_hyperparams) cannot be
    # refused: outside [0, 1) the step is treated as a non-finite gradient's
    # (NaN update, history kept), as taco()'s docstring states.
    ok = (mu >= 0) & (mu < 1)
    step = step._replace(finite=step.finite & ok)
    new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, history)
  return step, new
