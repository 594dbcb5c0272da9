"""``--mesh data=2,fsdp=2,tensor=2``: the example's models on a device mesh.

The mesh has up to three axes: ``data`` (batch only), ``fsdp`` (batch and the
parameters' input side) and ``tensor`` (the parameters' output side, Megatron
style). Axes are ``Explicit`` (the default of :func:`jax.make_mesh`), so
``taco_optax`` reads every parameter's sharding from its type and updates it
per device with an exact, output-sharded top-k.

Parameter rule, for kernels laid out ``(in, out)``:

* ``q``/``k``/``v``/``qkv``/``gate``/``up``/``fc1``/``lm_head``:
  ``P('fsdp', 'tensor')`` (column parallel);
* ``o``/``down``/``fc2``: ``P('tensor', 'fsdp')`` (row parallel);
* token tables ``(vocab, d)``, tied or not, and an untied ``lm_head``
  kernel ``(d, vocab)``: the vocabulary over ``fsdp`` x ``tensor``, ``d``
  whole (``vocab_parallel``: the lookup, the logits and the loss never
  gather the table; a vocabulary those axes do not divide is refused);
* norm scales and biases: replicated.

A leading scanned-layer axis is never split, and an axis that its mesh axes do
not divide is left whole.
"""

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from examples.finetune.model import vocab_parallel

AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')

_COLUMN_PARALLEL = frozenset({'q', 'k', 'v', 'qkv', 'gate', 'up', 'fc1'})
_ROW_PARALLEL = frozenset({'o', 'down', 'fc2'})


class MeshError(ValueError):
  """A ``--mesh`` value that does not describe this machine's devices."""


def parse_mesh(spec: str) -> dict[str, int]:
  """``'data=2,fsdp=2,tensor=2'`` -> ``{'data': 2, 'fsdp': 2, 'tensor': 2}``.

  Axes left out have size 1.

  Raises:
    MeshError: on an unknown or repeated axis or a size that is not a
      positive integer.
  """
  sizes = dict.fromkeys(AXES, 1)
  seen = set()
  for part in spec.split(','):
    name, sep, size = part.strip().partition('=')
    name = name.strip()
    if not sep or name not in AXES or not size.strip().isdigit():
      raise MeshError(f'--mesh {spec!r}: expected NAME=SIZE pairs with NAME '
                      f'in {", ".join(AXES)}, e.g. data=2,fsdp=2,tensor=2')
    if name in seen:
      raise MeshError(f'--mesh {spec!r}: axis {name} given twice')
    if int(size) < 1:
      raise MeshError(f'--mesh {spec!r}: axis {name} must have size >= 1')
    seen.add(name)
    sizes[name] = int(size)
  return sizes


def make_mesh(spec: Optional[str]) -> Optional[jax.sharding.Mesh]:
  """The mesh a ``--mesh`` value asks for, or None when it is empty.

  Raises:
    MeshError: if ``spec`` is malformed or its axis sizes do not multiply to
      ``jax.device_count()``.
  """
  if not spec:
    return None
  sizes = parse_mesh(spec)
  shape = tuple(sizes[name] for name in AXES)
  devices = jax.device_count()
  if math.prod(shape) != devices:
    processes = jax.process_count()
    seen = (f'{devices}' if processes == 1 else
            f'{devices} ({processes} processes x {jax.local_device_count()})')
    per_process = math.prod(shape) // processes
    raise MeshError(
        f'--mesh {spec!r} has {math.prod(shape)} devices but JAX sees {seen}'
        + (f' (on CPU, set XLA_FLAGS='
           f'--xla_force_host_platform_device_count={per_process})'
           if per_process * processes == math.prod(shape) else ''))
  return jax.make_mesh(shape, AXES)


def _fits(size: int, axes: Any, mesh_shape: dict[str, int]) -> bool:
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return size % math.prod(mesh_shape[a] for a in names) == 0


def param_spec(names: tuple[str, ...], shape: tuple[int, ...],
               mesh_shape: dict[str, int], tied_embedding: bool = False) -> P:
  """The ``PartitionSpec`` of the parameter at state path ``names``.

  Args:
    names: the parameter's path (``decoder.path_names``).
    shape: its shape.
    mesh_shape: mesh axis name to size.
    tied_embedding: the token embedding is also the output head. Kept for
      callers; a tied table is split like any token table.

  Raises:
    MeshError: if a token table's vocabulary is not divisible by the mesh's
      ``fsdp`` x ``tensor`` devices.
  """
  del tied_embedding
  module = names[-2] if len(names) >= 2 else ''
  vocab_axis = {'embedding': 0}.get(names[-1], 1 if (
      names[-1] == 'kernel' and module == 'lm_head') else None)
  if vocab_axis is not None and (names[-1] != 'embedding'
                                 or module == 'embed'):
    try:
      spec = vocab_parallel.table_spec(shape, vocab_axis, mesh_shape)
    except ValueError as error:
      raise MeshError(f'{"/".join(names)}: {error}') from None
    return P() if spec is None else spec
  if names[-1] == 'embedding':
    trailing = ('tensor', 'fsdp')
  elif names[-1] == 'kernel' and module in _COLUMN_PARALLEL:
    trailing = ('fsdp', 'tensor')
    if module == 'qkv':  # (d, 3, width): the Q/K/V axis stays whole
      trailing = ('fsdp', None, 'tensor')
  elif names[-1] == 'kernel' and module in _ROW_PARALLEL:
    trailing = ('tensor', 'fsdp')
  else:
    return P()
  if len(shape) < len(trailing):
    return P()
  entries = (None,) * (len(shape) - len(trailing)) + trailing
  return P(*(axes if _fits(size, axes, mesh_shape) else None
             for size, axes in zip(shape, entries)))


def current_mesh() -> Optional[jax.sharding.Mesh]:
  """The mesh set by :func:`jax.set_mesh`, or None."""
  mesh = jax.sharding.get_mesh()
  return None if mesh.empty else mesh


def place_param(values: Any, names: tuple[str, ...],
                mesh: Optional[jax.sharding.Mesh],
                tied_embedding: bool = False, dtype: Any = None) -> jax.Array:
  """``values`` (host array) as ``dtype`` on the sharding of the parameter at
  ``names`` (if a mesh).

  On a mesh each device receives only its own block, cut from the host array
  (``jax.make_array_from_callback``): no whole copy on a first device, no
  comparison of the value across processes (``jax.device_put`` all-gathers
  a multi-process value to check that every process passed the same).
  """
  if mesh is None:
    return jnp.asarray(values, dtype=dtype)
  host = np.asarray(values)
  if dtype is not None:
    host = host.astype(jnp.dtype(dtype))
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  spec = param_spec(names, host.shape, mesh_shape, tied_embedding)
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                      lambda index: host[index])


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
  """The rows (first axis) of a ``shape`` array that this process's devices
  hold under ``sharding``: one contiguous block for the meshes here
  (``jax.make_mesh`` puts each process's devices together)."""
  blocks = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    rows = index[0] if index else slice(None)
    blocks.add((rows.start or 0, shape[0] if rows.stop is None else rows.stop))
  blocks = sorted(blocks)
  if any(stop != start for (_, stop), (start, _) in zip(blocks, blocks[1:])):
    raise MeshError(f'this process\'s devices hold the batch rows {blocks}: '
                    'not one block')
  return slice(blocks[0][0], blocks[-1][1])


def shard_batch(batch: Any, mesh: jax.sharding.Mesh) -> Any:
  """Splits every array of ``batch`` along its first axis over the batch axes.

  Arrays whose first axis the batch axes do not divide stay replicated. With
  several processes each hands in only the rows its own devices hold
  (``jax.make_array_from_process_local_data``): the host arrays are the
  whole batch on every process (the same seeded stream), the devices get
  only their rows.
  """
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))

  def put(x):
    spec = P(BATCH_AXES) if _fits(x.shape[0], BATCH_AXES, mesh_shape) else P()
    sharding = NamedSharding(mesh, spec)
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    rows = process_rows(sharding, x.shape)
    return jax.make_array_from_process_local_data(sharding, x[rows], x.shape)

  return jax.tree.map(put, batch)
