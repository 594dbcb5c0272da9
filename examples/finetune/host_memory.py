"""Gives the C heap's free pages back to the system after a phase that
allocates much and keeps little.

Lowering and compiling the train step (a cache hit included) allocate
hundreds of MiB in the C heap that XLA frees when it is done; glibc's
``malloc`` keeps such freed pages in its arenas, so the process's resident
set stays as high as at the phase's peak, and the training steps' own
buffers come on top (SmolLM2-135M in float32, ``--batch-size 8``, the
step loaded from the compilation cache: 1,607 MiB resident after
compiling, 1,284 MiB trimmed). ``malloc_trim(0)`` hands
them back. Elsewhere than glibc this does nothing.
"""

import ctypes
import ctypes.util
import functools
from typing import Callable, Optional


@functools.cache
def _malloc_trim() -> Optional[Callable[[int], int]]:
  name = ctypes.util.find_library('c')
  try:
    return ctypes.CDLL(name).malloc_trim if name else None
  except (OSError, AttributeError):  # Not glibc (musl, macOS, Windows).
    return None


def release_free_memory() -> bool:
  """Returns the C heap's free pages to the system; True where it could."""
  trim = _malloc_trim()
  if trim is None:
    return False
  trim(0)
  return True
