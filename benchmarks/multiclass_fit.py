"""Which rate the multi-class runs favour: per task the mean over seeds at
each rate, and the rate that falls least short of every task's best.

Rates are fitted on validation runs (``--eval-split validation``, issue 53);
the fit on the held-out set that the README reports (``split=TEST``) is the
legacy one the budget rule's constants came from before validation runs
existed. :mod:`benchmarks.multiclass_runs` runs and records,
:mod:`benchmarks.multiclass_tables` tabulates.
"""

from typing import Optional

from benchmarks import lr_sweep
from examples.finetune import api

# The sets a run is scored on (``--eval-split``).
TEST, VALIDATION = 'test', 'validation'


class NoValidationRuns(ValueError):
  """A rate was to be fitted on validation runs and there are none."""


def split_of(row: dict) -> str:
  """The set a row's accuracy is on; rows recorded before validation sets
  existed were all scored on the held-out set."""
  return row.get('split', TEST)


def predates_split(row: dict) -> bool:
  """Whether a row was recorded before validation sets existed (it names no
  ``split``): its run trained on a set that still held the validation
  records, so it is kept out of the tables that compare optimizers on the
  held-out set, and only the legacy fit (``split=TEST``) reads it."""
  return 'split' not in row


def run_key(row: dict) -> tuple:
  """What makes a row's run one point: task, optimizer, rate, whether
  ``--lr`` gave it, steps, seed, settings, the set scored, and whether it
  predates the split (a run on today's split never replaces a pre-split
  one: they differ)."""
  return (row['task'], row['optimizer'], row['learning_rate'],
          row['lr_given'], row['steps'], row['seed'], row.get('settings', ''),
          split_of(row), predates_split(row))


def seed_means(table_rows: list[dict], optimizer: str, steps: int = 40,
               min_seeds: int = 3, *, split: str = VALIDATION) -> dict:
  """``{task: {lr: (mean accuracy, zero-shot)}}`` over seeds, for the rates
  run with at least ``min_seeds`` seeds (the rule's rate and the same rate
  given with ``--lr`` are one rate). A task's rates are averaged over the
  seeds they all ran, so that no rate gains from easier seeds; where fewer
  than ``min_seeds`` are common, each over its own. Runs that changed a
  setting are left out: the rule is for the CLI's settings; so are runs
  scored on another set than ``split``. ``TEST`` is the legacy fit, over the
  runs recorded before validation sets existed (:func:`predates_split`):
  held-out runs since are reported, never fitted on."""
  by_rate = {}
  for row in table_rows:
    if (row['optimizer'] == optimizer and row['steps'] == steps
        and not row.get('settings') and split_of(row) == split
        and (split != TEST or predates_split(row))):
      lr = round_rate(row['learning_rate'])
      by_rate.setdefault(row['task'], {}).setdefault(lr, {})[row['seed']] = (
          row['accuracy_after'], row['accuracy_before'])
  means = {}
  for task, rates in by_rate.items():
    rates = {lr: seeds for lr, seeds in rates.items()
             if len(seeds) >= min_seeds}
    if not rates:
      continue
    common = set.intersection(*(set(seeds) for seeds in rates.values()))
    for lr, seeds in rates.items():
      used = sorted(common) if len(common) >= min_seeds else sorted(seeds)
      after = [seeds[s][0] for s in used]
      means.setdefault(task, {})[lr] = (sum(after) / len(after),
                                        seeds[used[0]][1])
  return means


def fitted_rate(table_rows: list[dict], optimizer: str, steps: int = 40, *,
                split: str = VALIDATION,
                min_seeds: int = 3) -> Optional[float]:
  """The rate, among those run on every task over seeds, whose mean accuracy
  falls least short of each task's best (:func:`lr_sweep.robust_rate`).

  Args:
    table_rows: the runs (:func:`rows`).
    optimizer: whose rate.
    steps: the budget.
    min_seeds: the seeds a rate needs on a task to count there
      (:func:`seed_means`); the budget rule is fitted with three, a long
      budget's first runs (:func:`long_budget_rate`) with one.
    split: the runs fitted on: ``VALIDATION`` (what a rate is chosen on);
      ``TEST`` is the legacy fit on the held-out set that the README reports,
      the data the budget rule's constants were fitted on before validation
      runs existed: a rate chosen there is not a measurement of how it
      carries to unseen data.

  Raises:
    NoValidationRuns: ``split`` is ``VALIDATION`` and no validation run of
      ``optimizer`` at ``steps`` (with the CLI's settings) is among the rows.
  """
  if split == VALIDATION and not any(
      split_of(row) == VALIDATION and row['optimizer'] == optimizer
      and row['steps'] == steps and not row.get('settings')
      for row in table_rows):
    raise NoValidationRuns(
        f'no validation runs of {optimizer} at {steps} steps to fit a rate '
        'on: run `python -m benchmarks.multiclass_runs --eval-split '
        'validation` (split=TEST is the legacy fit on the held-out set)')
  return lr_sweep.robust_rate(list(seed_means(
      table_rows, optimizer, steps, min_seeds, split=split).values()))


def long_budget_rate(table_rows: list[dict], optimizer: str,
                     steps: int) -> Optional[tuple[float, list[str], int]]:
  """The rate that validation runs at a budget past 40 steps favour, before
  they are enough for the rule's fit: :func:`fitted_rate` over every task
  with validation runs at ``steps``, counting a rate run with one seed.
  ``(rate, tasks, seeds)``, the seeds being the fewest any task's chosen rate
  ran; ``None`` where fewer than two rates ran on every such task (one rate
  is no choice)."""
  means = seed_means(table_rows, optimizer, steps, 1, split=VALIDATION)
  if not means or len(set.intersection(
      *(set(rates) for rates in means.values()))) < 2:
    return None
  rate = fitted_rate(table_rows, optimizer, steps, min_seeds=1)
  seeds = min(len({row['seed'] for row in table_rows
                   if row['optimizer'] == optimizer and row['task'] == task
                   and row['steps'] == steps and not row.get('settings')
                   and split_of(row) == VALIDATION
                   and round_rate(row['learning_rate']) == rate})
              for task in means)
  return rate, sorted(means), seeds


def rule_rate(optimizer: str, steps: int) -> float:
  """The CLI's budget-rule rate for ``optimizer`` at ``steps``."""
  return api.optimizer(optimizer).default_rate(steps).lr


def round_rate(lr: float) -> float:
  """A rate to the two digits it is named by (a rate the rule gave and the
  same rate given with ``--lr`` are one rate)."""
  return float(f'{lr:.2g}')


def sensitivity(table_rows: list[dict], optimizer: str, steps: int = 40, *,
                split: str = VALIDATION,
                rate: Optional[float] = None) -> dict:
  """What a rate off by 2x costs: per task, the mean accuracy over seeds at
  half and at twice the fitted rate (:func:`fitted_rate`) minus that at the
  fitted rate, ``{task: (at half, at twice)}``, in accuracy (a fraction);
  ``None`` where that rate was not run over three or more seeds. The rates
  are matched to within 5% (a grid doubles 5.6e-4 to 1.1e-3). ``rate``:
  the fitted rate when the caller has it already."""
  if rate is None:
    rate = fitted_rate(table_rows, optimizer, steps, split=split)
  if rate is None:
    return {}
  changes = {}
  for task, scores in seed_means(table_rows, optimizer, steps,
                                 split=split).items():
    at = {factor: next((scores[lr][0] for lr in scores
                        if abs(lr / (rate * factor) - 1) < 0.05), None)
          for factor in (0.5, 1, 2)}
    if at[1] is not None:
      changes[task] = tuple(None if at[f] is None else at[f] - at[1]
                            for f in (0.5, 2))
  return changes


def fit_report(table_rows: list[dict], steps: int = 40) -> None:
  """Per set scored, optimizer and task, the mean accuracy over seeds at
  each rate run with three or more seeds, and the rate fitted over the
  tasks: on the validation sets, and the legacy fit on the held-out sets."""
  for split, name in ((VALIDATION, 'the validation sets (what a rate is '
                       'chosen on)'),
                      (TEST, 'the held-out sets that are reported (the '
                       'legacy fit: a rate chosen on the data it is scored '
                       'on)')):
    if not any(seed_means(table_rows, optimizer, steps, split=split)
               for optimizer in ('taco', 'adamw')):
      print(f'\nOn {name}: no runs over three or more seeds at {steps} '
            f'steps yet (`--eval-split {split}`), so no fitted rate.')
      continue
    print(f'\nOn {name}: mean accuracy (%) over three or more seeds at '
          f'{steps} steps (per task over the seeds all its rates ran), and '
          'the rate that falls least short of each task\'s best on average, '
          'among the rates run on every task (`fitted_rate`):\n')
    print('| optimizer | task | mean at each rate | best |')
    print('| --- | --- | --- | ---: |')
    for optimizer in ('taco', 'adamw'):
      means = seed_means(table_rows, optimizer, steps, split=split)
      for task, scores in sorted(means.items()):
        cells = ', '.join(f'{lr:.2g}: {100 * a:.1f}'
                          for lr, (a, _) in sorted(scores.items()))
        best = max(scores, key=lambda lr: scores[lr][0])
        print(f'| {optimizer} | {task} | {cells} | {best:.2g} |')
    for optimizer in ('taco', 'adamw'):
      tasks = ', '.join(sorted(seed_means(table_rows, optimizer, steps,
                                          split=split)))
      try:
        rate = fitted_rate(table_rows, optimizer, steps, split=split)
      except NoValidationRuns:
        print(f'\n{optimizer}: no validation runs at {steps} steps.')
        continue
      print(f'\n{optimizer}: fitted over {tasks or "no task"}: '
            f'{"none" if rate is None else f"{rate:.2g}"}; the rule gives '
            f'{rule_rate(optimizer, steps):.2g}.')
    _sensitivity_table(table_rows, steps, split)


def _sensitivity_table(table_rows: list[dict], steps: int, split: str) -> None:
  """Per optimizer and task, the points gained or lost at half and at twice
  the fitted rate (:func:`sensitivity`)."""
  rates = {optimizer: fitted_rate(table_rows, optimizer, steps, split=split)
           for optimizer in ('taco', 'adamw')
           if seed_means(table_rows, optimizer, steps, split=split)}
  changes = {optimizer: sensitivity(table_rows, optimizer, steps,
                                    split=split, rate=rate)
             for optimizer, rate in rates.items()}
  if not any(pair != (None, None) for per_task in changes.values()
             for pair in per_task.values()):
    return
  print('\nA rate off by 2x: accuracy (points, mean over seeds) at half and '
        'at twice the fitted rate, minus at the fitted rate:\n')
  print('| optimizer | fitted rate | task | at ½× | at 2× |')
  print('| --- | ---: | --- | ---: | ---: |')
  for optimizer, per_task in changes.items():
    for task, pair in sorted(per_task.items()):
      if pair == (None, None):
        continue
      cells = ' | '.join('–' if change is None else f'{100 * change:+.1f}'
                         for change in pair)
      print(f'| {optimizer} | {rates[optimizer]:.2g} | {task} | {cells} |')
