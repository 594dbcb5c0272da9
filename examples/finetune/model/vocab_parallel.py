"""A token table split over the vocabulary on a mesh: lookup, logits, loss.

On ``--mesh`` the token table (``[vocab, d]``, and an untied head's ``[d,
vocab]`` kernel) is split along the vocabulary over the mesh axes that split
parameters (:data:`VOCAB_AXES`): each device holds ``vocab / s`` whole rows.
Nothing here gathers the table:

* :func:`lookup`: each device looks up the ids it holds (every id of the
  batch rows it serves) and the rows are summed over the vocabulary axes
  (one row is non-zero: exact);
* :func:`project`: each device scores every position against its rows, so
  the logits come out split over the vocabulary (``[N, vocab / s]`` per
  device);
* :func:`token_log_probs` and :func:`pick`: the cross-entropy and the label
  words' scores on such logits, the max and the sums reduced over the
  vocabulary axes (float order differs from one device's sum).

Under autodiff each device's share of the table's gradient is its own rows
(a scatter of the looked-up rows' cotangent, ``d_logits^T features``): no
dense table gradient is reduced across devices.
"""

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# The mesh axes a token table's vocabulary is split over.
VOCAB_AXES = ('fsdp', 'tensor')


def _entries(spec: P, ndim: int) -> tuple[tuple[str, ...], ...]:
  entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  return tuple(() if e is None else ((e,) if isinstance(e, str) else tuple(e))
               for e in entries)


def vocab_split_axes(x: jax.Array, axis: int = 0) -> tuple[str, ...]:
  """The mesh axes that split ``x``'s ``axis`` (explicit sharding), or ()."""
  try:
    sharding = jax.typeof(x).sharding
  except (TypeError, AttributeError):
    return ()
  spec = getattr(sharding, 'spec', None)
  if spec is None or sharding.mesh.empty:
    return ()
  return _entries(spec, x.ndim)[axis]


def is_split_over_rows_only(table: jax.Array) -> bool:
  """Whether ``table`` is split over its rows by mesh axes and whole along
  every other axis (what :func:`lookup` and :func:`project` take)."""
  if not vocab_split_axes(table):
    return False
  spec = _entries(jax.typeof(table).sharding.spec, table.ndim)
  return not any(spec[1:])


def _without(entry: tuple[str, ...], axes: tuple[str, ...]) -> Any:
  kept = tuple(a for a in entry if a not in axes)
  return None if not kept else (kept[0] if len(kept) == 1 else kept)


def _rows_spec(x: jax.Array, axes: tuple[str, ...]) -> Any:
  """``x``'s leading-axis entry without the vocabulary axes."""
  return _without(_entries(jax.typeof(x).sharding.spec, x.ndim)[0], axes)


def _start(axes: tuple[str, ...], size: int) -> jax.Array:
  """Where this device's block of ``size`` rows starts (inside shard_map)."""
  return jax.lax.axis_index(axes) * size


def _shard_map(fn, in_specs, out_specs):
  return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs)


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """``table[ids]`` for a table split over its rows by mesh axes.

  The rows come out split like ``ids`` along its leading axis. An id outside
  ``[0, vocab)`` gives a NaN row (as ``jnp.take``).
  """
  axes = vocab_split_axes(table)
  vocab = table.shape[0]
  rows_entry = _rows_spec(ids, axes)
  tail = (None,) * (ids.ndim - 1)
  ids_here = jax.sharding.reshard(ids, P(rows_entry, *tail))

  def local(block, ids):
    offset = ids - _start(axes, block.shape[0])
    held = (offset >= 0) & (offset < block.shape[0])
    rows = jnp.take(block, jnp.clip(offset, 0, block.shape[0] - 1), axis=0)
    rows = jnp.where(held[..., None], rows, jnp.zeros((), rows.dtype))
    return jax.lax.psum(rows, axes)

  rows = _shard_map(local, (P(axes, None), P(rows_entry, *tail)),
                    P(rows_entry, *tail, None))(table, ids_here)
  outside = (ids_here < 0) | (ids_here >= vocab)
  rows = jnp.where(outside[..., None], jnp.array(jnp.nan, rows.dtype), rows)
  spec = _entries(jax.typeof(ids).sharding.spec, ids.ndim)
  return jax.sharding.reshard(rows, P(*(
      None if not e else (e[0] if len(e) == 1 else e) for e in spec), None))


def project(features: jax.Array, table: jax.Array, dtype: Any) -> jax.Array:
  """float32 ``features . table[v]`` for every row ``v`` of a table split
  over its rows: ``[N, vocab]`` split over the vocabulary (and along ``N``
  by the batch axes that do not split the vocabulary)."""
  axes = vocab_split_axes(table)
  rows_entry = _rows_spec(features, axes)
  flat = features.reshape(-1, features.shape[-1]) if features.ndim != 2 \
      else features
  flat = jax.sharding.reshard(flat, P(rows_entry, None))

  def local(features, block):
    return jnp.einsum('nd,vd->nv', features, block.astype(dtype),
                      preferred_element_type=jnp.float32)

  logits = _shard_map(local, (P(rows_entry, None), P(axes, None)),
                      P(rows_entry, axes))(flat, table)
  return logits.reshape(features.shape[:-1] + (table.shape[0],)) \
      if features.ndim != 2 else logits


def _logits_and(logits: jax.Array, ids: jax.Array):
  axes = vocab_split_axes(logits, logits.ndim - 1)
  rows_entry = _rows_spec(logits, axes)
  tail = (None,) * (ids.ndim - 1)
  return (axes, rows_entry,
          jax.sharding.reshard(ids, P(rows_entry, *tail)))


def _back_like(x: jax.Array, like: jax.Array) -> jax.Array:
  return jax.sharding.reshard(x, jax.typeof(like).sharding.spec)


def token_log_probs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """float32 ``log_softmax(logits)[targets]`` of ``[N, vocab]`` logits split
  over the vocabulary, split along ``N`` like ``targets``."""
  axes, rows_entry, targets_here = _logits_and(logits, targets)

  def local(logits, targets):
    logits = logits.astype(jnp.float32)
    width = logits.shape[-1]
    # The shift cancels in the value; held constant, it has no gradient.
    top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, -1)), axes)
    shifted = logits - top[:, None]
    columns = jnp.arange(width, dtype=targets.dtype) + _start(axes, width)
    picked = jax.lax.psum(jnp.sum(jnp.where(
        columns == targets[:, None], shifted, 0.0), -1), axes)
    total = jax.lax.psum(jnp.sum(jnp.exp(shifted), -1), axes)
    return picked - jnp.log(total)

  out = _shard_map(local, (P(rows_entry, axes), P(rows_entry)),
                   P(rows_entry))(logits, targets_here)
  return _back_like(out, targets)


def pick(logits: jax.Array, ids: jax.Array) -> jax.Array:
  """``take_along_axis(logits, ids, -1)`` of ``[N, vocab]`` logits split
  over the vocabulary (``ids``: ``[N, C]``), split along ``N`` like ``ids``.
  """
  axes, rows_entry, ids_here = _logits_and(logits, ids)

  def local(logits, ids):
    width = logits.shape[-1]
    offset = ids - _start(axes, width)
    held = (offset >= 0) & (offset < width)
    got = jnp.take_along_axis(logits, jnp.clip(offset, 0, width - 1), -1)
    return jax.lax.psum(jnp.where(held, got, 0.0), axes)

  out = _shard_map(local, (P(rows_entry, axes), P(rows_entry, None)),
                   P(rows_entry, None))(logits, ids_here)
  return _back_like(out, ids)


def is_vocab_split(logits: jax.Array) -> bool:
  """Whether ``logits``' last axis is split over mesh axes."""
  return bool(vocab_split_axes(logits, logits.ndim - 1))


def table_spec(shape: tuple[int, ...], vocab_axis: int,
               mesh_shape: dict[str, int]) -> Optional[P]:
  """The ``PartitionSpec`` of a token table (``vocab_axis`` its vocabulary)
  split over :data:`VOCAB_AXES`; ``None`` when the mesh does not split it.

  Raises:
    ValueError: if the vocabulary is not divisible by those axes' devices.
  """
  axes = tuple(a for a in VOCAB_AXES if mesh_shape.get(a, 1) > 1)
  if not axes:
    return None
  devices = math.prod(mesh_shape[a] for a in axes)
  if shape[vocab_axis] % devices:
    raise ValueError(
        f'the vocabulary ({shape[vocab_axis]} tokens) is not divisible by the '
        f'{devices} devices of mesh axes {"x".join(axes)}; choose a mesh whose '
        'fsdp x tensor size divides it')
  entry = axes[0] if len(axes) == 1 else axes
  return P(*(entry if i == vocab_axis else None for i in range(len(shape))))
