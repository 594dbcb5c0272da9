"""``python -m examples.finetune.compare DIR [DIR ...]``: runs side by side.

Reads each run directory's ``results.json`` (as ``python -m examples.finetune``
writes it), prints one table (optimizer, learning rate, steps, the task metric
before and after, optimizer state, compiled and process peak memory, tokens/s,
wall time, parameters and how 16-bit updates landed: ``--rounding``), then,
for runs that differ only in ``--seed``, the metric's mean and standard error
per setting and the difference between two optimizers (``seeds``), and
writes a PNG of the training loss and the metric against the step.
The PNG needs matplotlib (``pip install -e ".[bench]"``); without it the
table is still printed. Paths that hold no ``results.json``
(an unfinished run, the PNG of an earlier comparison) are skipped with a note.
"""

import argparse
import os
import sys
from typing import Optional, Sequence

from examples.finetune import results as results_lib
from examples.finetune import seeds

_MIB = 1024 ** 2


Runs = Sequence[tuple[str, results_lib.RunResults]]


def read_runs(directories: Sequence[str]
              ) -> tuple[list[tuple[str, results_lib.RunResults]], list[str]]:
  """``([(directory, results)], [skipped path])`` in the order given."""
  runs, skipped = [], []
  for directory in directories:
    found = results_lib.find(directory)
    if found is None:
      skipped.append(directory)
    else:
      runs.append((directory, found))
  return runs, skipped


def _mib(n: Optional[int]) -> str:
  return 'n/a' if n is None else f'{n / _MIB:.1f}'


def table(runs: Runs) -> str:
  """One row per run, columns aligned; the metric is each run's own."""
  header = ('run', 'optimizer', 'lr', 'steps', 'metric', 'before', 'after',
            'state MiB', 'peak MiB (compiled)', 'process peak RSS MiB',
            'tokens/s', 'wall s', 'params MiB', 'rounding')
  rows = [header]
  for directory, results in runs:
    rows.append((
        os.path.basename(os.path.normpath(directory)),
        results.optimizer, f'{results.learning_rate:g}',
        str(len(results.losses)), results.metric,
        f'{results.headline_before:.4f}', f'{results.headline_after:.4f}',
        _mib(results.optimizer_state_bytes),
        _mib(results.peak_memory_bytes),
        # Runs from before the process peak was recorded have none.
        _mib(results.process_peak_rss_bytes),
        f'{results.tokens_per_second:.1f}',
        f'{results.wall_seconds:.1f}',
        _mib(results.parameter_bytes),
        # Runs from before --rounding existed name none.
        results.rounding or 'n/a'))
  widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
  return '\n'.join('  '.join(cell.ljust(width) for cell, width
                             in zip(row, widths)).rstrip() for row in rows)


_SET_NAMES = {'test': 'held-out', 'validation': 'validation'}


def running_mean(values: Sequence[float], window: int) -> list[float]:
  """The mean of each value and the ``window - 1`` before it (fewer at the
  start)."""
  sums = [0.0]
  for value in values:
    sums.append(sums[-1] + value)
  return [(sums[i + 1] - sums[max(0, i + 1 - window)])
          / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def metric_title(runs: Runs) -> str:
  """The metric panel's title: the sets the runs scored and their metrics,
  e.g. ``validation accuracy`` or ``held-out / validation accuracy``."""
  sets = sorted({_SET_NAMES.get(r.split, r.split) for _, r in runs})
  return ' / '.join(sets) + ' ' + ' / '.join(sorted({r.metric
                                                     for _, r in runs}))


def plot(runs: Runs, path: str) -> None:
  """Writes the loss and metric curves of every run to ``path``: each
  step's loss faint, under its running mean over a twentieth of the run,
  and the metric on the set the runs scored (held-out or validation).

  Raises:
    ImportError: matplotlib is not installed.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')  # No display needed.
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  figure, (loss_axes, metric_axes) = pyplot.subplots(1, 2, figsize=(11, 4.5))
  for directory, results in runs:
    label = (f"{os.path.basename(os.path.normpath(directory))} "
             f'({results.optimizer}, lr {results.learning_rate:g})')
    losses = results.losses
    steps = range(1, len(losses) + 1)
    window = max(1, len(losses) // 20)
    if window > 1:
      raw, = loss_axes.plot(steps, losses, alpha=0.2, linewidth=0.6)
      loss_axes.plot(steps, running_mean(losses, window),
                     color=raw.get_color())
    else:
      loss_axes.plot(steps, losses)
    metric = results.metric
    points = [(0, results.headline_before)] + [
        (e['step'], e[metric]) for e in results.evals]
    metric_axes.plot(*zip(*points), marker='o', label=label)
  longest = max(len(results.losses) for _, results in runs)
  loss_axes.set(xlabel='step', ylabel='training loss',
                title=('loss (each step, and its running mean over '
                       f'{max(1, longest // 20)} steps)' if longest >= 40
                       else 'loss'))
  metric_axes.set(xlabel='step',
                  ylabel=' / '.join(sorted({r.metric for _, r in runs})),
                  title=metric_title(runs))
  figure.legend(*metric_axes.get_legend_handles_labels(), fontsize='small',
                loc='lower center', ncol=2 if len(runs) > 3 else 1,
                frameon=False)
  rows = (len(runs) + 1) // 2 if len(runs) > 3 else len(runs)
  figure.tight_layout(rect=(0, min(0.45, 0.05 * rows + 0.02), 1, 1))
  figure.savefig(path, dpi=100)
  pyplot.close(figure)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog='python -m examples.finetune.compare',
      description='Compare fine-tuning runs: one table and a PNG of the '
                  'loss and held-out metric curves.')
  parser.add_argument('directories', nargs='+', metavar='DIR',
                      help='run directories (each with a results.json)')
  parser.add_argument('--plot', default=None, metavar='PNG',
                      help='where the PNG goes (default: compare.png in the '
                           'directory that holds the first run)')
  args = parser.parse_args(argv)
  runs, skipped = read_runs(args.directories)
  for path in skipped:
    print(f'skipped {path}: no results.json', file=sys.stderr)
  if not runs:
    print('error: no run directory with a results.json', file=sys.stderr)
    return 2
  print(table(runs))
  over_seeds = seeds.table(runs)
  if over_seeds is not None:
    print(f'\nover seeds\n{over_seeds}')
  png = args.plot or os.path.join(
      os.path.dirname(os.path.normpath(runs[0][0])), 'compare.png')
  try:
    plot(runs, png)
  except ImportError:
    print('\nthe PNG of the curves needs matplotlib: '
          'pip install -e ".[bench]"')
    return 0
  print(f'\ncurves: {png}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
