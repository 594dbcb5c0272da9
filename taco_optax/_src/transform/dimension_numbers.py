"""Which axes of a parameter form TACO's matrix, and how to reshape to it.

TACO works on matrices laid out as in Flax, ``x @ W = y``: the *reduction*
axes index the paper's columns (``n`` of them, one per input feature) and the
*output* axes index the paper's rows (``m`` of them). Every other axis is a
batch axis: each slice along it is an independent matrix (a scanned layer
axis, or the ``3`` of a fused QKV kernel reshaped to ``(d, 3, d)``).
"""

import math
from typing import Any, Callable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from taco_optax._src.transform import trees

Axes = Union[int, Sequence[int]]


class TacoDimensionNumbers(NamedTuple):
  """The reduction (column) and output (row) axes of a TACO parameter.

  Same meaning as :class:`optax.contrib.MuonDimensionNumbers`: for a kernel
  used as ``x @ W = y`` the first axis is the reduction axis and the second the
  output axis. Each field is an ``int`` or a tuple of ``int``; all remaining
  axes are batch axes, handled independently.

  Attributes:
    reduction_axis: axes whose product is ``n``, the number of columns.
    output_axis: axes whose product is ``m``, the number of rows; TACO's
      per-column top-k runs over these.
  """
  reduction_axis: Axes = 0
  output_axis: Axes = 1


WeightDimNumOrFn = Union[
    TacoDimensionNumbers, Any, Callable[[Any], Any]
]


def is_dimension_numbers(x: Any) -> bool:
  return isinstance(x, TacoDimensionNumbers)


def as_tuple(axes: Axes) -> tuple[int, ...]:
  return (axes,) if isinstance(axes, int) else tuple(axes)


def normalize_axes(shape: tuple[int, ...], dim_nums: TacoDimensionNumbers
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """Returns (batch, reduction, output) axes as non-negative ints, validated."""
  ndim = len(shape)
  if ndim < 2:
    raise ValueError(
        f'TACO requested on a rank-{ndim} leaf of shape {shape}; TACO needs a '
        'matrix (rank >= 2). Route vectors and scalars to another optimizer '
        '(taco() sends them to AdamW), or give this leaf None dimension '
        'numbers.')
  named = {}
  for field in ('reduction_axis', 'output_axis'):
    axes = as_tuple(getattr(dim_nums, field))
    if not axes:
      raise ValueError(f'{field} is empty in {dim_nums} for shape {shape}.')
    for ax in axes:
      if not -ndim <= ax < ndim:
        raise ValueError(
            f'{field}={getattr(dim_nums, field)} is out of range for a leaf of '
            f'shape {shape} (rank {ndim}).')
    normalized = tuple(ax % ndim for ax in axes)
    if len(set(normalized)) != len(normalized):
      raise ValueError(f'{field} repeats an axis in {dim_nums} for shape '
                       f'{shape}.')
    named[field] = normalized
  reduction, output = named['reduction_axis'], named['output_axis']
  if set(reduction) & set(output):
    raise ValueError(
        f'reduction_axis and output_axis overlap in {dim_nums} for shape '
        f'{shape} (normalized {reduction} and {output}).')
  batch = tuple(ax for ax in range(ndim) if ax not in reduction + output)
  return batch, reduction, output


class MatrixLayout(NamedTuple):
  """How a parameter maps to a stack of ``(n, m)`` matrices.

  Attributes:
    batch_shape: sizes of the batch axes, in the parameter's axis order.
    n: number of columns (product of the reduction axis sizes).
    m: number of rows (product of the output axis sizes).
    transpose: permutation that puts batch, reduction, output axes in order.
  """
  batch_shape: tuple[int, ...]
  n: int
  m: int
  transpose: tuple[int, ...]

  @property
  def num_matrices(self) -> int:
    return math.prod(self.batch_shape)

  def to_rows(self, x: jax.Array) -> jax.Array:
    """Reshapes ``x`` to ``(batch * n, m)``: one row per paper column."""
    return x.transpose(self.transpose).reshape(self.num_matrices * self.n,
                                               self.m)

  def element_coords(self, shape: tuple[int, ...], rows: jax.Array,
                     entries: jax.Array) -> list[jax.Array]:
    """Per axis of a parameter of ``shape``, the coordinate of entry
    ``entries`` of row ``rows`` of :meth:`to_rows` (negative entries are
    taken as 0)."""
    flat = rows.astype(jnp.int32) * self.m + entries
    permuted = jnp.unravel_index(jnp.maximum(flat, 0),
                                 tuple(shape[a] for a in self.transpose))
    coords = [None] * len(shape)
    for position, axis in zip(permuted, self.transpose):
      coords[axis] = position
    return coords

  def from_rows(self, rows: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :meth:`to_rows` for a parameter of shape ``shape``."""
    permuted = tuple(shape[ax] for ax in self.transpose)
    inverse = tuple(sorted(range(len(shape)), key=lambda i: self.transpose[i]))
    return rows.reshape(permuted).transpose(inverse)


def matrix_layout(shape: tuple[int, ...],
                  dim_nums: TacoDimensionNumbers) -> MatrixLayout:
  """Validates ``dim_nums`` against ``shape`` and returns the layout."""
  batch, reduction, output = normalize_axes(tuple(shape), dim_nums)
  sizes = lambda axes: tuple(shape[ax] for ax in axes)
  return MatrixLayout(
      batch_shape=sizes(batch),
      n=math.prod(sizes(reduction)),
      m=math.prod(sizes(output)),
      transpose=batch + reduction + output,
  )


def resolve(weight_dimension_numbers: WeightDimNumOrFn | None, tree: Any
            ) -> Any:
  """Returns the dimension-numbers tree (a prefix of ``tree``)."""
  if weight_dimension_numbers is None:
    return jax.tree.map(lambda _: TacoDimensionNumbers(), tree)
  if callable(weight_dimension_numbers) and not is_dimension_numbers(
      weight_dimension_numbers):
    return weight_dimension_numbers(tree)
  return weight_dimension_numbers


def rank2_matrices(params: Any) -> Any:
  """:func:`taco`'s default: every rank-2 leaf is a matrix, nothing else."""
  return jax.tree.map(
      lambda x: TacoDimensionNumbers() if x.ndim == 2 else None, params)


def is_prefix_leaf(x: Any) -> bool:
  """The values of a dimension-numbers tree: entries, ``None``, masked."""
  return (x is None or is_dimension_numbers(x)
          or trees.is_masked(x))


def leaf_dimension_numbers(weight_dimension_numbers: WeightDimNumOrFn | None,
                           tree: Any) -> list[TacoDimensionNumbers | None]:
  """The (prefix) dimension numbers broadcast to one entry per leaf of tree.

  ``None`` entries mean "not a TACO leaf". Masked leaves
  (:class:`optax.MaskedNode`) have no leaves and so get no entry.
  """
  return trees.per_leaf(resolve(weight_dimension_numbers, tree), tree,
                          is_prefix_leaf)


def path_name(path: tuple[Any, ...]) -> str:
  """``'layers/0/attn/q_proj/w'`` for a key path (a Variable's ``.value``
  entry left out, so pure and Variable states name leaves alike)."""
  names = []
  for entry in path:
    if isinstance(entry, jax.tree_util.GetAttrKey):
      if entry.name != 'value':
        names.append(entry.name)
    else:
      names.append(str(getattr(entry, 'key', getattr(entry, 'idx', entry))))
  return '/'.join(names)


def unrouted_by_default(params: Any) -> list[tuple[str, tuple[int, ...]]]:
  """Floating leaves of rank >= 3, which :func:`rank2_matrices` leaves out."""
  return [(path_name(path), tuple(x.shape))
          for path, x in jax.tree_util.tree_leaves_with_path(params)
          if jnp.ndim(x) >= 3 and jnp.issubdtype(x.dtype, jnp.floating)]
