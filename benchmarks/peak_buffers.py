"""What is alive at a compiled program's peak, buffer by buffer (XLA's dump).

With ``XLA_FLAGS=--xla_dump_to=DIR`` XLA writes, for each compiled module, a
``*-live-range.txt`` file whose last section, *Stack trace breakdown for peak
usage*, lists every buffer alive at the peak of its heap simulation, grouped
by the JAX operation that made it (``jit(step_fn)/dot_general``,
``params[1][3]['mlp']['up']['kernel']``, ...). :func:`peak_breakdown` reads
that section; :func:`grouped` folds the entries into a few kinds, so one
line says "the forward's gathered weights" instead of a hundred.
"""

import collections
import glob
import os
import re
from typing import NamedTuple, Optional

_HEADER = re.compile(r'Stack trace breakdown for peak usage: ([\d ]+) bytes')
_ENTRY = re.compile(r'^ {6}[├└]── (.*) \([\d.]+%, total: ([\d ]+) bytes')


class PeakEntry(NamedTuple):
  """One top-level entry of XLA's peak breakdown: its name and bytes."""
  name: str
  nbytes: int


class PeakBreakdown(NamedTuple):
  """XLA's heap-simulated peak of one module and what it holds."""
  module: str
  peak_bytes: int
  entries: tuple[PeakEntry, ...]


def _number(text: str) -> int:
  return int(text.replace(' ', ''))


def parse(text: str, module: str = '') -> Optional[PeakBreakdown]:
  """The breakdown in a ``*-live-range.txt`` file's ``text``, or None."""
  lines = text.splitlines()
  for i, line in enumerate(lines):
    header = _HEADER.search(line)
    if header:
      break
  else:
    return None
  entries = []
  for line in lines[i + 1:]:
    match = _ENTRY.match(line)
    if match:
      entries.append(PeakEntry(match.group(1), _number(match.group(2))))
  return PeakBreakdown(module, _number(header.group(1)), tuple(entries))


def peak_breakdown(dump_dir: str, module_pattern: str = 'step'
                   ) -> Optional[PeakBreakdown]:
  """The breakdown of the largest dumped module whose name matches
  ``module_pattern`` (the train step's ``jit_step_fn``), or None."""
  found = []
  for path in glob.glob(os.path.join(dump_dir, '*-live-range.txt')):
    name = os.path.basename(path)
    if re.search(module_pattern, name):
      with open(path) as f:
        breakdown = parse(f.read(), name)
      if breakdown is not None:
        found.append(breakdown)
  return max(found, key=lambda b: b.peak_bytes, default=None)


def kind(name: str) -> str:
  """A breakdown entry's row: the arguments in one, else the JAX operation
  (without the ``jit(...)/`` prefix every entry shares)."""
  if name.startswith(('params', 'opt_state', 'batch')):
    return 'arguments: weights, optimizer state, batch'
  return re.sub(r'^jit\([^)]*\)/', '', name)


def grouped(breakdown: PeakBreakdown, top: int = 8
            ) -> list[tuple[str, int, int]]:
  """``[(kind, bytes, entries)]``, largest first, the rest in one row."""
  sums = collections.Counter()
  counts = collections.Counter()
  for entry in breakdown.entries:
    group = kind(entry.name)
    sums[group] += entry.nbytes
    counts[group] += 1
  rows = [(group, nbytes, counts[group])
          for group, nbytes in sums.most_common()]
  if len(rows) > top:
    rest = rows[top:]
    rows = rows[:top] + [('everything else', sum(r[1] for r in rest),
                          sum(r[2] for r in rest))]
  return rows
