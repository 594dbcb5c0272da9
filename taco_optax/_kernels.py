"""Which implementation runs TACO's column step: a fused kernel or the reference.

The one place a kernel slots in. ``TACO_OPTAX_KERNEL`` chooses:

* ``auto`` (default): the fused CPU kernel (``_cpu_kernel``, C++ through XLA's
  FFI, built on first use) when the computation runs on CPU and the kernel is
  available and supports the dtypes; otherwise the reference.
* ``reference``: always :func:`_column_step.reference_column_step`.
* ``cpu``: the CPU kernel, and an error if it cannot be built.

Which one runs is logged once per process.
"""

import logging
import os
from typing import Optional, Union

import jax

from taco_optax import _column_step
from taco_optax import _cpu_kernel

_ENV = 'TACO_OPTAX_KERNEL'
_CHOICES = ('auto', 'cpu', 'reference')
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

  ``implementation`` is ``'cpu'`` (the fused kernel) or ``'reference'``; it
  is what runs for the supported dtypes (float32/bfloat16 gradients, the
  default float8 history); other dtypes always run the reference.
  """
  choice = requested()
  if choice == 'reference':
    return 'reference', f'{_ENV}=reference'
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
  implementation, why = status()
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
