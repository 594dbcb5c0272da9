"""Compiled peak memory of a full train step, per optimizer and path.

For the example's Llama-style ``DecoderLM`` (SmolLM2-135M shapes by default,
batch 4, short sequences, remat on), compiles on abstract shapes (nothing is
allocated) and reads XLA's ``memory_analysis()`` of

* the forward-only loss,
* the plain ``value_and_grad -> tx.update -> apply_updates`` step for
  ``optax.adamw`` and ``taco_optax.taco``,
* the layerwise TACO step (``taco_optax.layerwise.train_step``, on the
  example's split of the model, ``examples/finetune/model/layered.py``),
* the same step built from the plain loss (``taco plain-loss``: its blocks
  read from the loss's jaxpr; the token table has a dense gradient there),

with stacked (``lax.scan``) and unrolled layers, params and state donated.
Peak = arguments + outputs - aliased + temporaries. The table splits it as in
the paper's Figure 1: weights, persistent optimizer state, activations (the
forward's temporaries) and the rest (gradients and other transients). The last
line is ``taco_overhead=... adamw_overhead=... state_ratio=...`` with
overhead = (peak_train - peak_forward) / weight bytes, for scanned layers
(``*_unrolled`` for unrolled ones).

The CPU backend may compute bf16 matmuls in f32, inflating temporaries, so
run with ``--dtype float32`` as well.

  python -m benchmarks.memory [--dtype bfloat16|float32] [--batch 4]
      [--seq 64] [--layers N]

With ``--execute PATH`` (on a GPU; one path per process, since the device's
``peak_bytes_in_use`` only grows) it instead runs that path for a few steps
on random weights and prints the measured peak and tokens/s.

On a device mesh (``data`` x ``fsdp`` x ``tensor``, the example's sharding
rule: ``examples/finetune/model/sharding.py``), :func:`compiled_on_mesh`
compiles TACO's layer-wise step and AdamW's plain step for a Hugging Face
config from abstract shapes, so a reduced-layer Qwen3-32B or Llama-3-70B
compiles on a CPU with nothing allocated, and reads XLA's per-device
``memory_analysis()``. It needs as many devices as the mesh
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``);
:func:`compiled_on_mesh_in_subprocess` starts a process with them, and
``python -m benchmarks.planner --validate-mesh`` compares it with the
example's prediction.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from benchmarks import presets
from benchmarks import provenance
from examples.finetune import api
import taco_optax

# SmolLM2-135M (Hugging Face config.json, Llama architecture).
SMOLLM2_135M = presets.PRESETS['smollm2-135m']


def compiled_peak(stats) -> int:
  """Peak bytes of a compiled program from its ``memory_analysis()``:
  arguments + outputs - donated aliases + temporaries."""
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def peak_bytes(fn, args, donate=()):
  """(peak, temp) bytes of ``jit(fn)`` compiled for ``args``."""
  compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  stats = compiled.memory_analysis()
  return compiled_peak(stats), stats.temp_size_in_bytes


def plain_step(loss, tx):
  """``value_and_grad -> tx.update -> apply_updates``: every gradient at once.
  """
  value_and_grad = jax.value_and_grad(loss)

  def step(params, opt_state, batch):
    value, grads = value_and_grad(params, batch)
    updates, new_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state, value

  return step


class LayerwiseTaco(NamedTuple):
  """TACO with the paper's settings, and its layer-wise steps on a decoder:
  from the hand-split loss, and from the plain loss."""
  optimizer: optax.GradientTransformation
  step: Callable[..., Any]
  plain_loss_step: Callable[..., Any]


def layerwise_taco(decoder, config) -> LayerwiseTaco:
  """The layer-wise TACO steps of ``decoder`` with the paper's settings."""
  tx = api.optimizer('taco').build(3e-5, api.decoder_hints(config))
  plain_loss = lambda params, batch: decoder.loss(params, batch)
  return LayerwiseTaco(tx, taco_optax.layerwise.train_step(decoder.loss, tx),
                       taco_optax.layerwise.train_step(plain_loss, tx))


PATHS = ('forward', 'adamw', 'taco', 'taco layerwise', 'taco plain-loss')


def _step_of(path, train, loss):
  if path == 'taco layerwise':
    return train.step
  if path == 'taco plain-loss':
    return train.plain_loss_step
  return plain_step(loss, optax.adamw(1e-5) if path == 'adamw'
                    else train.optimizer)


def layered_decoder(hf_config, *, dtype, scan_layers, num_layers=None,
                    remat=True, abstract=False):
  """``(config, layered model)`` of the example's decoder of ``hf_config``
  on random weights (only shapes with ``abstract``)."""
  config = api.model_config(hf_config, num_layers)
  model = api.new_decoder(config, dtype=dtype, remat=remat,
                          scan_layers=scan_layers, abstract=abstract)
  return config, api.layered_model(model)


def abstract_decoder(hf_config, **kwargs):
  """:func:`layered_decoder` on shapes only: nothing is allocated."""
  return layered_decoder(hf_config, abstract=True, **kwargs)


def token_batch(input_ids, attention_mask):
  """A batch whose loss is the next-token NLL of every real token."""
  return api.Batch(input_ids, attention_mask,
                   loss_mask=attention_mask.astype(jnp.float32))


def measure(hf_config, *, dtype, scan_layers, batch, seq, num_layers=None,
            paths=PATHS, remat=True):
  """Rows of (path, peak, state, temp) bytes, and the weight bytes."""
  config, decoder = abstract_decoder(hf_config, dtype=dtype,
                                     scan_layers=scan_layers,
                                     num_layers=num_layers, remat=remat)
  params = decoder.params
  tokens = jax.eval_shape(token_batch,
                          jax.ShapeDtypeStruct((batch, seq), jnp.int32),
                          jax.ShapeDtypeStruct((batch, seq), jnp.bool_))
  train = layerwise_taco(decoder, config)
  rows = []
  for path in paths:
    start = time.perf_counter()
    if path == 'forward':
      state = ()
      peak, temp = peak_bytes(decoder.loss, (params, tokens))
    else:
      tx = optax.adamw(1e-5) if path == 'adamw' else train.optimizer
      state = jax.eval_shape(tx.init, params)
      step = _step_of(path, train, decoder.loss)
      peak, temp = peak_bytes(step, (params, state, tokens), donate=(0, 1))
    rows.append((path, peak, api.tree_bytes(state), temp,
                 time.perf_counter() - start))
  return config, api.tree_bytes(params), rows


def print_table(title, weights, rows):
  mib = lambda x: x / 2**20
  forward_peak = rows[0][1]
  forward_temp = rows[0][3]
  print(f'\n{title}')
  print(f'{"path":<16}{"peak MiB":>10}{"weights":>9}{"state":>8}'
        f'{"activ.":>8}{"grads+transient":>17}{"overhead":>10}'
        f'{"compile s":>11}')
  overheads = {}
  for path, peak, state, temp, seconds in rows:
    activations = forward_temp
    rest = peak - weights - state - activations if path != 'forward' else 0
    overhead = (peak - forward_peak) / weights
    overheads[path] = overhead
    print(f'{path:<16}{mib(peak):>10.1f}{mib(weights):>9.1f}{mib(state):>8.1f}'
          f'{mib(activations):>8.1f}{mib(rest):>17.1f}{overhead:>10.3f}'
          f'{seconds:>11.1f}')
  return overheads


def execute(path, *, dtype, scan_layers, batch, seq, num_layers, steps,
            hf_config=None):
  """Runs one path on the default device; measured peak bytes and tokens/s."""
  config, decoder = layered_decoder(hf_config or SMOLLM2_135M, dtype=dtype,
                                    scan_layers=scan_layers,
                                    num_layers=num_layers)
  params = decoder.params
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0,
                              config.vocab_size)
  batch_data = token_batch(tokens, jnp.ones((batch, seq), bool))
  train = layerwise_taco(decoder, config)
  if path == 'forward':
    run = jax.jit(decoder.loss)
    args = (params, batch_data)
    step = lambda: run(*args)
  else:
    tx = optax.adamw(1e-5) if path == 'adamw' else train.optimizer
    state = tx.init(params)
    run = jax.jit(_step_of(path, train, decoder.loss), donate_argnums=(0, 1))
    carry = [params, state]

    def step():
      carry[0], carry[1], value = run(carry[0], carry[1], batch_data)
      return value
  jax.block_until_ready(step())
  start = time.perf_counter()
  for _ in range(steps):
    value = step()
  jax.block_until_ready(value)
  seconds = (time.perf_counter() - start) / steps
  stats = jax.devices()[0].memory_stats() or {}
  return {'path': path, 'scan_layers': scan_layers, 'dtype': dtype.name,
          'batch': batch, 'seq': seq, 'layers': config.num_layers,
          'weights_bytes': api.tree_bytes(params) if path == 'forward'
                           else api.tree_bytes(carry[0]),
          'peak_bytes_in_use': stats.get('peak_bytes_in_use'),
          'step_seconds': seconds, 'tokens_per_second': batch * seq / seconds,
          'loss': float(value), 'device': jax.devices()[0].device_kind}


# On a device mesh.

def _with_state_shardings(tx, params):
  state = jax.eval_shape(tx.init, params)
  shardings = taco_optax.state_shardings(tx, params)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      state, shardings)


def _batch(mesh, batch, seq):
  shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  rows = (P(api.BATCH_AXES) if batch % math.prod(
      shape[a] for a in api.BATCH_AXES) == 0 else P())
  struct = lambda dtype: jax.ShapeDtypeStruct(
      (batch, seq), dtype, sharding=NamedSharding(mesh, rows))
  return jax.eval_shape(token_batch, struct(jnp.int32),
                        struct(jnp.bool_))


def _analysis(compiled):
  stats = compiled.memory_analysis()
  return {'arguments': stats.argument_size_in_bytes,
          'temporaries': stats.temp_size_in_bytes,
          'peak': compiled_peak(stats)}


def compiled_on_mesh(hf_config, mesh_spec, *, dtype, batch, seq, num_layers,
             scan_layers=False):
  """Per-device compiled figures (bytes) of both steps on ``mesh_spec``."""
  mesh = api.make_mesh(mesh_spec)
  with jax.set_mesh(mesh):
    config, decoder = abstract_decoder(
        hf_config, dtype=dtype, scan_layers=scan_layers,
        num_layers=num_layers)
    params = api.with_shardings(decoder.params, mesh)
    tokens = _batch(mesh, batch, seq)
    taco = api.optimizer('taco').build(3e-5, api.decoder_hints(config))
    step = taco_optax.layerwise.train_step(
        decoder.loss, taco,
        column_block_elements=api.COLUMN_BLOCK_ELEMENTS)
    taco_state = _with_state_shardings(taco, params)
    adamw = optax.adamw(1e-5)
    adamw_state = _with_state_shardings(adamw, params)
    lower = lambda fn, state: jax.jit(fn, donate_argnums=(0, 1)).lower(
        params, state, tokens).compile()
    figures = {
        'taco layerwise': _analysis(lower(step, taco_state)),
        'adamw plain': _analysis(lower(
            plain_step(decoder.loss, adamw), adamw_state)),
    }
  figures['weights'] = api.device_bytes(params)
  figures['taco_state'] = api.device_bytes(taco_state)
  figures['adamw_state'] = api.device_bytes(adamw_state)
  return figures


def devices_of(mesh_spec: str) -> int:
  return math.prod(api.parse_mesh(mesh_spec).values())


def compiled_on_mesh_in_subprocess(hf_config, mesh_spec, *, dtype, batch, seq,
                           num_layers, scan_layers=False):
  """:func:`compiled_on_mesh` in a fresh process with the mesh's CPU
  devices."""
  request = dict(hf_config=hf_config, mesh_spec=mesh_spec,
                 dtype=jnp.dtype(dtype).name, batch=batch, seq=seq,
                 num_layers=num_layers, scan_layers=scan_layers)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_force_host_'
                      f'platform_device_count={devices_of(mesh_spec)}').strip()
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.memory', '--on-mesh',
       json.dumps(request)],
      env=env, capture_output=True, text=True, check=False)
  lines = [l for l in result.stdout.splitlines() if l.startswith('JSON ')]
  if result.returncode or not lines:
    raise RuntimeError(f'{mesh_spec}: exit {result.returncode}\n'
                       + result.stderr[-3000:])
  return json.loads(lines[-1][5:])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--seq', type=int, default=64)
  parser.add_argument('--layers', type=int, default=None,
                      help='override the number of layers (default: 30)')
  parser.add_argument('--skip-unrolled', action='store_true')
  parser.add_argument('--execute', default=None,
                      choices=PATHS)
  parser.add_argument('--unrolled', action='store_true',
                      help='with --execute: unrolled instead of scanned layers')
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--write', metavar='PATH', default=None,
                      help='also write the output, with its provenance, as '
                      'Markdown')
  parser.add_argument('--on-mesh', metavar='REQUEST', default=None,
                      help='compile both steps on a mesh from a JSON request '
                      '(compiled_on_mesh_in_subprocess\'s child process)')
  args = parser.parse_args()
  if args.on_mesh:
    request = json.loads(args.on_mesh)
    request['dtype'] = jnp.dtype(request['dtype'])
    print('JSON ' + json.dumps(compiled_on_mesh(**request)))
    return
  dtype = jnp.dtype(args.dtype)
  if args.execute:
    print(json.dumps(execute(args.execute, dtype=dtype,
                             scan_layers=not args.unrolled, batch=args.batch,
                             seq=args.seq, num_layers=args.layers,
                             steps=args.steps)))
    return
  text = provenance.captured(lambda: compiled_tables(args, dtype))
  if args.write:
    command = ' '.join(['python -m benchmarks.memory'] + sys.argv[1:])
    provenance.write_report(args.write, 'Compiled peak memory', command, text)


def compiled_tables(args, dtype):
  """Prints the tables and the summary line of the compiled analysis."""
  print(f'SmolLM2-135M shapes, dtype={dtype.name}, batch={args.batch}, '
        f'seq={args.seq}, layers={args.layers or 30}, remat on, '
        f'backend={jax.default_backend()}')
  results = {}
  layouts = [True] if args.skip_unrolled else [True, False]
  for scan_layers in layouts:
    _, weights, rows = measure(SMOLLM2_135M, dtype=dtype,
                               scan_layers=scan_layers, batch=args.batch,
                               seq=args.seq, num_layers=args.layers)
    title = 'scanned layers (lax.scan)' if scan_layers else 'unrolled layers'
    results[scan_layers] = (print_table(title, weights, rows), rows)
  overheads, rows = results[True]
  states = {path: state for path, _, state, _, _ in rows}
  line = (f'taco_overhead={overheads["taco layerwise"]:.3f} '
          f'taco_plain_loss_overhead={overheads["taco plain-loss"]:.3f} '
          f'adamw_overhead={overheads["adamw"]:.3f} '
          f'state_ratio={states["adamw"] / states["taco"]:.1f}')
  if False in results:
    unrolled = results[False][0]
    line += (f' taco_overhead_unrolled={unrolled["taco layerwise"]:.3f}'
             ' taco_plain_loss_overhead_unrolled='
             f'{unrolled["taco plain-loss"]:.3f}'
             f' adamw_overhead_unrolled={unrolled["adamw"]:.3f}')
  print(line)


if __name__ == '__main__':
  main()
