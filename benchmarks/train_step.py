"""Whole train steps side by side: tokens/s and compile seconds per optimizer.

On the example's decoder (SmolLM2-135M shapes by default, random weights,
remat per block, the example's completion loss on random tokens), times the
full jitted train step (params and state donated) as the example runs it:

* ``taco_layerwise``: ``taco_optax.layerwise.train_step`` on the example's
  split of the model (what ``--optimizer taco`` runs);
* ``taco_plain_loss``: the same step built from the plain loss (its blocks
  and token tables read from the jaxpr);
* ``taco_optax``: ``value_and_grad -> taco.update -> apply_updates``
  (``--taco-step optax``);
* ``adamw``, ``adafactor``, ``lion``, ``muon``: the same plain step with the
  example's registry of optimizers (``examples/finetune/optimizers.py``).

Every path is compiled first (its compile seconds reported: with
``--compiles N``, the median of N compiles of every path in turn, each from
cleared caches, since one compile on a shared machine can be a quarter off)
and run ``--warmup`` steps; then ``--rounds`` rounds time ``--steps`` steps
of each path in turn, and the table gives the median (and fastest) step,
so a slow spell of a shared machine falls on every path alike. One table
per (dtype, batch); the last line is
``taco_layerwise_over_adamw=<tokens/s ratio> ...`` with one key per
optimizer, for the last (dtype, batch) measured. Below each
table, each path's program: lowering seconds, the StableHLO operations XLA
gets, the optimised HLO's instructions and computations, and XLA's
milliseconds per thousand of them (where compile time goes).

The layers are unrolled, as the example runs them; with ``--scan-layers``
they are stacked and run by one ``lax.scan`` (the layer-wise step then
compiles one layer's backward and updates, not one per layer).

  python -m benchmarks.train_step [--dtypes float32,bfloat16]
      [--batches 4,16] [--seq 64] [--layers N] [--scan-layers]
      [--steps 2] [--rounds 3] [--compiles 1]
      [--optimizers taco_layerwise,taco_plain_loss,taco_optax,adamw,adafactor,
                    lion,muon]
      [--write docs/measured/train_step.md]
"""

import argparse
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import memory
from benchmarks import provenance
from examples.finetune import api
import taco_optax

PATHS = ('taco_layerwise', 'taco_plain_loss', 'taco_optax', 'adamw',
         'adafactor', 'lion', 'muon')


def _decoder(dtype, num_layers, scan_layers=False):
  return memory.layered_decoder(memory.SMOLLM2_135M, dtype=dtype,
                                scan_layers=scan_layers,
                                num_layers=num_layers)


def _step(path, decoder, config):
  """``(step, optimizer)`` of one path, as the example builds it."""
  hints = api.decoder_hints(config)
  name = 'taco' if path.startswith('taco') else path
  tx = api.optimizer(name).build(1e-5, hints, api.TacoSettings())
  if path == 'taco_layerwise':
    return taco_optax.layerwise.train_step(decoder.loss, tx), tx
  if path == 'taco_plain_loss':
    plain_loss = lambda params, batch: decoder.loss(params, batch)
    return taco_optax.layerwise.train_step(plain_loss, tx), tx
  return memory.plain_step(decoder.loss, tx), tx


class _Path:
  """One compiled path and its running params and state."""

  def __init__(self, path, decoder, config, batch):
    step, tx = _step(path, decoder, config)
    self.params = jax.tree.map(jnp.copy, decoder.params)
    self.state = tx.init(self.params)
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
        self.params, self.state, batch)
    self.lower_s = time.perf_counter() - start
    self.compiled = lowered.compile()
    self.compile_s = time.perf_counter() - start  # lowering included
    self.program = program_size(lowered, self.compiled)
    self.step_s = []
    self.loss = None

  def run(self, batch, steps, timed):
    for _ in range(steps):
      start = time.perf_counter()
      self.params, self.state, value = self.compiled(self.params, self.state,
                                                     batch)
      jax.block_until_ready(value)
      if timed:
        self.step_s.append(time.perf_counter() - start)
      self.loss = float(value)


def program_size(lowered, compiled):
  """``{'stablehlo_ops', 'hlo_instructions', 'hlo_computations'}``: what XLA
  gets (the lowered StableHLO's operations) and what it made (the optimised
  HLO's instructions and computations, fusions' bodies included)."""
  hlo = compiled.as_text()
  return {
      'stablehlo_ops': len(re.findall(r'= "?[a-z_]+\.[a-z_]+',
                                      lowered.as_text())),
      'hlo_instructions': len(re.findall(r'^\s+(?:ROOT )?%?\S+ = ', hlo,
                                         re.M)),
      'hlo_computations': len(re.findall(r'^(?:ENTRY )?%?\S+ .*\{$', hlo,
                                         re.M)),
  }


def time_paths(paths, decoder, config, batch, warmup, steps, rounds,
               compiles=1):
  """``{path: {'compile_s', 'step_s', 'min_step_s', 'tokens_per_s'}}``.

  Every path is compiled first, ``compiles`` times in turn from cleared
  caches (``compile_s`` and ``lower_s`` are the medians, ``compile_runs``
  every compile's seconds); then ``rounds`` rounds run ``steps`` timed steps
  of each path in turn, so that a machine's slow spell falls on every path
  alike. ``step_s`` is the median over all timed steps.
  """
  compiled, compile_s, lower_s = {}, {}, {}
  for _ in range(compiles):
    for path in paths:
      # Nothing traced, lowered or compiled before is reused.
      compiled.pop(path, None)
      jax.clear_caches()
      compiled[path] = _Path(path, decoder, config, batch)
      compile_s.setdefault(path, []).append(compiled[path].compile_s)
      lower_s.setdefault(path, []).append(compiled[path].lower_s)
  for path in compiled.values():
    path.run(batch, warmup, timed=False)
  for _ in range(rounds):
    for path in compiled.values():
      path.run(batch, steps, timed=True)
  tokens = batch.input_ids.size
  results = {}
  for name, path in compiled.items():
    step_s = statistics.median(path.step_s)
    results[name] = {'compile_s': statistics.median(compile_s[name]),
                     'lower_s': statistics.median(lower_s[name]),
                     'compile_runs': compile_s[name], **path.program,
                     'step_s': step_s,
                     'min_step_s': min(path.step_s),
                     'tokens_per_s': tokens / step_s, 'loss': path.loss}
  return results


def _batch(config, batch, seq):
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0,
                              config.vocab_size)
  return memory.token_batch(tokens, jnp.ones((batch, seq), bool))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dtypes', default='float32,bfloat16')
  parser.add_argument('--batches', default='4,16')
  parser.add_argument('--seq', type=int, default=64)
  parser.add_argument('--layers', type=int, default=None,
                      help='override the number of layers (default: 30)')
  parser.add_argument('--scan-layers', action='store_true',
                      help='stack the layers and run them in one lax.scan '
                      '(default: unrolled, as the example)')
  parser.add_argument('--warmup', type=int, default=1)
  parser.add_argument('--steps', type=int, default=2,
                      help='timed steps per path and round (>= 1)')
  parser.add_argument('--rounds', type=int, default=3,
                      help='rounds of every path in turn (>= 1)')
  parser.add_argument('--compiles', type=int, default=1,
                      help='compiles of every path in turn, from cleared '
                      'caches (>= 1); the table gives the median')
  parser.add_argument('--optimizers', default=','.join(PATHS))
  parser.add_argument('--write', metavar='PATH', default=None,
                      help='also write the output, with its provenance, as '
                      'Markdown')
  args = parser.parse_args(argv)
  paths = args.optimizers.split(',')
  unknown = sorted(set(paths) - set(PATHS))
  if unknown:
    parser.error(f'unknown optimizers {unknown}; known: {", ".join(PATHS)}')
  if args.steps < 1 or args.rounds < 1 or args.compiles < 1:
    parser.error('--steps, --rounds and --compiles must be >= 1')
  text = provenance.captured(lambda: _tables(args, paths))
  if args.write:
    command = ' '.join(['python -m benchmarks.train_step']
                       + (sys.argv[1:] if argv is None else list(argv)))
    provenance.write_report(args.write, 'Whole train steps', command, text)


def _program_table(results):
  """Where compile time goes: each path's program, and seconds per size."""
  print(f'{"program":<16}{"lower s":>9}{"stablehlo ops":>15}'
        f'{"HLO instrs":>12}{"computations":>14}{"ms / 1k instrs":>16}')
  for path, r in results.items():
    per_k = 1e6 * (r['compile_s'] - r['lower_s']) / max(
        r['hlo_instructions'], 1)
    print(f'{path:<16}{r["lower_s"]:>9.1f}{r["stablehlo_ops"]:>15,}'
          f'{r["hlo_instructions"]:>12,}{r["hlo_computations"]:>14,}'
          f'{per_k:>16.1f}', flush=True)


def _tables(args, paths):
  """One table per (dtype, batch), then the ratios of the last one."""
  layout = ('stacked, one scan' if args.scan_layers
            else 'unrolled, as the CLI')
  print(f'SmolLM2-135M shapes, layers={args.layers or 30} ({layout}), '
        f'seq={args.seq}, remat per block, backend='
        f'{jax.default_backend()}; median of {args.rounds} rounds x '
        f'{args.steps} steps, paths in turn; compile s: median of '
        f'{args.compiles} compile(s) per path, in turn')
  results = {}
  for dtype_name in args.dtypes.split(','):
    config, decoder = _decoder(jnp.dtype(dtype_name), args.layers,
                               args.scan_layers)
    for batch_size in (int(b) for b in args.batches.split(',')):
      batch = _batch(config, batch_size, args.seq)
      results = time_paths(paths, decoder, config, batch, args.warmup,
                           args.steps, args.rounds, args.compiles)
      print(f'\n{dtype_name}, batch {batch_size} x {args.seq}')
      print(f'{"optimizer":<16}{"tokens/s":>10}{"step ms":>10}'
            f'{"min ms":>9}{"compile s":>11}')
      for path, r in results.items():
        print(f'{path:<16}{r["tokens_per_s"]:>10.1f}'
              f'{1e3 * r["step_s"]:>10.1f}{1e3 * r["min_step_s"]:>9.1f}'
              f'{r["compile_s"]:>11.1f}', flush=True)
      _program_table(results)
      if args.compiles > 1:
        for path, r in results.items():
          print(f'{path:<16}compiles s: '
                + ', '.join(f'{c:.1f}' for c in r['compile_runs']))
  if 'adamw' in results:
    adamw = results['adamw']
    print(' '.join(
        f'{path}_over_adamw={r["tokens_per_s"] / adamw["tokens_per_s"]:.3f}'
        for path, r in results.items() if path != 'adamw')
          + ' ' + ' '.join(
              f'{path}_compile_over_adamw='
              f'{r["compile_s"] / adamw["compile_s"]:.2f}'
              for path, r in results.items() if path != 'adamw'))


if __name__ == '__main__':
  main()
