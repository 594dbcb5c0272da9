"""Per-device memory on a device mesh: compiled on shapes only, and predicted.

:func:`compiled` compiles the example's steps for a Hugging Face config on a
mesh (``data`` x ``fsdp`` x ``tensor``, the example's sharding rule:
``examples/finetune/model/sharding.py``) from abstract shapes, so a
reduced-layer Qwen3-32B or Llama-3-70B compiles on a CPU with nothing
allocated, and reads XLA's per-device ``memory_analysis()``:

* TACO's layer-wise step (``taco_optax.layerwise.train_step``, the
  example's column blocks),
* AdamW's plain ``value_and_grad -> update`` step (moments in the parameter
  dtype, as optax keeps them).

It needs as many devices as the mesh (``XLA_FLAGS=
--xla_force_host_platform_device_count=N``); :func:`compiled_in_subprocess`
starts a process with them. The prediction is
:func:`benchmarks.planner.plan_on_mesh` (the example's formula);
``python -m benchmarks.planner --validate-mesh`` compares the two.
"""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import memory
from examples.finetune import api
import taco_optax


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
  return jax.eval_shape(memory.token_batch, struct(jnp.int32),
                        struct(jnp.bool_))


def _analysis(compiled):
  stats = compiled.memory_analysis()
  return {'arguments': stats.argument_size_in_bytes,
          'temporaries': stats.temp_size_in_bytes,
          'peak': (stats.argument_size_in_bytes + stats.output_size_in_bytes
                   - stats.alias_size_in_bytes + stats.temp_size_in_bytes)}


def compiled(hf_config, mesh_spec, *, dtype, batch, seq, num_layers,
             scan_layers=False):
  """Per-device compiled figures (bytes) of both steps on ``mesh_spec``."""
  mesh = api.make_mesh(mesh_spec)
  with jax.set_mesh(mesh):
    config, decoder = memory.abstract_decoder(
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
            memory.plain_step(decoder.loss, adamw), adamw_state)),
    }
  figures['weights'] = api.device_bytes(params)
  figures['taco_state'] = api.device_bytes(taco_state)
  figures['adamw_state'] = api.device_bytes(adamw_state)
  return figures


def devices_of(mesh_spec: str) -> int:
  return math.prod(api.parse_mesh(mesh_spec).values())


def compiled_in_subprocess(hf_config, mesh_spec, *, dtype, batch, seq,
                           num_layers, scan_layers=False):
  """:func:`compiled` in a fresh process with the mesh's CPU devices."""
  request = dict(hf_config=hf_config, mesh_spec=mesh_spec,
                 dtype=jnp.dtype(dtype).name, batch=batch, seq=seq,
                 num_layers=num_layers, scan_layers=scan_layers)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_force_host_'
                      f'platform_device_count={devices_of(mesh_spec)}').strip()
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.mesh_plan', json.dumps(request)],
      env=env, capture_output=True, text=True, check=False)
  lines = [l for l in result.stdout.splitlines() if l.startswith('JSON ')]
  if result.returncode or not lines:
    raise RuntimeError(f'{mesh_spec}: exit {result.returncode}\n'
                       + result.stderr[-3000:])
  return json.loads(lines[-1][5:])


def main(argv):
  request = json.loads(argv[0])
  request['dtype'] = jnp.dtype(request['dtype'])
  print('JSON ' + json.dumps(compiled(**request)))


if __name__ == '__main__':
  main(sys.argv[1:])
