"""Per-device compiled memory of the example's train step, on a mesh or not.

Prepares the example's run from its flags (the default model, SmolLM2-135M,
unless ``--model``), compiles its train step for the first batch and prints
XLA's ``memory_analysis()`` of one device (arguments, outputs, donated
aliases, temporaries, peak = arguments + outputs - aliases + temporaries)
and every buffer of the compiled program at least as large as the token
table's shard on one device, by operation, with the whole token table's
size for scale. Nothing is trained.

  python -m benchmarks.mesh_memory                                # 1 device
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    python -m benchmarks.mesh_memory --mesh data=2,fsdp=2,tensor=2

  # every mesh of MESHES, TACO on both paths and AdamW,
  # with the buffers alive at each peak (XLA's dump), as Markdown:
  python -m benchmarks.mesh_memory --sweep --write docs/measured/mesh_memory.md

Further words are the example's flags (``--batch-size``, ``--seq-len``, ...).

``--sweep`` (:func:`sweep`): for every mesh of :data:`MESHES` (one device,
FSDP over 2, 4 and 8, data x FSDP, FSDP x tensor) and every run of
:data:`RUNS` (TACO's layer-wise step, TACO on the optax path, AdamW) it
compiles the example's train step in a fresh process with that many
simulated CPU devices (``--json``), and prints

* the compiled per-device arguments, temporaries and peak
  (``memory_analysis()``) with the peak's ratio to one device's and AdamW's
  to TACO's;
* the buffers alive at each peak by the operation that made them (XLA's heap
  simulation, from its dump: ``benchmarks/peak_buffers.py``);
* the peak resident set of a 4-step run of the example, one device and
  ``--rss-mesh`` (CPU devices share one process, so it holds every device's
  buffers).

The figures are XLA:CPU's. Nothing is timed.
"""

import collections
import concurrent.futures
import json
import math
import os
import re
import subprocess
import sys
import tempfile

from benchmarks import memory as memory_lib
from benchmarks import peak_buffers
from benchmarks import provenance
from examples.finetune import api

_ITEMSIZE = {'f32': 4, 's32': 4, 'u32': 4, 'pred': 1, 's8': 1, 'u8': 1,
             'f8e4m3fn': 1, 'bf16': 2, 'f16': 2, 's64': 8}
# Views and inputs of a computation, not buffers of their own.
_NOT_BUFFERS = frozenset({'parameter', 'bitcast', 'get-tuple-element',
                          'tuple'})
_BUFFER = re.compile(r'^\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[([\d,]*)\][^ ]* '
                     r'([\w\-]+)\(')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def large_buffers(hlo_text: str, at_least: int) -> collections.Counter:
  """``{(bytes, dtype[shape], op, jax op name): count}`` of the buffers
  that the program's computations (not the insides of fusions) make."""
  found = collections.Counter()
  inside_fusion = False
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():  # a computation's header
      inside_fusion = bool(re.match(r'%(fused|wrapped)_', line))
    match = _BUFFER.match(line)
    if inside_fusion or not match or match.group(3) in _NOT_BUFFERS:
      continue
    dtype, dims, op = match.groups()
    name = _OP_NAME.search(line)
    size = math.prod(int(d) for d in dims.split(',') if d)
    nbytes = size * _ITEMSIZE.get(dtype, 4)
    if nbytes >= at_least:
      where = name.group(1).split('/')[-1] if name else ''
      found[(nbytes, f'{dtype}[{dims}]', op, where)] += 1
  return found


def measure(argv) -> dict:
  """The compiled step's per-device figures for the example's flags
  ``argv`` (and, when XLA dumped it, its peak's buffers)."""
  with tempfile.TemporaryDirectory() as output_dir:
    compiled, prepared, mesh = api.compile_first_step(
        ['--eval-size', '8', '--no-progress', '--no-checkpoint',
         '--output-dir', output_dir] + list(argv))
  memory = compiled.memory_analysis()
  table = prepared.model.embed.embedding[...]
  return dict(
      mesh=dict(mesh.shape) if mesh else None,
      devices=math.prod(mesh.shape.values()) if mesh else 1,
      arguments=memory.argument_size_in_bytes,
      outputs=memory.output_size_in_bytes,
      aliased=memory.alias_size_in_bytes,
      temporaries=memory.temp_size_in_bytes,
      peak=memory_lib.compiled_peak(memory),
      table_bytes=table.nbytes, table=f'{table.dtype}{list(table.shape)}',
      hlo=compiled.as_text())


# The sweep: every mesh, every run, each in its own process.

MESHES = (None, 'fsdp=2', 'fsdp=4', 'fsdp=8', 'data=2,fsdp=4',
          'fsdp=4,tensor=2')
RUNS = (('TACO layer-wise', ['--optimizer', 'taco', '--taco-step',
                             'layerwise']),
        ('TACO optax path', ['--optimizer', 'taco', '--taco-step', 'optax']),
        ('AdamW', ['--optimizer', 'adamw']))
# Targets on the default model (float32, batch 4 x 64), TACO layer-wise:
# the peak against one device's, and an absolute one at fsdp=8.
TARGETS = {'fsdp=2': 0.6, 'fsdp=4': 0.35}
FSDP8_TARGET_MIB = 160
ADAMW_OVER_TACO_TARGET = 3.0


def _devices(mesh):
  if mesh is None:
    return 1
  count = 1
  for part in mesh.split(','):
    count *= int(part.split('=')[1])
  return count


def _env(devices, dump_dir):
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             TACO_MESH_MEMORY_DUMP=dump_dir)
  flags = [f'--xla_force_host_platform_device_count={devices}',
           f'--xla_dump_to={dump_dir}', '--xla_dump_hlo_module_re=.*step.*']
  env['XLA_FLAGS'] = ' '.join([env.get('XLA_FLAGS', '')] + flags).strip()
  return env


def one(mesh, run_flags, extra):
  """The ``--json`` figures of one (mesh, run), from a fresh process."""
  with tempfile.TemporaryDirectory() as dump_dir:
    words = list(run_flags) + list(extra)
    if mesh:
      words += ['--mesh', mesh]
    result = subprocess.run(
        [sys.executable, '-m', 'benchmarks.mesh_memory', '--json', *words],
        env=_env(_devices(mesh), dump_dir), capture_output=True, text=True,
        check=False)
  lines = [l for l in result.stdout.splitlines() if l.startswith('JSON ')]
  if result.returncode or not lines:
    raise RuntimeError(f'mesh {mesh} {run_flags}: exit {result.returncode}\n'
                       + result.stderr[-3000:])
  return json.loads(lines[-1][5:])


def run_rss(mesh, extra, steps=4):
  """Peak RSS (bytes) of ``python -m examples.finetune --steps 4`` on
  ``mesh`` (None: one device), as its results.json reports it."""
  with tempfile.TemporaryDirectory() as output_dir:
    words = ['--steps', str(steps), '--eval-size', '8', '--no-progress',
             '--no-checkpoint', '--output-dir', output_dir, *extra]
    if mesh:
      words += ['--mesh', mesh]
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_force_host_'
                        f'platform_device_count={_devices(mesh)}').strip()
    result = subprocess.run([sys.executable, '-m', 'examples.finetune',
                             *words], env=env, capture_output=True,
                            text=True, check=False)
    if result.returncode:
      raise RuntimeError(f'run on {mesh}: {result.stderr[-3000:]}')
    return api.read_results(output_dir).process_peak_rss_bytes


def _mib(n):
  return f'{n / 2**20:,.1f}'


def report(figures, rss, extra):
  """The sweep's Markdown body from ``figures[(mesh, run name)]``."""
  names = [name for name, _ in RUNS]
  one_device = {name: figures[(None, name)]['peak'] for name in names}
  print(f'Example flags: `{" ".join(extra) or "(defaults)"}`; compiled '
        'per-device figures in MiB (arguments / temporaries / **peak**), '
        'XLA:CPU.\n')
  print('| mesh | ' + ' | '.join(names) + ' | TACO layer-wise peak / one '
        'device | AdamW / TACO layer-wise |')
  print('| --- |' + ' --- |' * (len(names) + 2))
  for mesh in MESHES:
    cells = []
    for name in names:
      f = figures[(mesh, name)]
      cells.append(f'{_mib(f["arguments"])} / {_mib(f["temporaries"])} / '
                   f'**{_mib(f["peak"])}**')
    taco = figures[(mesh, 'TACO layer-wise')]['peak']
    adamw = figures[(mesh, 'AdamW')]['peak']
    print(f'| {mesh or "one device"} | ' + ' | '.join(cells) +
          f' | {taco / one_device["TACO layer-wise"]:.2f} | '
          f'{adamw / taco:.2f} |')
  print('\nTargets (TACO layer-wise): peak <= '
        + ', '.join(f'{r} x one device at {m}' for m, r in TARGETS.items())
        + f', <= {FSDP8_TARGET_MIB} MiB at fsdp=8, AdamW / TACO >= '
        f'{ADAMW_OVER_TACO_TARGET} on every mesh.\n')
  for mesh in MESHES:
    taco = figures[(mesh, 'TACO layer-wise')]
    adamw = figures[(mesh, 'AdamW')]['peak']
    checks = []
    if mesh in TARGETS:
      ratio = taco['peak'] / one_device['TACO layer-wise']
      checks.append(f'peak / one device {ratio:.2f} (target <= '
                    f'{TARGETS[mesh]}): '
                    + ('met' if ratio <= TARGETS[mesh] else '**missed**'))
    if mesh == 'fsdp=8':
      checks.append(f'peak {_mib(taco["peak"])} MiB (target <= '
                    f'{FSDP8_TARGET_MIB}): ' + (
                        'met' if taco['peak'] <= FSDP8_TARGET_MIB * 2**20
                        else '**missed**'))
    ratio = adamw / taco['peak']
    checks.append(f'AdamW / TACO {ratio:.2f} (target >= '
                  f'{ADAMW_OVER_TACO_TARGET}): ' + (
                      'met' if ratio >= ADAMW_OVER_TACO_TARGET
                      else '**missed**'))
    print(f'- {mesh or "one device"}: ' + '; '.join(checks))
  print('\n## What is alive at each peak\n')
  print('XLA\'s heap simulation of one device (its dump\'s *stack trace '
        'breakdown for peak usage*), by the JAX operation that made each '
        'buffer; MiB, with the number of buffers.\n')
  for mesh in MESHES:
    for name in names:
      f = figures[(mesh, name)]
      if not f.get('breakdown'):
        continue
      print(f'**{mesh or "one device"}, {name}** (XLA peak '
            f'{_mib(f["xla_peak"])} MiB):\n')
      for group, nbytes, count in f['breakdown']:
        print(f'- {_mib(nbytes)} ({count}): `{group}`')
      print()
  if rss:
    print('## Process peak RSS of a 4-step run\n')
    print('`python -m examples.finetune --steps 4 --eval-size 8 [--mesh M]`'
          ' (results.json\'s `process_peak_rss_bytes`; CPU devices share the '
          'process):\n')
    for mesh, nbytes in rss.items():
      print(f'- {mesh or "one device"}: {nbytes / 2**30:.2f} GiB')


def sweep(argv):
  write = None
  jobs = 2
  rss_meshes = [None, 'fsdp=8']
  extra = []
  words = iter(argv)
  for word in words:
    if word == '--write':
      write = next(words)
    elif word == '--jobs':
      jobs = int(next(words))
    elif word == '--rss-mesh':
      rss_meshes = [None, next(words)]
    elif word == '--no-rss':
      rss_meshes = []
    else:
      extra.append(word)
  pairs = [(mesh, name, flags) for mesh in MESHES for name, flags in RUNS]
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    futures = {(mesh, name): pool.submit(one, mesh, flags, extra)
               for mesh, name, flags in pairs}
    figures = {key: future.result() for key, future in futures.items()}
  rss = {mesh: run_rss(mesh, extra) for mesh in rss_meshes}
  text = provenance.captured(lambda: (print(provenance.stamp() + '\n'),
                                      report(figures, rss, extra)))
  if write:
    provenance.write_report(
        write, 'Memory of the example\'s step on device meshes',
        'python -m benchmarks.mesh_memory --sweep '
        + ' '.join(argv), text)


def main(argv) -> None:
  if argv[:1] == ['--sweep']:
    sweep(argv[1:])
    return
  if argv[:1] == ['--json']:  # one run of the sweep, in its own process
    figures = measure(argv[1:])
    dump = os.environ.get('TACO_MESH_MEMORY_DUMP')
    breakdown = dump and peak_buffers.peak_breakdown(dump)
    figures['breakdown'] = breakdown and peak_buffers.grouped(breakdown, 10)
    figures['xla_peak'] = breakdown and breakdown.peak_bytes
    del figures['hlo']
    print('JSON ' + json.dumps(figures))
    return
  figures = measure(argv)
  mib = lambda n: f'{n / 2**20:.1f} MiB'
  shards = figures['devices']
  print(provenance.stamp())
  print(f'mesh {figures["mesh"]}; per device: arguments '
        f'{mib(figures["arguments"])}, outputs '
        f'{mib(figures["outputs"])}, aliased '
        f'{mib(figures["aliased"])}, temporaries '
        f'{mib(figures["temporaries"])}; peak {mib(figures["peak"])} '
        f'(x {shards} devices = {mib(figures["peak"] * shards)})')
  print(f'token table {figures["table"]} = {mib(figures["table_bytes"])}; '
        'buffers of at least a quarter of it, per device:')
  for (_, shape, op, where), count in sorted(
      large_buffers(figures['hlo'], figures['table_bytes'] // 4).items(),
      key=lambda item: (-item[0][0], item[0][1:])):
    print(f'  {count:3d} x {shape:<22} {op:<18} {where}')


if __name__ == '__main__':
  main(sys.argv[1:])
