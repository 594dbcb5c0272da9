"""TACO against AdamW on the multi-class tasks, over seeds (issue 33).

Every point is one run of the fine-tuning CLI, as a user runs it, one
process at a time, on a task of :mod:`benchmarks.multiclass_task` (``bbc``:
BBC News topics, 5 classes; ``trec``: TREC question types, 6 classes) or the
embedded ``tweets``, scored on 200 held-out examples. The grid is the product
of the flags; ``rule`` as a rate is the CLI's own budget rule (the rate it
picked is read back from results.json).

Each point goes to ``runs/multiclass/TASK-OPT-lrLR-stepsS-seedN`` and is
skipped when its results.json exists, so a grid resumes where it stopped.
The table reads every finished run under ``runs/multiclass/``: per (task,
optimizer, rate, steps) the accuracy per seed, the mean and its standard
error, and TACO minus AdamW (at the rule's rate, same task, steps and seed),
paired over seeds.

    python -m benchmarks.multiclass_runs --tasks trec,bbc \\
        --optimizers taco,adamw --lrs rule --steps 40 --seeds 0,1,2
    python -m benchmarks.multiclass_runs --table
    python -m benchmarks.multiclass_runs --write docs/multiclass.md
"""

import argparse
import dataclasses
import glob
import itertools
import json
import os
import time
from typing import Optional

from benchmarks import lr_sweep
from benchmarks import multiclass_task
from benchmarks import provenance
from examples.finetune import api

ROOT = os.path.join('runs', 'multiclass')
EVAL_SIZE = 200


@dataclasses.dataclass(frozen=True)
class Point:
  task: str
  optimizer: str
  lr: Optional[float]  # None: the CLI's budget rule
  steps: int
  seed: int

  @property
  def directory(self) -> str:
    lr = 'rule' if self.lr is None else f'{self.lr:g}'
    return os.path.join(ROOT, f'{self.task}-{self.optimizer}-lr{lr}-steps'
                        f'{self.steps}-seed{self.seed}')

  def flags(self) -> list[str]:
    task = ([] if self.task == 'tweets' else
            multiclass_task.task_flags(self.task, os.path.join(ROOT, 'data')))
    flags = [*task, '--eval-size', str(EVAL_SIZE), '--no-checkpoint',
             '--no-progress', '--optimizer', self.optimizer,
             '--steps', str(self.steps), '--seed', str(self.seed)]
    return flags + ([] if self.lr is None else ['--lr', repr(self.lr)])


def grid(args) -> list[Point]:
  rates = [None if r == 'rule' else float(r) for r in args.lrs.split(',')]
  return [Point(task, optimizer, lr, int(steps), int(seed))
          for task, steps, seed, optimizer, lr in itertools.product(
              args.tasks.split(','), args.steps.split(','),
              args.seeds.split(','), args.optimizers.split(','), rates)]


def finished() -> dict:
  """``{(task, optimizer, lr, lr_given, steps): {seed: (after, before)}}``
  in percent, from every results.json under ROOT."""
  table = {}
  for path in sorted(glob.glob(os.path.join(ROOT, '*', 'results.json'))):
    with open(path) as f:
      done = json.load(f)
    config = done['config']
    task = (os.path.basename(config['train_file']).split('-')[0]
            if config['task'] == 'text' else config['task'])
    key = (task, done['optimizer'], done['learning_rate'],
           config['lr'] is not None, config['steps'])
    table.setdefault(key, {})[config['seed']] = (
        100 * done['after']['accuracy'], 100 * done['before']['accuracy'])
  return table


def mean_se(values) -> tuple[float, float]:
  """The mean and its standard error (NaN for one value)."""
  summary = api.seed_summary(list(values))
  return summary.mean, float('nan') if summary.error is None else summary.error


def _rate(lr, given):
  return f'{lr:.2g}' + ('' if given else ' (rule)')


def report() -> None:
  """Prints both tables of the finished runs."""
  data = finished()
  seeds_seen = sorted({s for seeds in data.values() for s in seeds})
  print('Accuracy (%) on 200 held-out examples, one CLI run per cell.\n')
  print('| task | optimizer | lr | steps | ' +
        ' | '.join(f'seed {s}' for s in seeds_seen) +
        ' | mean ± se | zero-shot |')
  print('| --- | --- | ---: | ---: |' + ' ---: |' * (len(seeds_seen) + 2))
  for (task, opt, lr, given, steps), seeds in sorted(data.items()):
    mean, se = mean_se([a for a, _ in seeds.values()])
    cells = ' | '.join(f'{seeds[s][0]:.1f}' if s in seeds else '–'
                       for s in seeds_seen)
    before = '/'.join(sorted({f'{b:.1f}' for _, b in seeds.values()}))
    print(f'| {task} | {opt} | {_rate(lr, given)} | {steps} | {cells} | '
          f'{mean:.1f} ± {se:.1f} | {before} |')
  print('\nTACO − AdamW (AdamW at the rule\'s rate), paired by task, steps '
        'and seed:\n')
  print('| task | TACO lr | steps | seeds | differences | mean ± se |')
  print('| --- | ---: | ---: | --- | --- | ---: |')
  for (task, opt, lr, given, steps), seeds in sorted(data.items()):
    base = data.get(next((k for k in data if k[0] == task and
                          k[1] == 'adamw' and not k[3] and k[4] == steps),
                         None))
    common = sorted(set(seeds) & set(base or {}))
    if opt != 'taco' or not common:
      continue
    diffs = [seeds[s][0] - base[s][0] for s in common]
    mean, se = mean_se(diffs)
    print(f'| {task} | {_rate(lr, given)} | {steps} | '
          f'{",".join(map(str, common))} | '
          f'{" ".join(f"{d:+.1f}" for d in diffs)} | {mean:+.1f} ± {se:.1f} |')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tasks', default='trec,bbc')
  parser.add_argument('--optimizers', default='taco,adamw')
  parser.add_argument('--lrs', default='rule',
                      help='comma-separated rates; "rule" is the CLI\'s own')
  parser.add_argument('--steps', default='40')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--deadline', type=float, default=None,
                      help='unix time after which no new point starts')
  parser.add_argument('--table', action='store_true',
                      help='print the table of finished runs and stop')
  parser.add_argument('--write', metavar='PATH',
                      help='write the tables of finished runs and stop')
  args = parser.parse_args(argv)
  if args.write:
    text = provenance.captured(report)
    with open(args.write, 'w') as f:
      f.write('# TACO and AdamW on multi-class tasks, over seeds (written by '
              f'`python -m benchmarks.multiclass_runs --write {args.write}`)'
              f'\n\n{provenance.stamp()}.\n\n{text}')
    return
  if not args.table:
    for point in grid(args):
      if (args.deadline is not None and time.time() > args.deadline
          and lr_sweep.result(point.directory) is None):
        print('deadline passed; stopping before', point.directory)
        break
      lr_sweep.cli_run(point.directory, point.flags())
  report()


if __name__ == '__main__':
  main()
