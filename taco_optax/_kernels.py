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

_ENV = 'TACO_OPTAX_KERNEL'
_CHOICES = ('auto', 'cpu', 'reference')
_logger = logging.getLogger('taco_optax')
_logged = set()


def _log_once(message: str) -> None:
  if message not in _logged:
    _logged.add(message)
    _logger.info(message)


def requested() -> str:
  """The implementation asked for by ``TACO_OPTAX_KERNEL`` (default auto)."""
  choice = os.environ.get(_ENV, 'auto').strip().lower() or 'auto'
  if choice not in _CHOICES:
    raise ValueError(f'{_ENV}={choice!r}; expected one of {_CHOICES}.')
  return choice


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
  if selection is not None or requested() == 'reference':
    return _column_step.reference_column_step(
        grad_rows, values, indices, exponents, mu, update_topk,
        selection or _column_step.SINGLE_DEVICE)
  return _column_step.reference_column_step(
      grad_rows, values, indices, exponents, mu, update_topk)
