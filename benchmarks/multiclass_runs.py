"""TACO against AdamW on the multi-class tasks, over seeds (issue 33).

Every point is one run of the fine-tuning CLI, as a user runs it, one
process at a time, on a task of the example's registry (``bbc``:
BBC News topics, 5 classes; ``trec``: TREC question types, 6 classes; the
embedded ``tweets``; the out-of-domain ``tweets-to-movies``), scored on 200
held-out examples, or with ``--eval-split validation`` on the task's
validation set (issue 53: rates are chosen there, never on the held-out set
that is reported). The grid is the product of the flags; ``rule`` as a rate
is the CLI's own budget rule (the rate it picked is read back from
results.json).

``--eval-every N`` scores a run every N steps as well (a long run's curve,
in its results.json); it changes no training, so no point's name.

``--settings`` adds variants of TACO's or the schedule's settings (``k``,
``mu``, ``warmup``: ``--taco-k``, ``--taco-mu``, ``--warmup-steps``); their
runs are shown apart and left out of the rule's fit.

Each point goes to ``runs/multiclass/TASK-OPT-lrLR-stepsS-seedN`` (``LR``
is ``ruleRATE`` for the rule's current rate; a variant appends
``-NAME=VALUE``, a validation run ``-validation``) and is skipped when its
results.json exists, so a grid resumes where it stopped. ``--record`` keeps
every run's figures in ``benchmarks/data/multiclass_runs.json``, which the
budget rule's test reads (runs/ is not committed). ``--table`` and
``--write`` print :mod:`benchmarks.multiclass_tables`' tables of the
recorded runs and every finished run under ``runs/multiclass/`` (:func:`rows`),
with each optimizer's fitted rate (:mod:`benchmarks.multiclass_fit`).

    python -m benchmarks.multiclass_runs --tasks trec,bbc \\
        --optimizers taco,adamw --lrs rule --steps 40 --seeds 0,1,2
    python -m benchmarks.multiclass_runs --tasks trec --optimizers taco \
        --steps 160 --settings 'mu=0.9,warmup=0'
    python -m benchmarks.multiclass_runs --tasks tweets,bbc,trec \
        --optimizers taco --lrs 1e-4,3e-4,1e-3 --eval-split validation
    python -m benchmarks.multiclass_runs --tasks trec --steps 500 \\
        --seeds 0 --eval-every 100
    python -m benchmarks.multiclass_runs --table
    python -m benchmarks.multiclass_runs --write docs/measured/multiclass.md
    python -m benchmarks.multiclass_runs --record \\
        benchmarks/data/multiclass_runs.json
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
from benchmarks import provenance
from benchmarks.multiclass_fit import TEST
from benchmarks.multiclass_fit import VALIDATION
from benchmarks.multiclass_fit import rule_rate
from benchmarks.multiclass_fit import run_key
from benchmarks.multiclass_tables import report
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
  settings: str = ''  # e.g. 'k=32 mu=0.9' (see SETTINGS); '': the CLI's
  split: str = TEST  # the set scored: TEST (held out) or VALIDATION
  # Scored every N steps on the same set as well (a curve; 0: at the end
  # only). It changes no training, so no folder name either.
  eval_every: int = 0

  @property
  def directory(self) -> str:
    # A rule point is named with the rate the rule gives now, so a run of an
    # earlier rule is not taken for one of the current rule.
    lr = (f'rule{rule_rate(self.optimizer, self.steps):g}' if self.lr is None
          else f'{self.lr:g}')
    variant = ''.join(f'-{setting}' for setting in self.settings.split())
    if self.split != TEST:
      variant += f'-{self.split}'
    return os.path.join(ROOT, f'{self.task}-{self.optimizer}-lr{lr}-steps'
                        f'{self.steps}-seed{self.seed}{variant}')

  def flags(self) -> list[str]:
    flags = [*lr_sweep.task_flags(self.task), '--eval-size', str(EVAL_SIZE),
             '--no-checkpoint', '--no-progress', '--optimizer', self.optimizer,
             '--steps', str(self.steps), '--seed', str(self.seed)]
    if self.split != TEST:
      flags += ['--eval-split', self.split]
    if self.eval_every:
      flags += ['--eval-every', str(self.eval_every)]
    for setting in self.settings.split():
      name, value = setting.split('=')
      flags += [SETTINGS[name][0], value]
    return flags + ([] if self.lr is None else ['--lr', repr(self.lr)])


# A setting a point may change: its name -> (the CLI's flag, the field of
# results.json's config, the CLI's default).
SETTINGS = {'k': ('--taco-k', 'taco_k', 16),
            'mu': ('--taco-mu', 'taco_mu', 0.95),
            'warmup': ('--warmup-steps', 'warmup_steps', None)}


def settings_of(config: dict) -> str:
  """The settings a run's config changed from the CLI's defaults, as a
  :class:`Point` names them (``''`` for none)."""
  return ' '.join(f'{name}={config[field]:g}'
                  for name, (_, field, default) in SETTINGS.items()
                  if config.get(field, default) != default)


def grid(args) -> list[Point]:
  rates = [None if r == 'rule' else float(r) for r in args.lrs.split(',')]
  variants = [] if args.settings == 'default' else args.settings.split(',')
  for variant in variants:
    for setting in variant.split():
      name, _, value = setting.partition('=')
      if name not in SETTINGS or not value:
        raise SystemExit(f'--settings: {setting!r} is not NAME=VALUE with '
                         f'NAME one of {", ".join(SETTINGS)}')
  return [Point(task, optimizer, lr, int(steps), int(seed), variant,
                args.eval_split, args.eval_every)
          for task, steps, seed, optimizer, lr, variant in itertools.product(
              args.tasks.split(','), args.steps.split(','),
              args.seeds.split(','), args.optimizers.split(','), rates,
              [''] + variants if args.with_default else variants or [''])]


DATA = os.path.join(os.path.dirname(__file__), 'data', 'multiclass_runs.json')


def finished_runs(root: Optional[str] = None) -> list[dict]:
  """One row per results.json under ``root`` (default ROOT): the task, the
  optimizer, its rate (and whether ``--lr`` gave it), steps, seed, the
  settings changed (only where some were), the set scored (``split``) and
  its accuracy after and before training (fractions)."""
  rows = []
  for path in sorted(glob.glob(os.path.join(root or ROOT, '*',
                                            'results.json'))):
    done = api.RunResults.read(path)
    config = done.config
    rows.append({
        'task': lr_sweep.run_task(done),
        'optimizer': done.optimizer,
        'learning_rate': done.learning_rate,
        'lr_given': config['lr'] is not None, 'steps': config['steps'],
        'seed': config['seed'],
        'accuracy_after': done.after['accuracy'],
        'accuracy_before': done.before['accuracy'],
        'split': done.split})
    if settings_of(config):
      rows[-1]['settings'] = settings_of(config)
  return rows


def recorded(path: Optional[str] = None) -> list[dict]:
  """The committed rows (``DATA``; none when it does not exist)."""
  path = path or DATA
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f)['runs']


def rows() -> list[dict]:
  """The recorded rows, each replaced by a finished run of the same point,
  and the finished runs not yet recorded."""
  merged = {run_key(row): row for row in recorded()}
  merged.update((run_key(row), row) for row in finished_runs())
  return [merged[key] for key in sorted(merged, key=repr)]


def record(path: str, note: str) -> None:
  """Writes :func:`rows` to ``path`` (what the budget rule is tested on),
  its ``source`` the file's earlier source (when there is one) and
  ``note``."""
  runs = rows()  # read before the file is opened for writing
  if os.path.exists(path):
    with open(path) as f:
      note = '; '.join(filter(None, (json.load(f).get('source'), note)))
  with open(path, 'w') as f:
    json.dump({'source': note, 'runs': runs}, f, indent=0)
    f.write('\n')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tasks', default='trec,bbc')
  parser.add_argument('--optimizers', default='taco,adamw')
  parser.add_argument('--lrs', default='rule',
                      help='comma-separated rates; "rule" is the CLI\'s own')
  parser.add_argument('--steps', default='40')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--settings', default='default',
                      help='comma-separated variants, each space-separated '
                      'NAME=VALUE settings (k, mu, warmup: --taco-k, '
                      '--taco-mu, --warmup-steps); "default": the CLI\'s')
  parser.add_argument('--eval-split', choices=(TEST, VALIDATION),
                      default=TEST,
                      help='the set each run is scored on: the held-out set '
                      '(test) or the validation set that rates are chosen '
                      'on')
  parser.add_argument('--eval-every', type=int, default=0,
                      help='score every N steps as well (the run\'s curve '
                      'in its results.json; 0: at the end only)')
  parser.add_argument('--with-default', action='store_true',
                      help='with --settings: run the CLI\'s settings too')
  parser.add_argument('--deadline', type=float, default=None,
                      help='unix time after which no new point starts')
  parser.add_argument('--table', action='store_true',
                      help='print the table of finished runs and stop')
  parser.add_argument('--write', metavar='PATH',
                      help='write the tables of finished runs and stop')
  parser.add_argument('--record', metavar='PATH',
                      help='write the recorded and finished runs as JSON '
                      '(benchmarks/data/multiclass_runs.json: what the '
                      'budget rule is tested against) and stop')
  parser.add_argument('--note', default='',
                      help='with --record: where the runs come from')
  args = parser.parse_args(argv)
  if args.record:
    record(args.record, args.note or
           f'benchmarks/multiclass_runs.py runs, {provenance.stamp()}')
    return
  if args.write:
    text = provenance.captured(lambda: report(rows()))
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
  report(rows())


if __name__ == '__main__':
  main()
