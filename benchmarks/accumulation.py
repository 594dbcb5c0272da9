"""Compiled peak memory of gradient accumulation, per path and ``A``.

For the example's decoder (SmolLM2-135M shapes, remat on, params and state
donated), compiles on abstract shapes (nothing is allocated) and reads XLA's
``memory_analysis()`` of one optimizer step on ``A`` micro-batches of
``--micro-batch`` sequences, for A = 1, 4, 16, with the layers scanned
(``lax.scan`` over stacked weights) and unrolled (the CLI's default):

* ``taco layerwise``: ``layerwise.train_step(loss, taco, accumulation_steps=A)``
  (one call takes the ``A`` micro-batches);
* ``MultiSteps(taco)`` and ``MultiSteps(adamw)``: ``optax.MultiSteps(tx, A)``
  on the plain ``value_and_grad -> update -> apply_updates`` step (one call
  per micro-batch; its state holds the float32 gradient accumulator);
* ``taco layerwise, one batch``: the layer-wise step without accumulation on
  the whole batch of ``A x micro-batch`` sequences (what accumulation saves).

Overhead is (peak - forward peak of one micro-batch) / weight bytes. The last
line is ``layerwise_A16_over_A1=<peak ratio> multisteps_taco_over_layerwise_A16=
<peak ratio>``. These tables score every token (``--objective tokens``).

A last table compares, at the CLI's default shape, one batch of
``--cli-batch`` sequences with the same batch as ``--cli-steps``
micro-batches (``python -m examples.finetune --batch-size 8`` against
``--batch-size 8 --grad-accum 4``): unrolled layers, the default tweets task
(``--objective choice``: each sequence's last position scored over its two
label words), at each of ``--cli-seqs``.

  python -m benchmarks.accumulation [--dtype float32] [--micro-batch 4]
      [--seq 64] [--layers N] [--layouts scanned,unrolled]
      [--cli-batch 8] [--cli-steps 4] [--cli-seqs 64,512]
      [--write docs/accumulation.md]
"""

import argparse
import contextlib
import sys

import jax
import jax.numpy as jnp
import optax

from benchmarks import memory
from benchmarks import provenance
from examples.finetune import api
import taco_optax

STEPS = (1, 4, 16)


OBJECTIVES = ('tokens', 'choice')


def _batch(shape, objective='tokens'):
  """An abstract batch; ``shape`` is its leading axes and the sequence.

  ``tokens``: every token's next-token NLL; ``choice``: the CLI's default
  tweets task, each sequence's last position scored over two candidates.
  """
  input_ids = jax.ShapeDtypeStruct(shape, jnp.int32)
  attention_mask = jax.ShapeDtypeStruct(shape, jnp.bool_)
  if objective == 'tokens':
    return jax.eval_shape(memory.token_batch, input_ids, attention_mask)
  rows = shape[:-1]
  return api.ChoiceBatch(input_ids, attention_mask,
                         jax.ShapeDtypeStruct(rows + (2,), jnp.int32),
                         jax.ShapeDtypeStruct(rows, jnp.int32))


PATHS = ('taco layerwise', 'MultiSteps(taco)', 'MultiSteps(adamw)',
         'taco layerwise, one batch')


def measure(*, dtype, micro_batch, seq, num_layers, scan_layers=True,
            steps=STEPS, paths=PATHS, objective='tokens'):
  """``(weights, forward peak, rows)``; rows are ``(A, path, peak, state)``.
  """
  config, decoder = memory.abstract_decoder(
      memory.SMOLLM2_135M, dtype=dtype, scan_layers=scan_layers,
      num_layers=num_layers)
  params = decoder.params
  train = memory.layerwise_taco(decoder, config)
  micro = _batch((micro_batch, seq), objective)
  forward, _ = memory.peak_bytes(decoder.loss, (params, micro))
  rows = []
  for count in steps:
    stacked = _batch((count, micro_batch, seq), objective)
    state = jax.eval_shape(train.optimizer.init, params)
    step = taco_optax.layerwise.train_step(decoder.loss, train.optimizer,
                                           accumulation_steps=count)
    if 'taco layerwise' in paths:
      peak, _ = memory.peak_bytes(step, (params, state, stacked),
                                  donate=(0, 1))
      rows.append((count, 'taco layerwise', peak,
                   api.tree_bytes(state)))
    for name, tx in (('MultiSteps(taco)', train.optimizer),
                     ('MultiSteps(adamw)', optax.adamw(1e-5))):
      if name not in paths:
        continue
      multi = optax.MultiSteps(tx, count)
      state = jax.eval_shape(multi.init, params)
      peak, _ = memory.peak_bytes(memory.plain_step(decoder.loss, multi),
                                  (params, state, micro), donate=(0, 1))
      rows.append((count, name, peak, api.tree_bytes(state)))
    if count > 1 and 'taco layerwise, one batch' in paths:
      state = jax.eval_shape(train.optimizer.init, params)
      peak, _ = memory.peak_bytes(
          train.step,
          (params, state, _batch((count * micro_batch, seq), objective)),
          donate=(0, 1))
      rows.append((count, 'taco layerwise, one batch', peak,
                   api.tree_bytes(state)))
  return api.tree_bytes(params), forward, rows


def print_table(weights, forward, rows):
  mib = lambda x: x / 2**20
  print(f'weights {mib(weights):.1f} MiB, forward of one micro-batch '
        f'{mib(forward):.1f} MiB')
  print(f'{"A":>3}  {"path":<27}{"peak MiB":>10}{"state MiB":>11}'
        f'{"overhead":>10}')
  for count, path, peak, state in rows:
    print(f'{count:>3}  {path:<27}{mib(peak):>10.1f}{mib(state):>11.1f}'
          f'{(peak - forward) / weights:>10.3f}')
  peaks = {(count, path): peak for count, path, peak, _ in rows}
  largest = max(count for count, *_ in rows)
  layerwise = peaks[largest, 'taco layerwise']
  print(f'layerwise_A{largest}_over_A1='
        f'{layerwise / peaks[1, "taco layerwise"]:.3f}'
        f' multisteps_taco_over_layerwise_A{largest}='
        f'{peaks[largest, "MultiSteps(taco)"] / layerwise:.3f}'
        f' layerwise_A{largest}_over_one_batch='
        f'{layerwise / peaks[largest, "taco layerwise, one batch"]:.3f}')


def same_batch(*, dtype, batch, steps, seq, num_layers=None,
               objective='choice'):
  """``(one batch, accumulated)`` compiled peaks of the layer-wise step with
  unrolled layers (the CLI's): one batch of ``batch`` sequences, and the same
  batch as ``steps`` micro-batches."""
  _, _, rows = measure(
      dtype=dtype, micro_batch=batch // steps, seq=seq, num_layers=num_layers,
      scan_layers=False, steps=(steps,), objective=objective,
      paths=('taco layerwise', 'taco layerwise, one batch'))
  peaks = {path: peak for _, path, peak, _ in rows}
  return peaks['taco layerwise, one batch'], peaks['taco layerwise']


def print_same_batch(args, dtype):
  """The CLI-shaped table: one batch against accumulation, per length."""
  mib = lambda x: x / 2**20
  print(f'SmolLM2-135M shapes, dtype={dtype}, the CLI\'s default: unrolled '
        f'layers={args.layers or 30}, tweets task (objective=choice), '
        f'--batch-size {args.cli_batch} against --grad-accum '
        f'{args.cli_steps}, backend={jax.default_backend()}')
  print(f'{"seq":>5}{"one batch MiB":>15}{"accumulated MiB":>17}'
        f'{"ratio":>8}')
  for seq in args.cli_seqs:
    whole, split = same_batch(dtype=dtype, batch=args.cli_batch,
                              steps=args.cli_steps, seq=seq,
                              num_layers=args.layers)
    print(f'{seq:>5}{mib(whole):>15.1f}{mib(split):>17.1f}'
          f'{split / whole:>8.3f}')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--micro-batch', type=int, default=4)
  parser.add_argument('--seq', type=int, default=64)
  parser.add_argument('--layers', type=int, default=None,
                      help='override the number of layers (default: 30)')
  parser.add_argument('--layouts', default='scanned,unrolled',
                      help='comma-separated: scanned (lax.scan over stacked '
                      'layers), unrolled (the CLI default)')
  parser.add_argument('--cli-batch', type=int, default=8,
                      help='sequences per step in the CLI-shaped table')
  parser.add_argument('--cli-steps', type=int, default=4,
                      help='micro-batches in the CLI-shaped table')
  parser.add_argument('--cli-seqs', default='64,512',
                      type=lambda text: [int(x) for x in text.split(',') if x],
                      help='sequence lengths of the CLI-shaped table '
                      '(comma-separated; empty: no table)')
  parser.add_argument('--write', metavar='PATH', default=None,
                      help='also write the output, with its provenance, as '
                      'Markdown')
  args = parser.parse_args()
  output = provenance.Tee()
  layouts = args.layouts.split(',')
  unknown = set(layouts) - {'scanned', 'unrolled'}
  if unknown:
    parser.error(f'unknown --layouts {sorted(unknown)}; use scanned, unrolled')
  with contextlib.redirect_stdout(output):
    for layout in layouts:
      print(f'SmolLM2-135M shapes, dtype={args.dtype}, micro-batch='
            f'{args.micro_batch}, seq={args.seq}, layers={args.layers or 30} '
            f'({layout}), remat on, backend={jax.default_backend()}')
      print_table(*measure(dtype=jnp.dtype(args.dtype),
                           micro_batch=args.micro_batch, seq=args.seq,
                           num_layers=args.layers,
                           scan_layers=layout == 'scanned'))
      print()
    if args.cli_seqs:
      print_same_batch(args, jnp.dtype(args.dtype))
      print()
  if args.write:
    command = ' '.join(['python -m benchmarks.accumulation'] + sys.argv[1:])
    with open(args.write, 'w') as f:
      f.write(_DOC_HEAD.format(command=command, stamp=provenance.stamp(),
                               table=output.getvalue()))


_DOC_HEAD = """# Gradient accumulation at inference memory

`taco_optax.layerwise.train_step(loss, taco(...), accumulation_steps=A)`
takes a batch whose every leaf leads with a micro-batch axis of size `A` and
makes one step on the mean gradient of the `A` micro-batches: the step
`optax.MultiSteps(taco(...), A)` makes when fed them one at a time, without
its float32 gradient-sized accumulator. The pieces run layer-major: the
embedding and each layer's forward over the micro-batches one after another
(keeping each one's layer inputs), the head's backward likewise, then each
layer's backward over the `A` micro-batches, folding that one layer's
gradient into a float32 running mean (MultiSteps' `acc + (g - acc)/(a + 1)`)
before its column step.

What is equal to `MultiSteps(taco(...), A)` (tests/test_accumulation.py):

* bfloat16 parameters: params and the whole state, bit for bit;
* float32: TACO's history (values, indices, exponents) and learning-rate
  state bit for bit; the vectors' gradients (Adam's moments) are reduced in
  another order by the per-layer backward, and a winner's `p - lr * s` may be
  one fused multiply-add, as without accumulation;
* a leaf read by both the embedding and the head (a tied token table): its
  mean is `mean(head shares) + mean(embedding shares)` instead of
  `mean(head share + embedding share)`: its stored indices and exponents are
  still those of MultiSteps and of the numpy rule on the float64 mean
  gradient (tests/support/reference.py); its stored FP8 values may differ by
  their rounding.

What costs memory beyond one micro-batch: the saved layer inputs of all `A`
micro-batches (as large as the whole batch's), the `A` cotangents of the
current layer's output, one layer's float32 gradient accumulator, and the
mean gradient of each outer leaf. A token table's mean (its two-phase update
needs the batch's tokens at the head, which accumulation spreads over `A`
calls) is kept whichever way takes fewer bytes
(`taco_optax/_src/layerwise/micro_batch_table.py`):

* a float32 accumulator, one more table, into which each micro-batch's
  share, the head's and the lookup's, is folded a block of columns at a time
  from its factors (no dense share is formed);
* or every micro-batch's factors themselves (the projection's features and
  logits' cotangent, the lookup's ids and rows' cotangent), from which the
  table's update forms the mean a block of columns at a time, in the
  accumulator's arithmetic. They are the smaller when the micro-batches
  score few positions: the CLI's default task scores one per sequence
  (49152 + 576 floats each against the 49152 x 576 table); a
  language-modelling loss over micro-batches of 4 x 64 scores 252 positions
  each (200 MB for four against the table's 113 MB), over 2 x 64, 126
  (100 MB).

Each layer's accumulator and stacked input cotangents are made from that
layer's cotangents, so with unrolled layers XLA cannot form them all at the
start of the step (it did: 11 MB more per layer for the accumulators, 433 MB
more than the whole batch at the CLI's 30 layers; one hidden state of the
whole batch per layer for the cotangents, 261 MiB at the CLI's seq 512).

Where it stands (read from the tables below): with every token scored over
micro-batches of 4 x 64 (the first two tables), the table's accumulator is
the smaller, and beyond `A = 1` the step holds a constant extra of about one
float32 token table (108 MiB for SmolLM2-135M's 49152 x 576 table); each
further micro-batch costs only its saved hidden states (the layers' inputs
and the current layer's cotangent). Against the whole batch in one step
(`one batch`), accumulation saves the logits of all but one micro-batch
(each `micro-batch x seq x vocab` floats, twice: the softmax and its
cotangent) and pays the table's accumulator. At the CLI's default shape (the
last table) the factors are kept, no table-sized buffer is added, and
`--grad-accum 4` is below `--batch-size 8` in one step at both lengths. What
would remove the constant where the factors are larger: select the tied
table's candidates per micro-batch as the two-phase update does for one
batch (not exact as it stands: a column's top-k of a sum is not the merge
of per-part top-k's).

`clip_global_norm=c` with accumulation clips the mean gradient, as
`MultiSteps(chain(clip_by_global_norm(c), taco(...)), A)` does (tested).

Written by `{command}`, {stamp}.

```
{table}```
"""


if __name__ == '__main__':
  main()
