"""The tables of the multi-class runs (:mod:`benchmarks.multiclass_runs`
runs and records them; :mod:`benchmarks.multiclass_fit` fits rates).

From rows of runs (each a finished or recorded run: task, optimizer, rate,
steps, seed, settings, the set scored, accuracy): per (task, optimizer,
rate, steps) the accuracy per seed, the mean and its standard error; TACO
minus AdamW (at the rule's rate, same task, steps and seed), paired over
seeds; the README's quality table (the 40-step rows at the rule's rates, the
longer budgets at the rates their validation runs favour); and each fit's
report.
"""

from typing import Optional

from benchmarks.multiclass_fit import TEST
from benchmarks.multiclass_fit import fit_report
from benchmarks.multiclass_fit import long_budget_rate
from benchmarks.multiclass_fit import predates_split
from benchmarks.multiclass_fit import round_rate
from benchmarks.multiclass_fit import rule_rate
from benchmarks.multiclass_fit import run_key
from examples.finetune import api


def finished(table_rows: list[dict]) -> dict:
  """``{(task, optimizer, lr, steps, settings): {seed: (after, before)}}``
  in percent, from ``table_rows``; a rate the rule
  gave and the same rate given with ``--lr`` are one rate; a validation
  run's settings end with ``eval=validation``, those of a run recorded
  before validation sets existed with ``pre-split`` (:func:`predates_split`),
  so that neither is in the summary."""
  table = {}
  for row in table_rows:
    task, optimizer, lr, _, steps, seed, settings, split, _ = run_key(row)
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
  # Each budget's rates once, not once per task.
  budget_rates = {steps: _rule_rates(40) if steps == 40 else
                  long_budget_rates(table_rows, steps) for steps in budgets}
  for task in sorted({key[0] for key in data}):
    for steps, rates in budget_rates.items():
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


def report(table_rows: list[dict]) -> None:
  """Prints the tables of ``table_rows`` (the recorded and finished runs)."""
  data = finished(table_rows)
  print(f'TACO and AdamW at the CLI\'s defaults (40 steps x batch 4, each at '
        f'its budget rule\'s rate: TACO {rule_rate("taco", 40):.2g}, AdamW '
        f'{rule_rate("adamw", 40):.2g}), held-out accuracy (%), mean ± '
        'standard error over seeds:\n')
  print('\n'.join(summary(data)) or
        'No task has two seeds of both at these rates on today\'s split yet.')
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
    fit_report(table_rows, steps)
