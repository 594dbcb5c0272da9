"""How much of the head's gradient one TACO step follows, per task (issue 33).

TACO moves one row of the token table ``(vocab, hidden)`` per hidden
coordinate. The candidate cross-entropy's gradient on the table's head side
lies on the C label words' rows: ``g[c] = sum_b (p_bc - y_bc) h_b``. Moving
only one of those rows per coordinate follows, to first order, the share
``max_c |g[c, i]| / sum_c |g[c, i]|`` of what moving all C rows by the same
amount would do. That share is exactly 1/2 with two classes (the two rows'
gradients are opposite) and falls with more classes, so the same rate does
less for the head of a 5-class task than of a binary one.

For each task this script runs the CLI's own preparation (its defaults, the
plain optax step so the table can be read between steps) and, for the first
``--steps`` steps, reads off:

* ``share``: the mean over hidden coordinates of that first-order share, from
  the table's gradient on the step's batch (its label rows);
* ``label columns``: the hidden coordinates whose moved row (the table
  before and after the step) is one of the batch's label rows;
* ``label rows``: how many distinct label rows moved, of the C.

    python -m benchmarks.label_rows --tasks tweets,bbc,trec --steps 8
"""

import argparse
import os

from flax import nnx
import jax
import numpy as np

from benchmarks import lr_sweep
from benchmarks import provenance
from examples.finetune import api

ROOT = os.path.join('runs', 'label_rows')


def head_share(table_grad: np.ndarray, label_rows: np.ndarray) -> float:
  """Mean over columns of ``max_c |g[c, i]| / sum_c |g[c, i]|`` on the label
  rows (columns whose label gradient is all zero are left out)."""
  g = np.abs(table_grad[label_rows])
  total = g.sum(axis=0)
  live = total > 0
  return float(np.mean(g.max(axis=0)[live] / total[live]))


def moved_rows(before: np.ndarray, after: np.ndarray) -> np.ndarray:
  """Per column, the row that changed (-1 where none did)."""
  changed = before != after
  rows = np.argmax(changed, axis=0)
  return np.where(changed.any(axis=0), rows, -1)


def task(name: str, steps: int, seed: int) -> dict:
  flags = lr_sweep.task_flags(name)
  run = api.compile_first_step(
      [*flags, '--taco-step', 'optax', '--no-checkpoint', '--no-progress',
       '--seed', str(seed), '--output-dir', os.path.join(ROOT, name)])
  prepared = run.prepared
  model = prepared.model
  grad = jax.jit(lambda m, b: nnx.grad(api.completion_loss)(m, b)
                 .embed.embedding[...])
  shares, columns, rows = [], [], []
  for _ in range(steps):
    batch = next(prepared.batches)
    labels = np.unique(np.asarray(batch.candidate_ids))
    shares.append(head_share(np.asarray(grad(model, batch)), labels))
    before = np.asarray(model.embed.embedding[...]).copy()
    prepared.trainer.step(batch)
    moved = moved_rows(before, np.asarray(model.embed.embedding[...]))
    on_labels = np.isin(moved, labels)
    columns.append(int(on_labels.sum()))
    rows.append(len(np.unique(moved[on_labels])))
  classes = int(np.asarray(batch.candidate_ids).shape[-1])
  return {'task': name, 'classes': classes, 'hidden': int(before.shape[1]),
          'share': float(np.mean(shares)), 'label_columns': columns,
          'label_rows': rows}


def report(results: list[dict]) -> None:
  print('| task | classes | 1/C | mean first-order share of the head '
        'gradient one row follows | coordinates moving a label row, per step '
        '(of the hidden size) | distinct label rows moved, per step |')
  print('| --- | ---: | ---: | ---: | --- | --- |')
  for r in results:
    print(f'| {r["task"]} | {r["classes"]} | {1 / r["classes"]:.2f} | '
          f'{r["share"]:.3f} | {" ".join(map(str, r["label_columns"]))} '
          f'(of {r["hidden"]}) | {" ".join(map(str, r["label_rows"]))} |')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tasks', default='tweets,bbc,trec')
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--write', metavar='PATH')
  args = parser.parse_args(argv)
  results = [task(name, args.steps, args.seed)
             for name in args.tasks.split(',')]
  if args.write:
    text = provenance.captured(lambda: report(results))
    with open(args.write, 'w') as f:
      f.write('# How much of the head gradient one TACO step follows '
              f'(written by `python -m benchmarks.label_rows --tasks '
              f'{args.tasks} --steps {args.steps} --write {args.write}`)\n\n'
              f'{provenance.stamp()}.\n\n{text}')
  else:
    report(results)


if __name__ == '__main__':
  main()
