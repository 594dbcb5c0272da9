"""The collectives in compiled HLO text, and what they move."""

import re

import numpy as np


def collectives(hlo_text):
  """``[(op, result bytes)]`` of the collectives in compiled HLO text."""
  itemsize = {'f32': 4, 's32': 4, 'u32': 4, 'pred': 1, 's8': 1, 'f8e4m3fn': 1,
              'bf16': 2, 'f16': 2}
  found = []
  pattern = re.compile(
      r'= \(?((?:\w+\[[\d,]*\][^ ]*(?:, )?)+)\)? (all-gather|all-reduce|'
      r'collective-permute|all-to-all|reduce-scatter)(?:-start)?\(')
  for line in hlo_text.splitlines():
    match = pattern.search(line)
    if not match:
      continue
    nbytes = 0
    for dtype, dims in re.findall(r'(\w+)\[([\d,]*)\]', match.group(1)):
      size = int(np.prod([int(d) for d in dims.split(',') if d]))
      nbytes += size * itemsize.get(dtype, 4)
    found.append((match.group(2), nbytes))
  return found


def gathered_bytes(hlo_text):
  return sum(b for op, b in collectives(hlo_text) if op == 'all-gather')
