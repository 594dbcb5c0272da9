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
      [--write docs/measured/accumulation.md]
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


_DOC_HEAD = """# Gradient accumulation: compiled peak memory (written by `{command}`)

{stamp}. What the step does and how to read these tables: [accumulation.md](../accumulation.md).

```
{table}```
"""  # noqa: E501 (the page's markdown lines)


if __name__ == '__main__':
  main()
