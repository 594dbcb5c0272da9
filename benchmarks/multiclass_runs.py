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
budget rule's test reads (runs/ is not committed). The tables read the
recorded runs and every finished run under ``runs/multiclass/``: per (task,
optimizer, rate, steps) the accuracy per seed, the mean and its standard
error; TACO minus AdamW (at the rule's rate, same task, steps and seed),
paired over seeds; and per optimizer the rate that falls least short of each
task's best mean over seeds on the validation sets (:func:`fitted_rate`;
validation runs are listed with ``eval=validation`` in the settings column).

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
from benchmarks.multiclass_fit import fit_report
from benchmarks.multiclass_fit import long_budget_rate
from benchmarks.multiclass_fit import predates_split
from benchmarks.multiclass_fit import round_rate
from benchmarks.multiclass_fit import rule_rate
from benchmarks.multiclass_fit import split_of
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


def _key(row: dict) -> tuple:
  # A run on today's split never replaces a pre-split one: they differ.
  return (row['task'], row['optimizer'], row['learning_rate'],
          row['lr_given'], row['steps'], row['seed'], row.get('settings', ''),
          split_of(row), predates_split(row))


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
  merged = {_key(row): row for row in recorded()}
  merged.update((_key(row), row) for row in finished_runs())
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


def finished(table_rows: Optional[list[dict]] = None) -> dict:
  """``{(task, optimizer, lr, steps, settings): {seed: (after, before)}}``
  in percent, from ``table_rows`` (default :func:`rows`); a rate the rule
  gave and the same rate given with ``--lr`` are one rate; a validation
  run's settings end with ``eval=validation``, those of a run recorded
  before validation sets existed with ``pre-split`` (:func:`predates_split`),
  so that neither is in the summary."""
  table = {}
  for row in rows() if table_rows is None else table_rows:
    task, optimizer, lr, _, steps, seed, settings, split, _ = _key(row)
    if split != TEST:
      settings = f'{settings} eval={split}'.strip()
    elif predates_split(row):
      settings = f'{settings} pre-split'.strip()
    table.setdefault((task, optimizer, round_rate(lr), steps, settings), {})[
        seed] = (100 * row['accuracy_after'], 100 * row['accuracy_before'])
  return table


def _scored(settings: str) -> str:
  """The part of a table key's settings that says which runs it may be
  compared with (``eval=validation``, ``pre-split``), not what it changed."""
  return ' '.join(word for word in settings.split()
                  if word == 'pre-split' or word.startswith('eval='))


def _pm(mean: float, se: float, sign: str = '') -> str:
  """``mean ± se`` to a tenth (``mean`` alone for one seed)."""
  return (f'{mean:{sign}.1f}' if se != se else
          f'{mean:{sign}.1f} ± {se:.1f}')


def mean_se(values) -> tuple[float, float]:
  """The mean and its standard error (NaN for one value)."""
  summary = api.seed_summary(list(values))
  return summary.mean, float('nan') if summary.error is None else summary.error


def _rate(lr, optimizer, steps):
  rule = lr == round_rate(rule_rate(optimizer, steps))
  return f'{lr:.2g}' + (' (rule)' if rule else '')


def _classes(task: str) -> int:
  return len(api.task(task).labels)


def _paired(data: dict, task: str, steps: int, rates: dict,
            min_seeds: int = 2) -> Optional[tuple[int, str]]:
  """TACO against AdamW on one task at ``rates`` (``{optimizer: lr}``): the
  number of seeds both ran and the cells ``TACO | AdamW | TACO − AdamW``
  (mean ± se over those seeds, the difference paired); ``None`` with fewer
  than ``min_seeds`` such seeds."""
  taco, adamw = (data.get((task, name, round_rate(rates[name]), steps, ''),
                          {}) for name in ('taco', 'adamw'))
  common = sorted(set(taco) & set(adamw))
  if len(common) < min_seeds:
    return None
  cells = [mean_se([arm[s][0] for s in common]) for arm in (taco, adamw)]
  diff = mean_se([taco[s][0] - adamw[s][0] for s in common])
  return len(common), (' | '.join(_pm(*cell) for cell in cells)
                       + f' | {_pm(*diff, sign="+")}')


def _rule_rates(steps: int) -> dict:
  return {name: rule_rate(name, steps) for name in ('taco', 'adamw')}


def summary(data: dict, steps: int = 40) -> list[str]:
  """TACO against AdamW, each at its rule's rate, per task: the seeds both
  ran, each one's mean ± se and their paired difference (a table's lines;
  none where no task has two such seeds)."""
  lines = []
  for task in sorted({key[0] for key in data}):
    paired = _paired(data, task, steps, _rule_rates(steps))
    if paired is not None:
      lines.append(f'| {task} | {_classes(task)} | {paired[0]} | '
                   f'{paired[1]} |')
  if not lines:
    return []
  return ['| task | classes | seeds | TACO | AdamW | TACO − AdamW, paired |',
          '| --- | ---: | ---: | ---: | ---: | ---: |', *lines]


def long_budget_rates(table_rows: list[dict], steps: int) -> dict:
  """Each optimizer's rate at a budget past 40 steps: the one its validation
  runs there favour (:func:`long_budget_rate`), else its rule's."""
  rates = _rule_rates(steps)
  for name in rates:
    chosen = long_budget_rate(table_rows, name, steps)
    if chosen is not None:
      rates[name] = chosen[0]
  return rates


def quality_table(data: dict, table_rows: list[dict]) -> list[str]:
  """The README's table: per task, TACO against AdamW at the CLI's 40
  steps, each at its rule's rate (two or more seeds), and at each longer
  budget with runs on today's splits, each at :func:`long_budget_rates`
  (one seed or more); a table's lines."""
  lines = []
  budgets = sorted({key[3] for key in data if not _scored(key[4])})
  for task in sorted({key[0] for key in data}):
    for steps in budgets:
      rates = (_rule_rates(40) if steps == 40 else
               long_budget_rates(table_rows, steps))
      paired = _paired(data, task, steps, rates, 2 if steps == 40 else 1)
      if paired is not None:
        lines.append(f'| {task} | {_classes(task)} | {steps} | '
                     f'{rates["taco"]:.2g} | {rates["adamw"]:.2g} | '
                     f'{paired[0]} | {paired[1]} |')
  if not lines:
    return []
  return ['| task | classes | steps | TACO lr | AdamW lr | seeds | TACO | '
          'AdamW | TACO − AdamW, paired |',
          '| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |',
          *lines]


def _long_budget_note(table_rows: list[dict], steps: int) -> str:
  """Where each optimizer's rate at ``steps`` comes from."""
  parts = []
  for name in ('taco', 'adamw'):
    chosen = long_budget_rate(table_rows, name, steps)
    label = 'TACO' if name == 'taco' else 'AdamW'
    if chosen is None:
      parts.append(f'{label} {rule_rate(name, steps):.2g} (its rule\'s rate; '
                   'no choice of rates on validation sets at this budget)')
    else:
      rate, tasks, seeds = chosen
      parts.append(f'{label} {rate:.2g} (chosen on the validation sets of '
                   f'{", ".join(tasks)} at this budget, {seeds} seed'
                   f'{"s" if seeds > 1 else ""} a rate; the rule gives '
                   f'{rule_rate(name, steps):.2g})')
  return f'{steps} steps: ' + ', '.join(parts)


def report() -> None:
  """Prints the tables of the recorded and finished runs."""
  data = finished()
  print(f'TACO and AdamW at the CLI\'s defaults (40 steps x batch 4, each at '
        f'its budget rule\'s rate: TACO {rule_rate("taco", 40):.2g}, AdamW '
        f'{rule_rate("adamw", 40):.2g}), held-out accuracy (%), mean ± '
        'standard error over seeds:\n')
  print('\n'.join(summary(data)) or
        'No task has two seeds of both at these rates on today\'s split yet.')
  table_rows = rows()
  longer = sorted({key[3] for key in data if not _scored(key[4])} - {40})
  table = quality_table(data, table_rows)
  if any(line.split(' | ')[2] != '40' for line in table[2:]):
    print('\nThe same beside the longer budgets (TACO − AdamW paired over '
          'the seeds both ran; one seed: no error), each optimizer at '
          + '; at '.join(_long_budget_note(table_rows, steps)
                      for steps in longer) + ':\n')
    print('\n'.join(table))
  for steps in sorted({key[3] for key in data} - {40}):
    table = summary(data, steps)
    if table:
      print(f'\nThe same at {steps} steps (TACO '
            f'{rule_rate("taco", steps):.2g}, AdamW '
            f'{rule_rate("adamw", steps):.2g} by the rule; the warm-up is '
            f'{api.default_warmup(steps)} steps):\n')
      print('\n'.join(table))
  print()
  seeds_seen = sorted({s for seeds in data.values() for s in seeds})
  print('Accuracy (%) on 200 held-out examples (with `eval=validation`, on '
        'the task\'s validation set), one CLI run per cell. `pre-split`: '
        'recorded before validation sets existed, its run trained on a set '
        'that still held the validation records; such runs are in no '
        'summary.\n')
  print('| task | optimizer | lr | steps | settings | ' +
        ' | '.join(f'seed {s}' for s in seeds_seen) +
        ' | mean ± se | zero-shot |')
  print('| --- | --- | ---: | ---: | --- |'
        + ' ---: |' * (len(seeds_seen) + 2))
  for (task, opt, lr, steps, settings), seeds in sorted(data.items()):
    mean, se = mean_se([a for a, _ in seeds.values()])
    cells = ' | '.join(f'{seeds[s][0]:.1f}' if s in seeds else '–'
                       for s in seeds_seen)
    before = '/'.join(sorted({f'{b:.1f}' for _, b in seeds.values()}))
    print(f'| {task} | {opt} | {_rate(lr, opt, steps)} | {steps} | '
          f'{settings or "–"} | {cells} | {_pm(mean, se)} | {before} |')
  print('\nTACO − AdamW (AdamW at the rule\'s rate and the CLI\'s '
        'settings, scored on the same set and trained on the same split), '
        'paired by task, steps and seed:\n')
  print('| task | TACO lr | steps | TACO settings | seeds | differences | '
        'mean ± se |')
  print('| --- | ---: | ---: | --- | --- | --- | ---: |')
  for (task, opt, lr, steps, settings), seeds in sorted(data.items()):
    base = data.get((task, 'adamw', round_rate(rule_rate('adamw', steps)),
                     steps, _scored(settings)))
    common = sorted(set(seeds) & set(base or {}))
    if opt != 'taco' or not common:
      continue
    diffs = [seeds[s][0] - base[s][0] for s in common]
    mean, se = mean_se(diffs)
    print(f'| {task} | {_rate(lr, opt, steps)} | {steps} | '
          f'{settings or "–"} | {",".join(map(str, common))} | '
          f'{" ".join(f"{d:+.1f}" for d in diffs)} | {_pm(mean, se, "+")} |')
  for steps in sorted({key[3] for key in data}):
    fit_report(rows(), steps)


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
