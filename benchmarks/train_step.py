"""Whole train steps side by side: tokens/s and compile seconds per optimizer.

On the example's decoder (SmolLM2-135M shapes by default, random weights,
remat per block, the example's completion loss on random tokens), times the
full jitted train step (params and state donated) as the example runs it:

* ``taco_layerwise``: ``taco_optax.layerwise.train_step`` on the example's
  split of the model (what ``--optimizer taco`` runs);
* ``taco_optax``: ``value_and_grad -> taco.update -> apply_updates``
  (``--taco-step optax``);
* ``adamw``, ``adafactor``, ``lion``, ``muon``: the same plain step with the
  example's registry of optimizers (``examples/finetune/optimizers.py``).

Each path is compiled once (its compile seconds reported), run ``--warmup``
steps, then timed over ``--steps`` steps. One table per (dtype, batch); the
last line is ``taco_layerwise_over_adamw=<tokens/s ratio> ...`` with one key
per optimizer, for the last (dtype, batch) measured. Timings on a shared CPU
are noisy: run it on a quiet machine.

  python -m benchmarks.train_step [--dtypes float32,bfloat16]
      [--batches 4,16] [--seq 64] [--layers N] [--steps 3]
      [--optimizers taco_layerwise,taco_optax,adamw,adafactor,lion,muon]
"""

import argparse
import dataclasses
import time

from flax import nnx
import jax
import jax.numpy as jnp

from benchmarks import memory
from benchmarks import provenance
from examples.finetune import optimizers as optimizers_lib
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as model_lib
from examples.finetune.model import layered as layered_lib
import taco_optax

PATHS = ('taco_layerwise', 'taco_optax', 'adamw', 'adafactor', 'lion', 'muon')


def _decoder(dtype, num_layers):
  config = config_lib.ModelConfig.from_hf_config(memory.SMOLLM2_135M)
  if num_layers is not None:
    config = dataclasses.replace(config, num_layers=num_layers)
  model = model_lib.DecoderLM(config, dtype=dtype, param_dtype=dtype,
                              remat='block', scan_layers=False,
                              rngs=nnx.Rngs(0))
  return config, layered_lib.layered_model(model)


def _step(path, decoder, config):
  """``(step, optimizer)`` of one path, as the example builds it."""
  hints = optimizers_lib.decoder_hints(config)
  name = 'taco' if path.startswith('taco') else path
  tx = optimizers_lib.get(name).build(1e-5, hints,
                                      optimizers_lib.TacoSettings())
  if path == 'taco_layerwise':
    return taco_optax.layerwise.train_step(decoder.loss, tx), tx
  return memory.plain_step(decoder.loss, tx), tx


def time_path(path, decoder, config, batch, warmup, steps):
  """``{'compile_s', 'step_s', 'tokens_per_s'}`` of one path."""
  step, tx = _step(path, decoder, config)
  params = jax.tree.map(jnp.copy, decoder.params)
  state = tx.init(params)
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, state, batch).compile()
  compile_s = time.perf_counter() - start
  for _ in range(warmup):
    params, state, value = compiled(params, state, batch)
    jax.block_until_ready(value)
  start = time.perf_counter()
  for _ in range(steps):
    params, state, value = compiled(params, state, batch)
  jax.block_until_ready(value)
  step_s = (time.perf_counter() - start) / steps
  tokens = batch.input_ids.size
  return {'compile_s': compile_s, 'step_s': step_s,
          'tokens_per_s': tokens / step_s, 'loss': float(value)}


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
  parser.add_argument('--warmup', type=int, default=1)
  parser.add_argument('--steps', type=int, default=3,
                      help='timed steps (>= 1)')
  parser.add_argument('--optimizers', default=','.join(PATHS))
  args = parser.parse_args(argv)
  paths = args.optimizers.split(',')
  unknown = sorted(set(paths) - set(PATHS))
  if unknown:
    parser.error(f'unknown optimizers {unknown}; known: {", ".join(PATHS)}')
  print(f'{provenance.stamp()}. SmolLM2-135M shapes, layers='
        f'{args.layers or 30} (unrolled, as the CLI), seq={args.seq}, '
        f'remat per block, backend={jax.default_backend()}')
  results = {}
  for dtype_name in args.dtypes.split(','):
    config, decoder = _decoder(jnp.dtype(dtype_name), args.layers)
    for batch_size in (int(b) for b in args.batches.split(',')):
      batch = _batch(config, batch_size, args.seq)
      print(f'\n{dtype_name}, batch {batch_size} x {args.seq}')
      print(f'{"optimizer":<16}{"tokens/s":>10}{"step ms":>10}'
            f'{"compile s":>11}')
      results = {}
      for path in paths:
        results[path] = time_path(path, decoder, config, batch, args.warmup,
                                  args.steps)
        r = results[path]
        print(f'{path:<16}{r["tokens_per_s"]:>10.1f}'
              f'{1e3 * r["step_s"]:>10.1f}{r["compile_s"]:>11.1f}', flush=True)
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
