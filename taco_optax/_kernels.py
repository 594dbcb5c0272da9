"""Which implementation runs TACO's column step: a fused kernel or the reference.

The one place a kernel slots in. ``TACO_OPTAX_KERNEL`` chooses:

* ``auto`` (default): the fused CPU kernel (``_cpu_kernel``, C++ through XLA's
  FFI, built on first use) when the computation runs on CPU and the kernel is
  available and supports the dtypes; otherwise the reference.
* ``reference``: always :func:`_column_step.reference_column_step`.
* ``cpu``: the CPU kernel, and an error if it cannot be built.
* ``pallas``: the Pallas (Triton) kernel (``_pallas_kernel``), only when asked
  for; off GPU it runs in interpret mode (slow: for tests). Its Triton build
  and speed are not yet checked on a GPU, so ``auto`` never picks it.

Which one runs is logged once per process. With more than one device the
single-device step carries a partitioning rule (``_auto_partition``), so that
on an Auto mesh each device runs it on its own block.
"""

import logging
import os
from typing import Optional, Union

import jax

from taco_optax import _auto_partition
from taco_optax import _column_step
from taco_optax import _cpu_kernel

_ENV = 'TACO_OPTAX_KERNEL'
_CHOICES = ('auto', 'cpu', 'reference', 'pallas')
_logger = logging.getLogger('taco_optax')
_logged = set()


def _log_once(message: str, level: int) -> None:
  if message not in _logged:
    _logged.add(message)
    _logger.log(level, message)


def requested() -> str:
  """The implementation asked for by ``TACO_OPTAX_KERNEL`` (default auto)."""
  choice = os.environ.get(_ENV, 'auto').strip().lower() or 'auto'
  if choice not in _CHOICES:
    raise ValueError(f'{_ENV}={choice!r}; expected one of {_CHOICES}.')
  return choice


def status() -> tuple[str, str]:
  """``(implementation, why)`` of the single-device column step here.

  ``implementation`` is ``'cpu'`` (the fused kernel), ``'pallas'`` (only on
  request) or ``'reference'``; it is what runs for the supported dtypes
  (float32/bfloat16 gradients, the default float8 history); other dtypes run
  the reference (or raise for an explicit ``cpu`` or ``pallas``).
  """
  choice = requested()
  if choice == 'reference':
    return 'reference', f'{_ENV}=reference'
  if choice == 'pallas':
    return 'pallas', ('Pallas Triton kernel' if jax.default_backend() == 'gpu'
                      else 'Pallas kernel in interpret mode (no GPU)')
  if choice == 'auto' and jax.default_backend() != 'cpu':
    return 'reference', f'no fused kernel for {jax.default_backend()} yet'
  available, reason = _cpu_kernel.availability()
  if available:
    return 'cpu', f'fused C++ kernel, {reason}'
  if choice == 'cpu':
    raise RuntimeError(f'{_ENV}=cpu but the CPU kernel cannot be built or '
                       f'loaded: {reason}')
  return 'reference', f'the CPU kernel is unavailable ({reason})'


def column_step(grad_rows: jax.Array, values: jax.Array, indices: jax.Array,
                exponents: jax.Array, mu: Union[float, jax.Array],
                update_topk: int,
                selection: Optional[_column_step.Selection] = None
                ) -> _column_step.ColumnStep:
  """One TACO step on rows, by the fastest exact implementation available.

  Same arguments and results as
  :func:`_column_step.reference_column_step`. ``selection=None`` means one
  device (the rows are whole); a mesh's ``selection`` runs the reference
  arithmetic per shard.
  """
  if selection is not None:
    return _column_step.reference_column_step(
        grad_rows, values, indices, exponents, mu, update_topk, selection)
  # On an Auto mesh XLA partitions the step; the op tells it how (per device,
  # merging k candidates per shard) instead of gathering the gradient.
  return _auto_partition.column_step(grad_rows, values, indices, exponents,
                                     mu, update_topk, _single_device_step)


def _single_device_step(grad_rows: jax.Array, values: jax.Array,
                        indices: jax.Array, exponents: jax.Array,
                        mu: Union[float, jax.Array], update_topk: int
                        ) -> _column_step.ColumnStep:
  """The column step on whole rows: the fused kernel where it runs."""
  implementation, why = status()
  if implementation == 'pallas':
    return _pallas_step(grad_rows, values, indices, exponents, mu, update_topk,
                        why)
  supported = _cpu_kernel.supports(grad_rows, values, indices, update_topk)
  if implementation == 'cpu' and supported:
    _log_once(f'taco_optax: TACO column step runs the {why}.',
              logging.INFO)
    return _cpu_kernel.cpu_column_step(grad_rows, values, indices, exponents,
                                       mu, update_topk)
  if requested() == 'cpu':
    raise ValueError(
        f'{_ENV}=cpu but the kernel does not take gradients {grad_rows.dtype} '
        f'{grad_rows.shape} with a {values.dtype}/{indices.dtype} history.')
  _log_once(
      f'taco_optax: TACO column step runs the reference jax.numpy path: {why}.'
      if implementation == 'reference' else
      'taco_optax: TACO column step runs the reference jax.numpy path for '
      f'{values.dtype} history values (the kernel takes float8_e4m3fn).',
      logging.WARNING if 'unavailable' in why else logging.INFO)
  return _column_step.reference_column_step(
      grad_rows, values, indices, exponents, mu, update_topk)


def _pallas_step(grad_rows: jax.Array, values: jax.Array, indices: jax.Array,
                 exponents: jax.Array, mu: Union[float, jax.Array],
                 update_topk: int, why: str) -> _column_step.ColumnStep:
  """The Pallas kernel, run only on request (interpret mode off GPU)."""
  # Imported here: Pallas adds ~0.4 s to import and only this choice uses it.
  from taco_optax import _pallas_kernel  # pylint: disable=g-import-not-at-top
  if not _pallas_kernel.supports(grad_rows, values, indices, update_topk):
    raise ValueError(
        f'{_ENV}=pallas but the kernel does not take gradients '
        f'{grad_rows.dtype} {grad_rows.shape} with a '
        f'{values.dtype}/{indices.dtype} history.')
  _log_once(f'taco_optax: TACO column step runs the {why}.', logging.INFO)
  return _pallas_kernel.pallas_column_step(
      grad_rows, values, indices, exponents, mu, update_topk,
      interpret=jax.default_backend() != 'gpu')
