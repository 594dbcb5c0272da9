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

  # every mesh of benchmarks/mesh_sweep.py, TACO on both paths and AdamW,
  # with the buffers alive at each peak (XLA's dump), as Markdown:
  python -m benchmarks.mesh_memory --sweep --write docs/measured/mesh_memory.md

Further words are the example's flags (``--batch-size``, ``--seq-len``, ...).
"""

import collections
import json
import math
import os
import re
import sys
import tempfile

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


def _peak(memory) -> int:
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


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
      temporaries=memory.temp_size_in_bytes, peak=_peak(memory),
      table_bytes=table.nbytes, table=f'{table.dtype}{list(table.shape)}',
      hlo=compiled.as_text())


def main(argv) -> None:
  if argv[:1] == ['--sweep']:
    from benchmarks import mesh_sweep
    mesh_sweep.main(argv[1:])
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
