"""Fine-tuning quality in bfloat16: TACO and AdamW, each rounding, vs float32.

Every point is one run of the fine-tuning CLI as a user runs it, one process
per point, at the CLI's defaults (SmolLM2-135M, 40 steps x batch 4 x 64
tokens, the budget rule's learning rate, 200 held-out examples):

    python -m examples.finetune --optimizer O --dtype D --rounding R
        --measure-landed --no-checkpoint --no-progress --output-dir DIR
        [task flags]

on the two real tasks of ``benchmarks/lr_sweep.py`` (the embedded tweets;
BBC News topics, ``--task bbc``). The
bfloat16 points are TACO with stochastic rounding (its ``auto``) and round to
nearest, AdamW with float32 master weights (its ``auto``), stochastic rounding
and round to nearest; each task also runs both optimizers in float32.
Results are kept per point (``runs/bf16_quality/POINT/results.json``) and
the script resumes where it stopped; ``--write docs/measured/bf16.md``
writes the table of finished points with the commands, the commit and the
machine.

    python -m benchmarks.bf16_quality                 # run (or finish) them
    python -m benchmarks.bf16_quality --write docs/measured/bf16.md
"""

import argparse
import os
import shlex
from typing import NamedTuple, Optional

from benchmarks import lr_sweep
from benchmarks import provenance
from examples.finetune import api

RUNS = os.path.join('runs', 'bf16_quality')
TASKS = ('tweets', 'bbc')
# (optimizer, dtype, rounding) of every task's points.
SETTINGS = (
    ('taco', 'float32', 'auto'),
    ('taco', 'bfloat16', 'stochastic'),
    ('taco', 'bfloat16', 'nearest'),
    ('adamw', 'float32', 'auto'),
    ('adamw', 'bfloat16', 'master'),
    ('adamw', 'bfloat16', 'stochastic'),
    ('adamw', 'bfloat16', 'nearest'),
)
# The target of issue 23: bf16 TACO with stochastic rounding within this many
# points of float32 TACO.
TARGET_POINTS = 1.5


class Point(NamedTuple):
  task: str
  optimizer: str
  dtype: str
  rounding: str

  @property
  def directory(self) -> str:
    return os.path.join(RUNS, '-'.join(self))

  def flags(self) -> list[str]:
    """The CLI's flags, the task aside (:func:`lr_sweep.task_flags`)."""
    return ['--optimizer', self.optimizer, '--dtype', self.dtype,
            '--rounding', self.rounding, '--measure-landed',
            '--no-checkpoint', '--no-progress']


def points() -> list[Point]:
  return [Point(task, *setting) for task in TASKS for setting in SETTINGS]


def run(point: Point) -> dict:
  """One CLI run (skipped when its results exist); its provenance is kept
  beside it."""
  if lr_sweep.result(point.directory) is None:
    os.makedirs(RUNS, exist_ok=True)
    with open(point.directory + '.provenance', 'w') as f:
      f.write(provenance.stamp() + '\n')
  return lr_sweep.cli_run(point.directory,
                          point.flags() + lr_sweep.task_flags(point.task))


def _share(results: api.RunResults, group: str) -> str:
  entry = (results.landed_updates or {}).get(group)
  if not entry or entry['share'] is None:
    return 'n/a'
  return f'{100 * entry["share"]:.1f}%'


def _row(point: Point, results: api.RunResults) -> str:
  memory = results.parameter_bytes + results.optimizer_state_bytes
  return (f'| {point.task} | {point.optimizer} | {point.dtype} | '
          f'{results.rounding} | {100 * results.headline_before:.1f} '
          f'→ {100 * results.headline_after:.1f} | '
          f'{_share(results, "matrices")} / {_share(results, "vectors")} | '
          f'{api.format_bytes(memory)} '
          f'({api.format_bytes(results.parameter_bytes)} + '
          f'{api.format_bytes(results.optimizer_state_bytes)}) | '
          f'{results.tokens_per_second:.0f} |')


def target_outcome(finished: dict) -> list[str]:
  """Per task: bf16 TACO with stochastic rounding against float32 TACO."""
  lines = []
  for task in TASKS:
    wide = finished.get(Point(task, 'taco', 'float32', 'auto'))
    narrow = finished.get(Point(task, 'taco', 'bfloat16', 'stochastic'))
    if wide is None or narrow is None:
      lines.append(f'- {task}: not run yet.')
      continue
    gap = 100 * (wide.headline_after - narrow.headline_after)
    verdict = 'met' if gap <= TARGET_POINTS else 'missed'
    lines.append(
        f'- {task}: float32 {100 * wide.headline_after:.1f}, bfloat16 '
        f'stochastic {100 * narrow.headline_after:.1f}: '
        f'{abs(gap):.1f} points {"below" if gap > 0 else "above"} float32; '
        f'target (within {TARGET_POINTS:g} points) {verdict}.')
  return lines


def nearest_cost(finished: dict) -> list[str]:
  """Per task and optimizer: accuracy after, stochastic minus nearest."""
  lines = []
  for task in TASKS:
    for optimizer in ('taco', 'adamw'):
      runs = [finished.get(Point(task, optimizer, 'bfloat16', rounding))
              for rounding in ('stochastic', 'nearest')]
      if None in runs:
        continue
      gap = 100 * (runs[0].headline_after - runs[1].headline_after)
      lines.append(f'- {task}, {optimizer}: rounding to nearest ends '
                   f'{gap:.1f} points below stochastic rounding.')
  return lines


def _shell_word(word: str) -> str:
  """``word`` as bash reads it back (a newline as ``$'...\\n...'``)."""
  if '\n' in word:
    return "$'" + word.replace("'", "\\'").replace('\n', '\\n') + "'"
  return shlex.quote(word)


def _provenance(point: Point) -> Optional[str]:
  try:
    with open(point.directory + '.provenance') as f:
      return f.read().strip()
  except OSError:
    return None


def write(path: str) -> None:
  finished = {point: lr_sweep.result(point.directory) for point in points()}
  finished = {point: done for point, done in finished.items() if done}
  stamps = sorted({stamp for stamp in map(_provenance, finished) if stamp})
  lines = [
      '# Fine-tuning in bfloat16: how updates land, and what it costs',
      '',
      f'Written by `python -m benchmarks.bf16_quality --write {path}` from '
      f'the runs it made (written at: {provenance.stamp()}). The runs\' '
      'stamps (commit, date, machine, load at a run\'s start; identical '
      'ones once):',
      '',
      *[f'- {stamp}' for stamp in stamps],
      '',
      'Each row is one CLI run at the defaults (SmolLM2-135M GGUF, 40 steps '
      'x batch 4 x 64 tokens, the budget rule\'s learning rate, seed 0, 200 '
      'held-out examples):',
      '',
      '```bash',
      'python -m examples.finetune --optimizer O --dtype D --rounding R '
      '--measure-landed --no-checkpoint --no-progress --output-dir '
      f'{RUNS}/TASK-O-D-R',
      '# bbc adds: ' + ' '.join(map(_shell_word,
                                    lr_sweep.task_flags('bbc'))),
      '```',
      '',
      '`--rounding`: `stochastic` keeps bfloat16 parameters and rounds each '
      'update up or down at random so that it lands on average; `nearest` '
      'rounds to nearest (a step under half an ulp is lost: 6e-5 at a weight '
      'of 0.02); `master` stores float32 parameters and computes in bfloat16 '
      '(AdamW\'s `auto`, as its users run it); `none` is float32. "Landed" '
      'is the share of the updates a step makes (exact arithmetic) that '
      'changed the stored weight, over the run, for TACO\'s matrices / the '
      'other leaves (norm scales: Adam in TACO), `--measure-landed`, see '
      '`examples/finetune/landed.py`. With stochastic rounding a step of a '
      'fraction f of an ulp lands with probability f and then moves the '
      'weight a whole ulp, so its share stays well below 100% while the '
      'weights move by the right amount on average; rounded to nearest, a '
      'step under half an ulp never lands. Memory is the persistent '
      'parameters + '
      'optimizer state. tokens/s is the steady-state throughput of these '
      'runs on a CPU shared with other work, measurement included (the '
      'optax path runs a second update per step to count): a rough guide '
      'only. One seed and 200 held-out examples: one standard error of an '
      'accuracy is about 3 points.',
      '',
      '| task | optimizer | dtype | rounding | accuracy before → after | '
      'landed (matrices / vectors) | parameters + state | tokens/s |',
      '| --- | --- | --- | --- | --- | --- | --- | ---: |',
      *[_row(point, done) for point, done in finished.items()],
      '',
      f'Target: bf16 TACO with stochastic rounding within {TARGET_POINTS:g} '
      'points of float32 TACO (accuracy after). A gap this small is below '
      'one run\'s noise (one standard error, about 3 points): the verdict '
      'says the bfloat16 run is not measurably worse, not that it is '
      'equal.',
      '',
      *target_outcome(finished),
      '',
      'The ablation, bfloat16 parameters rounded to nearest:',
      '',
      *nearest_cost(finished),
  ]
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print(f'wrote {path}')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--write', metavar='PATH',
                      help='write the table of finished runs and stop')
  args = parser.parse_args(argv)
  if args.write:
    write(args.write)
    return
  for point in points():
    run(point)


if __name__ == '__main__':
  main()
