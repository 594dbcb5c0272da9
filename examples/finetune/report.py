"""What a run shows and keeps: progress, the final table, ``results.json``."""

import json
import os
import resource
import sys
import tempfile
from typing import Mapping, Optional

import jax

from examples.finetune import landed as landed_lib
from examples.finetune import results as results_lib


def write_json_atomic(path: str, payload: dict) -> None:
  """Writes ``path`` whole or not at all, readable as ``open`` would make it
  (0644 under the usual umask; ``mkstemp`` alone gives 0600)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, suffix='.tmp')
  umask = os.umask(0)
  os.umask(umask)
  try:
    os.fchmod(fd, 0o666 & ~umask)
    with os.fdopen(fd, 'w') as f:
      json.dump(payload, f, indent=2)
      f.write('\n')
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


class StepTimes:
  """The time and tokens of a run's training steps, and its throughput.

  ``tokens_per_second`` (``results.json``'s key of that name) is the
  steady-state throughput: the non-padding tokens of every step but the
  first one a process times, over those steps' time. That first step
  carries one-off work (dispatch warm-up, and compilation where the step was
  not compiled ahead), so it is left out; until a second step is timed the
  throughput is 0.0. ``train_seconds`` is the time of every step. The
  example's loop and the quality benchmark (``benchmarks/quality/runs.py``)
  both time their steps with this class, so their figures mean the same.

  Args:
    totals: :meth:`totals` of the steps before a resume; ``None``: none.
  """

  def __init__(self, totals: Optional[Mapping[str, float]] = None):
    totals = totals or {}
    self.train_seconds = float(totals.get('train_seconds', 0.0))
    self.steady_tokens = int(totals.get('steady_tokens', 0))
    self.steady_seconds = float(totals.get('steady_seconds', 0.0))
    self._timed_here = 0

  def record(self, tokens: int, seconds: float) -> None:
    """Adds one step's non-padding tokens and its time."""
    self.train_seconds += seconds
    if self._timed_here:
      self.steady_tokens += tokens
      self.steady_seconds += seconds
    self._timed_here += 1

  @property
  def tokens_per_second(self) -> float:
    """Steady-state non-padding tokens per second (see the class)."""
    if not self.steady_seconds:
      return 0.0
    return self.steady_tokens / self.steady_seconds

  def totals(self) -> dict[str, float]:
    """What a checkpoint keeps, so that a resumed run counts on."""
    return {'train_seconds': self.train_seconds,
            'steady_tokens': self.steady_tokens,
            'steady_seconds': self.steady_seconds}


def format_bytes(n: Optional[int]) -> str:
  """``n`` bytes in B/KiB/MiB/GiB; ``'n/a'`` for ``None``."""
  if n is None:
    return 'n/a'
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if n < 1024 or unit == 'GiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024


def process_memory() -> dict:
  """What ``top`` and the device saw, beside the compiled step's estimate.

  Returns:
    ``process_peak_rss_bytes``: this process's peak resident set so far
    (``getrusage``: loading, compiling and running all count);
    ``device_peak_bytes_in_use``: the device allocator's peak where the
    backend keeps one (GPU), else ``None``.
  """
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # Linux reports KiB, macOS bytes.
  rss_bytes = rss if sys.platform == 'darwin' else rss * 1024
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  # no stats on this backend
    stats = {}
  return {'process_peak_rss_bytes': int(rss_bytes),
          'device_peak_bytes_in_use': stats.get('peak_bytes_in_use')}


def results_table(results: results_lib.RunResults) -> str:
  """The paper's Table-4 figures as plain text."""
  metric = results.metric
  rows = [
      ('optimizer', results.optimizer),
      ('model', os.path.basename(str(results.model))),
      ('task', results.task),
      (f'{metric} before', f'{results.headline_before:.4f}'),
      (f'{metric} after', f'{results.headline_after:.4f}'),
      ('optimizer state', format_bytes(results.optimizer_state_bytes)),
      ('parameters', format_bytes(results.parameter_bytes)),
      ('16-bit updates', results.updates_16bit or 'n/a'),
      ('updates landed', landed_lib.summary(results.landed_updates)),
      ('peak memory', f'{format_bytes(results.peak_memory_bytes)} '
                      f'({results.peak_memory_source})'),
      ('process peak RSS', _per_process_rss(results)),
      ('tokens/s', f'{results.tokens_per_second:.1f}'),
      ('train time', f'{results.train_seconds:.1f} s '
                     f'(compile {results.compile_seconds:.1f} s)'),
      ('compile cache', compile_cache(results.compilation_cache)),
      ('wall time', f'{results.wall_seconds:.1f} s'),
      ('step path', results.step_path),
  ]
  width = max(len(k) for k, _ in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)


def compile_cache(lookup: Optional[dict]) -> str:
  """Whether the train step came from the persistent compilation cache, from
  ``results.json``'s ``compilation_cache`` (``None``: a run before it)."""
  if not lookup:
    return 'n/a'
  where = lookup['directory']
  if lookup['train_step'] == 'off':
    return 'off: train step compiled, nothing kept'
  if lookup['train_step'] == 'unused':
    return f'unused: this backend saves no compiled programs to {where}'
  if lookup['train_step'] == 'hit':
    return f'train step loaded from the cache in {where}'
  if lookup['writes']:
    return f'train step compiled (not in the cache), saved to {where}'
  return f'train step compiled (not in the cache), not saved to {where}'


def _per_process_rss(results: results_lib.RunResults) -> str:
  """This process's peak RSS, or each process's in a multi-process run."""
  each = results.process_peak_rss_bytes_per_process or []
  if len(each) < 2:
    return format_bytes(results.process_peak_rss_bytes)
  return ', '.join(f'{format_bytes(rss)} (process {i})'
                   for i, rss in enumerate(each))


class Progress:
  """A rich progress bar with loss and tokens/s on a terminal; elsewhere (logs,
  CI) a plain line every tenth of the run; nothing when disabled."""

  def __init__(self, total: int, enabled: bool, done: int = 0):
    self._bar = None
    self._total, self._done = total, done
    self._log_every = max(1, total // 10) if enabled else 0
    if enabled and sys.stderr.isatty():
      from rich import console  # pylint: disable=g-import-not-at-top
      from rich import progress  # pylint: disable=g-import-not-at-top
      self._bar = progress.Progress(
          progress.TextColumn('[bold]train'), progress.BarColumn(),
          progress.MofNCompleteColumn(), progress.TimeElapsedColumn(),
          progress.TextColumn('{task.fields[info]}'),
          console=console.Console(stderr=True))
      self._task = self._bar.add_task('train', total=total, completed=done,
                                      info='')
      self._bar.start()

  def advance(self, info: str) -> None:
    self._done += 1
    if self._bar is not None:
      self._bar.update(self._task, advance=1, info=info)
    elif self._log_every and (self._done % self._log_every == 0
                              or self._done == self._total):
      print(f'step {self._done}/{self._total}: {info}', file=sys.stderr,
            flush=True)

  def print(self, text: str) -> None:
    if self._bar is not None:
      self._bar.console.print(text)
    else:
      print(text, file=sys.stderr, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()
