"""Which axes of a parameter form TACO's matrix, and how to reshape to it.

TACO works on matrices laid out as in Flax, ``x @ W = y``: the *reduction*
axes index the paper's columns (``n`` of them, one per input feature) and the
*output* axes index the paper's rows (``m`` of them). Every other axis is a
batch axis: each slice along it is an independent matrix (a scanned layer
axis, or the ``3`` of a fused QKV kernel reshaped to ``(d, 3, d)``).
"""

import math
import re
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union, cast

import jax
import jax.numpy as jnp

from taco_optax._src.routing import trees

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


class _Decided(TacoDimensionNumbers):
  """:class:`TacoDimensionNumbers` that also say which rule chose them.

  Equal to (and printed as) the plain dimension numbers; only
  :func:`source_of` (hence :func:`taco_optax.routing_report`) reads
  ``source``. A pytree node of the two axes with ``source`` as its static
  data, so jax's tree functions, ``copy`` and ``pickle`` keep it.
  """
  source: str

  def __new__(cls, reduction_axis: Axes, output_axis: Axes, source: str):
    entry = super().__new__(cls, reduction_axis, output_axis)
    entry.source = str(source)
    return entry

  def __getnewargs__(self):  # copy and pickle rebuild it with its source
    return (*self, self.source)

  def _replace(self, **changes: Any) -> '_Decided':
    return _Decided(*TacoDimensionNumbers(*self)._replace(**changes),
                    self.source)

  def __repr__(self) -> str:
    return TacoDimensionNumbers.__repr__(TacoDimensionNumbers(*self))

  def __matmul__(self, other: Any):
    # A helper's tree of Equinox modules is callable, so
    # optax.inject_hyperparams calls it as a schedule unless it is in
    # static_args; a Linear then multiplies this entry by the step count.
    raise TypeError(SCHEDULED_MODULES)

  __rmatmul__ = __matmul__


# Registered ahead of jax's NamedTuple rule, which would rebuild an entry from
# its two axes alone and drop the source.
def _flatten_decided(entry: _Decided) -> tuple[tuple[Any, ...], str]:
  return tuple(entry), entry.source


def _unflatten_decided(source: str, axes: Sequence[Any]) -> _Decided:
  reduction_axis, output_axis = axes
  return _Decided(reduction_axis, output_axis, source)


jax.tree_util.register_pytree_node(_Decided, _flatten_decided,
                                   _unflatten_decided)


SCHEDULED_MODULES = (
    'A routing tree of Equinox modules (taco_optax.equinox.'
    'dimension_numbers(model)) was called as a function: '
    'optax.inject_hyperparams calls every callable argument not in '
    'static_args as a schedule of the step count, and a module is callable. '
    "Add it to static_args: optax.inject_hyperparams(taco_optax.taco, "
    "static_args=('weight_dimension_numbers', 'update_scale')).")


class ToAdam:
  """A dimension-numbers entry that sends its leaf to Adam, saying why.

  Means what ``None`` means (it is falsy, and every reader of an entry takes
  it as ``None``; it is not equal to ``None``), with the reason a routing
  helper found (``'eqx.nn.Conv2d: no TACO rule'``) for
  :func:`taco_optax.routing_report`. A tree leaf, not a node.
  """
  __slots__ = ('reason',)

  def __init__(self, reason: str):
    self.reason = str(reason)

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, ToAdam) and other.reason == self.reason

  def __hash__(self) -> int:
    return hash((ToAdam, self.reason))

  def __bool__(self) -> bool:
    return False

  def __repr__(self) -> str:
    return f'ToAdam({self.reason!r})'


def decided(dims: TacoDimensionNumbers, source: str) -> TacoDimensionNumbers:
  """``dims``, carrying ``source`` (the rule that chose them) for the
  routing report."""
  return _Decided(*dims, source)


def source_of(entry: Any) -> Optional[str]:
  """Which rule chose a dimension-numbers entry, if it says so."""
  if isinstance(entry, ToAdam):
    return entry.reason
  return getattr(entry, 'source', None)


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
    coords: list[Any] = [None] * len(shape)
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


def is_tree_of(x: Any, is_value: Callable[[Any], bool]) -> bool:
  """Whether ``x`` is a tree of settings rather than a function of params.

  A tree whose every leaf (``is_value`` stopping the walk) is a value is a
  tree, even when it is callable: a tree of Equinox modules holding
  dimension numbers is an ``eqx.Module``, hence callable. A callable with no
  such leaves (a function, a ``jax.tree_util.Partial`` of one) is a function.
  """
  if not callable(x) or is_value(x):
    return True
  leaves = jax.tree.leaves(x, is_leaf=is_value)
  return bool(leaves) and all(is_value(leaf) for leaf in leaves)


def resolve(weight_dimension_numbers: WeightDimNumOrFn | None, tree: Any
            ) -> Any:
  """Returns the dimension-numbers tree (a prefix of ``tree``)."""
  if weight_dimension_numbers is None:
    return jax.tree.map(lambda _: TacoDimensionNumbers(), tree)
  if not is_tree_of(weight_dimension_numbers, is_prefix_leaf):
    return cast(Callable[[Any], Any], weight_dimension_numbers)(tree)
  return weight_dimension_numbers


# Last path entries that name a bias or a scale; and words of a norm module.
_NOT_MATRIX_NAMES = frozenset((
    'b', 'bias', 'biases', 'scale', 'scales', 'gamma', 'beta'))
_NORM_WORD = re.compile(r'(.*norm|ln[0-9]*)$')
_TABLE_WORDS = frozenset(('wte', 'wpe'))


def _words(name: str) -> list[str]:
  return [w for w in re.split(r'[^0-9a-z]+', name.lower()) if w]


def names_not_matrix(path: str) -> bool:
  """Whether a '/'-joined path names a bias, a scale or a norm: its last
  entry is ``bias``, ``scale``, ... or has the word ``bias`` (``q_bias``), or
  an entry has a norm's word (``input_layernorm``, ``ln_1``). ``lora_b`` is
  a matrix."""
  entries = path.split('/')
  last = entries[-1].lower()
  return (last in _NOT_MATRIX_NAMES
          or any(w in ('bias', 'biases') for w in _words(last))
          or any(_NORM_WORD.match(w) for e in entries for w in _words(e)))


def names_table(path: str) -> bool:
  """Whether a path names an embedding table (``tok_embeddings``, ``wte``)."""
  return any(w in _TABLE_WORDS or w.startswith('embed')
             for e in path.split('/') for w in _words(e))


DEFAULT_SOURCE = 'default: rank 2, a Flax (in, out) kernel'


def rank2_matrices(params: Any) -> Any:
  """:func:`taco`'s default: every rank-2 leaf is a Flax ``(in, out)``
  kernel, but for those whose path names a bias, a scale or a norm (Adam)."""

  def route(path, x):
    if jnp.ndim(x) != 2:
      return None
    name = path_name(path)
    if names_not_matrix(name):
      return ToAdam('default: rank 2, but named like a bias, scale or norm')
    return decided(TacoDimensionNumbers(), DEFAULT_SOURCE)

  return jax.tree_util.tree_map_with_path(route, params)


def is_prefix_leaf(x: Any) -> bool:
  """The values of a dimension-numbers tree: entries, ``None``, masked."""
  return (x is None or is_dimension_numbers(x) or isinstance(x, ToAdam)
          or trees.is_masked(x))


def leaf_dimension_numbers(weight_dimension_numbers: WeightDimNumOrFn | None,
                           tree: Any) -> list[TacoDimensionNumbers | None]:
  """The (prefix) dimension numbers broadcast to one entry per leaf of tree.

  ``None`` entries mean "not a TACO leaf" (:class:`ToAdam` entries become
  ``None``). Masked leaves (:class:`optax.MaskedNode`) have no leaves and so
  get no entry.
  """
  return entries(resolve(weight_dimension_numbers, tree), tree)


def entries(dims_tree: Any, tree: Any, *, reasons: bool = False
            ) -> list[Any]:
  """A resolved dimension-numbers tree's entry for every leaf of ``tree``;
  :class:`ToAdam` entries kept with ``reasons`` (for :func:`source_of`),
  else ``None``."""
  try:
    found = trees.per_leaf(dims_tree, tree, is_prefix_leaf)
  except (ValueError, TypeError) as error:
    raise ValueError(
        'weight_dimension_numbers does not fit the parameters: it must be a '
        'tree prefix of them (their keys, a TacoDimensionNumbers or None at '
        f'or above each leaf); {_unmatched(dims_tree, tree)}.') from error
  if reasons:
    return found
  return [None if isinstance(entry, ToAdam) else entry for entry in found]


def _unmatched(prefix: Any, tree: Any) -> str:
  """Which entries of ``prefix`` and leaves of ``tree`` miss each other."""
  names = lambda t, **kw: [path_name(p) for p, _ in
                           jax.tree_util.tree_leaves_with_path(t, **kw)]
  given = names(prefix, is_leaf=is_prefix_leaf)
  wanted = names(tree)
  covers = lambda g, w: not g or w == g or w.startswith(g + '/')
  extra = [g for g in given if not any(covers(g, w) for w in wanted)]
  missing = [w for w in wanted if not any(covers(g, w) for g in given)]
  if not extra and not missing:
    return 'their node types differ'
  return (f'entries for no parameter: {extra[:8]}; parameters without an '
          f'entry: {missing[:8]}')


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
