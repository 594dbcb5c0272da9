"""What a run is doing: a line when a phase starts, its duration at the end.

Loading a model, tokenising, compiling and evaluating each take seconds to
minutes; without these lines a piped run (logs, CI) would look hung. Lines are
flushed at once so that a pipe sees them when they happen. Phases with a size
(evaluation batches) also get a progress bar when stderr is a terminal.
"""

import contextlib
import sys
import time
from typing import Callable, Iterable, Iterator, TypeVar

Item = TypeVar('Item')


def flushed_print(text: str) -> None:
  """``print`` that reaches a pipe now, not when the buffer fills."""
  print(text, flush=True)


@contextlib.contextmanager
def phase(description: str,
          log: Callable[[str], None] = flushed_print) -> Iterator[None]:
  """Logs ``description ...`` now and ``description: N.N s`` when done."""
  log(f'{description} ...')
  began = time.perf_counter()
  yield
  log(f'{description}: {time.perf_counter() - began:.1f} s')


def tracker(description: str, enabled: bool
            ) -> Callable[[Iterable[Item], int], Iterable[Item]]:
  """A function that wraps an iterable of known length in a progress bar.

  Args:
    description: the bar's label.
    enabled: show bars at all (``--no-progress`` turns them off).

  Returns:
    ``track(items, total)``: ``items`` itself unless a bar is shown, i.e.
    unless ``enabled`` and stderr is a terminal.
  """
  if not enabled or not sys.stderr.isatty():
    return lambda items, total: items

  def track(items: Iterable[Item], total: int) -> Iterator[Item]:
    from rich import console  # pylint: disable=g-import-not-at-top
    from rich import progress  # pylint: disable=g-import-not-at-top
    with progress.Progress(
        progress.TextColumn(f'[bold]{description}'), progress.BarColumn(),
        progress.MofNCompleteColumn(), progress.TimeElapsedColumn(),
        console=console.Console(stderr=True), transient=True) as bar:
      yield from bar.track(items, total=total)

  return track
