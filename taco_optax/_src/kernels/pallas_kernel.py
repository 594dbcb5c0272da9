"""TACO's column step as a Pallas (Triton) kernel for GPUs.

:func:`pallas_column_step` gives the results of
:func:`reference.reference_column_step` bit for bit. Each program
of the grid holds a block of ``rows_per_program`` gradient rows in registers,
padded to a power of two along the row (Triton's tensors must be), reads the
gradient once in its own dtype and does, per row:

1. the merge ``f32(1 - mu) * g``, plus the decayed history ``f32(mu) * M`` at
   the history's row indices;
2. ``k`` rounds of "largest magnitude, lowest index among ties, mask it out"
   (an ``argmax``), the order of ``lax.top_k``;
3. whether the row is finite.

Triton has no sort or top-k, so selection uses only primitives that
``jax/_src/pallas/triton/lowering.py`` lowers: ``iota``, integer
``and``/``eq``/``lt``, ``select_n``, ``bitcast_convert_type`` (same width),
``convert_element_type``, ``is_finite``, ``reduce_max``/``reduce_min``,
``argmax`` (its combine keeps the lower index on ties), masked ``load`` and
the loops of ``fori_loop``. Magnitudes are compared as the integer bits
``bitcast(x, int32) & 0x7fffffff``: for non-negative floats integer order is
float order, ``-0.0`` ties with ``0.0`` as under ``abs``, and no float
``max``'s NaN rule is involved.

Around the kernel, on ``(N, k)`` arrays only, plain ``jax.numpy`` decodes the
stored history and, after it, encodes the new one with ``codec``: keeping or
replacing the history needs the whole leaf's finite flag, which exists only
once every program has finished, so that epilogue is needed anyway, and sharing
the codec's code keeps the FP8 rounding identical. The gradient itself is never
copied or padded: loads past its edges are masked.

Checked on CPU in Pallas interpret mode (``interpret=True``), where XLA:CPU
runs the kernel body. Not yet checked: the Triton lowering on a GPU, its
speed, and whether Triton contracts the merge's multiply and add into an FMA
(the reference rounds them separately); ``benchmarks/gpu_kernel.sh`` checks
all three.
"""

import functools
from typing import Union

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from taco_optax._src.kernels import codec
from taco_optax._src.kernels import reference

# Rows longer than this run the reference: a padded row must fit in one
# program's registers (8192 float32 across 8 warps is 32 per thread per tile).
MAX_ROW_LENGTH = 8192
# Elements of one program's tile (rows_per_program * padded row length).
_TILE_ELEMENTS = 8192
_MAX_ROWS_PER_PROGRAM = 32
_GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_INDEX_DTYPES = (jnp.dtype(jnp.int32), jnp.dtype(jnp.int16))
_MASKED = -1  # below every magnitude key (keys are >= 0)


def _next_power_of_two(size: int) -> int:
  return 1 << max(size - 1, 0).bit_length()


def rows_per_program(row_length: int, num_rows: int) -> int:
  """Rows one program holds: a power of two, ``<= 32``, tile ``<= 8192``."""
  width = _next_power_of_two(row_length)
  rows = max(1, min(_MAX_ROWS_PER_PROGRAM, _TILE_ELEMENTS // width))
  return min(rows, _next_power_of_two(num_rows))


def supports(grad_rows: jax.Array, values: jax.Array, indices: jax.Array,
             update_topk: int = 1) -> bool:
  """Whether :func:`pallas_column_step` takes these dtypes and shapes.

  Rows longer than :data:`MAX_ROW_LENGTH` are accepted here (dtypes and
  shapes only); :func:`pallas_column_step` refuses them and ``dispatch``
  chooses the reference for them.

  Args:
    grad_rows: ``(N, m)`` float32 or bfloat16 gradient rows.
    values: ``(N, k)`` history values in a storage dtype of ``codec``.
    indices: ``(N, k)`` int32 or int16 history indices.
    update_topk: winners per row.

  Returns:
    True when the inputs are accepted.
  """
  if grad_rows.ndim != 2 or values.ndim != 2 or indices.shape != values.shape:
    return False
  n, m = grad_rows.shape
  k = values.shape[1]
  return (jnp.dtype(grad_rows.dtype) in _GRAD_DTYPES
          and jnp.dtype(indices.dtype) in _INDEX_DTYPES
          and values.shape[0] == n and 1 <= update_topk <= k <= m < 2**31)


def _select_kernel(one_minus_mu_ref, grads_ref, history_indices_ref,
                   decayed_history_ref, top_values_ref, top_indices_ref,
                   finite_ref, *, num_rows, row_length, history_length,
                   rounds):
  """One program: merge, top-``rounds`` selection and finiteness of its rows.

  Refs are blocks: ``grads_ref`` ``(R, W)`` (partly past the gradient's
  edges), the history ``(R, K)``, the outputs ``(R, K)`` and ``(R,)``, with
  ``W`` and ``K`` the padded row and history lengths.
  """
  block_rows, width = grads_ref.shape
  shape = (block_rows, width)
  columns = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  rows = (pl.program_id(0) * block_rows
          + jax.lax.broadcasted_iota(jnp.int32, shape, 0))
  in_row = columns < row_length
  grads = plgpu.load(grads_ref, mask=in_row & (rows < num_rows),
                     other=0).astype(jnp.float32)
  finite = jnp.min(jnp.where(jnp.isfinite(grads), 1, 0), axis=1)
  finite_ref[...] = finite.astype(jnp.int32)

  def add_history(slot, candidates):
    # Row indices within a row are distinct, so each position gets at most
    # one addition; untouched entries keep their bits (-0.0 stays -0.0).
    hit = columns == history_indices_ref[:, slot][:, None]
    return jnp.where(hit, candidates + decayed_history_ref[:, slot][:, None],
                     candidates)

  candidates = jax.lax.fori_loop(0, history_length, add_history,
                                 one_minus_mu_ref[0] * grads)
  bits = jax.lax.bitcast_convert_type(candidates, jnp.int32)
  keys = jnp.where(in_row, bits & 0x7fffffff, _MASKED)

  out_shape = top_indices_ref.shape
  slots = jax.lax.broadcasted_iota(jnp.int32, out_shape, 1)

  def select_one(slot, carry):
    keys, top_bits, top_indices = carry
    best = jnp.argmax(keys, axis=1).astype(jnp.int32)  # ties: lowest index
    hit = columns == best[:, None]
    # Exactly one hit per row: its bits, sign and all (-0.0 included).
    chosen = jnp.max(jnp.where(hit, bits, jnp.iinfo(jnp.int32).min), axis=1)
    here = slots == slot
    return (jnp.where(hit, _MASKED, keys),
            jnp.where(here, chosen[:, None], top_bits),
            jnp.where(here, best[:, None], top_indices))

  zeros = jnp.zeros(out_shape, jnp.int32)
  _, top_bits, top_indices = jax.lax.fori_loop(0, rounds, select_one,
                                               (keys, zeros, zeros))
  top_values_ref[...] = jax.lax.bitcast_convert_type(top_bits, jnp.float32)
  top_indices_ref[...] = top_indices


def _pad_history(array: jax.Array, rows: int, width: int,
                 fill: Union[int, float]) -> jax.Array:
  return jnp.pad(array, ((0, rows - array.shape[0]),
                         (0, width - array.shape[1])), constant_values=fill)


@functools.partial(jax.jit, static_argnames=('rounds', 'interpret'))
def _select(grads: jax.Array, history_indices: jax.Array,
            decayed_history: jax.Array, one_minus_mu: jax.Array, *,
            rounds: int, interpret: bool):
  """Runs the kernel: ``(top_values, top_indices)`` ``(N, rounds)``, finite."""
  num_rows, row_length = grads.shape
  history_length = history_indices.shape[1]
  width = _next_power_of_two(row_length)
  block_rows = rows_per_program(row_length, num_rows)
  padded_rows = -(-num_rows // block_rows) * block_rows
  out_width = _next_power_of_two(max(rounds, history_length))
  # Index -1 never matches a column, so padded history slots add nothing.
  history_indices = _pad_history(history_indices.astype(jnp.int32),
                                 padded_rows, out_width, -1)
  decayed_history = _pad_history(decayed_history, padded_rows, out_width, 0)
  kernel = functools.partial(
      _select_kernel, num_rows=num_rows, row_length=row_length,
      history_length=history_length, rounds=rounds)
  row_block = lambda i: (i, 0)
  history_spec = pl.BlockSpec((block_rows, out_width), row_block)
  top_values, top_indices, row_finite = pl.pallas_call(
      kernel,
      out_shape=(
          jax.ShapeDtypeStruct((padded_rows, out_width), jnp.float32),
          jax.ShapeDtypeStruct((padded_rows, out_width), jnp.int32),
          jax.ShapeDtypeStruct((padded_rows,), jnp.int32)),
      grid=(padded_rows // block_rows,),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,)),
                pl.BlockSpec((block_rows, width), row_block),
                history_spec, history_spec],
      out_specs=(history_spec, history_spec,
                 pl.BlockSpec((block_rows,), lambda i: (i,))),
      compiler_params=plgpu.CompilerParams(
          num_warps=4 if block_rows * width <= 2048 else 8, num_stages=1),
      interpret=interpret,
      name='taco_column_step',
  )(one_minus_mu.reshape(1), grads, history_indices, decayed_history)
  finite = jnp.all(row_finite[:num_rows] != 0)
  return (top_values[:num_rows, :rounds], top_indices[:num_rows, :rounds],
          finite)


def pallas_column_step(grad_rows: jax.Array, values: jax.Array,
                       indices: jax.Array, exponents: jax.Array,
                       mu: Union[float, jax.Array], update_topk: int, *,
                       interpret: bool = False) -> reference.ColumnStep:
  """One TACO step on rows with the Pallas kernel.

  Same arguments and results as
  :func:`reference.reference_column_step` (single device), for
  the inputs :func:`supports` accepts with rows of at most
  :data:`MAX_ROW_LENGTH` and a ``mu`` whose ``1 - mu`` XLA does not fold away
  (``dispatch`` chooses the reference otherwise; this function never does).

  Args:
    grad_rows, values, indices, exponents, mu, update_topk: as for the
      reference (float32 or bfloat16 gradients; int32 or int16 indices).
    interpret: run the kernel in Pallas interpret mode (any backend, slow);
      without it the kernel needs a GPU with Triton.

  Returns:
    A :class:`reference.ColumnStep`.

  Raises:
    ValueError: for inputs :func:`supports` rejects.
  """
  if not supports(grad_rows, values, indices, update_topk):
    raise ValueError(
        'The TACO Pallas kernel takes (N, m) f32/bf16 gradients and an (N, k) '
        'history with int32/int16 indices, 1 <= update_topk <= k <= m; got '
        f'{grad_rows.shape} {grad_rows.dtype}, {values.shape} {values.dtype}, '
        f'{indices.dtype}, update_topk={update_topk}.')
  if grad_rows.shape[1] > MAX_ROW_LENGTH:
    raise ValueError(
        f'The TACO Pallas kernel holds rows of at most {MAX_ROW_LENGTH} in '
        f'registers; got rows of {grad_rows.shape[1]}.')
  k = values.shape[1]
  # The reference's arithmetic: for a Python float, 1 - mu is formed in
  # float64 and rounded once to float32 (weak typing), and mu * M likewise.
  one_minus_mu = jnp.asarray(1 - mu, jnp.float32)
  previous = codec.decode_history(values, exponents)
  decayed = jnp.asarray(mu, jnp.float32) * previous
  top_values, top_indices, finite = _select(
      grad_rows, indices, decayed, one_minus_mu, rounds=k,
      interpret=interpret)
  return reference.step_from_top_k(top_values, top_indices, finite,
                                      values, indices, exponents, update_topk)
