"""host_memory.release_free_memory gives freed C-heap pages back."""

import ctypes
import ctypes.util

import pytest

from examples.finetune import host_memory

CHUNK = 64 * 1024  # Below glibc's mmap threshold: served from the heap.
CHUNKS = 1024      # 64 MiB.


def _resident_bytes() -> int:
  with open('/proc/self/statm') as statm:
    return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(host_memory._malloc_trim() is None,
                    reason='malloc_trim is glibc only')
def test_freed_heap_pages_are_returned():
  libc = ctypes.CDLL(ctypes.util.find_library('c'))
  libc.malloc.restype = ctypes.c_void_p
  libc.free.argtypes = [ctypes.c_void_p]
  blocks = [libc.malloc(CHUNK) for _ in range(CHUNKS)]
  for block in blocks:
    ctypes.memset(block, 1, CHUNK)  # Touched: resident.
  # The last block pins the heap's top, so free() alone returns nothing.
  for block in blocks[:-1]:
    libc.free(block)
  held = _resident_bytes()
  assert host_memory.release_free_memory()
  released = held - _resident_bytes()
  libc.free(blocks[-1])
  assert released > CHUNK * CHUNKS // 2, released
