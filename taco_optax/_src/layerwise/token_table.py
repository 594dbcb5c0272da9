"""A language model's token tables: read by a row lookup and a projection.

A decoder reads its ``[vocab, d]`` token table twice: ``embed`` looks rows up,
and the head projects the final states onto it (tied), or onto an untied
``[d, vocab]`` kernel. Left to ``jax.vjp`` both uses produce a dense
vocabulary-sized gradient, which the layer-wise step would hold through the
whole backward pass (``docs/measured/memory.md`` measures it). Written as
:class:`TableLookup` and :class:`TableProjection`, the step instead keeps each
use's small factors (the looked-up rows' cotangent; the features and the
logits' cotangent) and forms the table's gradient a block of columns at a
time, inside the column-block update (:class:`TableGradient`).

Both are plain callables with the signatures of ``LayeredLoss.embed`` and
``LayeredLoss.head``, so the plain ``jax.grad`` path computes the same loss.
"""

import dataclasses
import functools
import operator
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

Params = Any
Batch = Any
Path = tuple[Any, ...]
KeyPath = tuple[Any, ...]  # a jax key path


def table_at(outer: Params, path: Path) -> jax.Array:
  """The leaf of ``outer`` at ``path`` (dict keys, sequence indices)."""
  try:
    for key in path:
      outer = outer[key]
  except (KeyError, IndexError, TypeError):
    raise ValueError(f'no leaf at {path} among the outer parameters.') from None
  return outer


def table_path(outer: Params, path: Path) -> KeyPath:
  """The key path of ``path``'s leaf in ``outer`` (as
  ``jax.tree_util.tree_flatten_with_path`` names it)."""
  for key_path, _ in jax.tree_util.tree_flatten_with_path(outer)[0]:
    names = tuple(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))
                  for k in key_path)
    if names == tuple(path):
      return key_path
  raise ValueError(f'no leaf at {path} among the outer parameters.')


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """``table[ids]`` (rows; out-of-range ids give NaN rows, as ``jnp.take``)."""
  return jnp.take(table, ids, axis=0)


def project_rows(features: jax.Array, table: jax.Array) -> jax.Array:
  """float32 logits ``features . table[v]`` for every row ``v`` of ``table``."""
  return jnp.einsum('...d,vd->...v', features, table,
                    preferred_element_type=jnp.float32)


def project_columns(features: jax.Array, table: jax.Array) -> jax.Array:
  """float32 logits ``features @ table`` for a ``[d, vocab]`` kernel."""
  return jnp.einsum('...d,dv->...v', features, table,
                    preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class TableLookup:
  """``embed(outer, batch)`` that reads its table only as looked-up rows.

  Calling it returns ``apply(outer, gather(table, ids(batch)), batch)``.

  Attributes:
    table: path of the ``[vocab, d]`` table in ``outer``, e.g.
      ``('embed', 'embedding')``.
    ids: ``ids(batch) -> int array`` of the rows to look up.
    apply: ``apply(outer, rows, batch) -> hidden``: the rest of the embedding
      (a dtype cast, position embeddings); it must not read the table.
    gather: ``gather(table, ids) -> rows``: a row lookup, so that each column
      of ``rows`` depends only on the same column of ``table`` (default
      :func:`take_rows`; e.g. one that reshards on a mesh).
  """
  table: Path
  ids: Callable[[Batch], jax.Array]
  apply: Callable[[Params, jax.Array, Batch], Any]
  gather: Callable[[jax.Array, jax.Array], jax.Array] = take_rows

  def __call__(self, outer: Params, batch: Batch) -> Any:
    rows = self.gather(table_at(outer, self.table), self.ids(batch))
    return self.apply(outer, rows, batch)


@dataclasses.dataclass(frozen=True)
class TableProjection:
  """``head(outer, hidden, batch)`` that projects features onto a table.

  Calling it returns ``loss(project(features(outer, hidden, batch), table),
  batch)``.

  Attributes:
    table: path of the output table in ``outer``: the token embedding when
      tied (``[vocab, d]``), else the head's kernel.
    features: ``features(outer, hidden, batch) -> [..., d]``, e.g. the final
      norm (and the positions that are scored); it must not read the table.
    loss: ``loss(logits, batch) -> scalar``.
    project: ``project(features, table) -> logits``, a contraction of the
      features' last axis with the table's ``table_axis``; by default float32
      logits along ``table_axis`` (:func:`project_rows` for a ``[vocab, d]``
      table, :func:`project_columns` for a ``[d, vocab]`` kernel).
    table_axis: the table's ``d`` axis (1 for ``[vocab, d]``, 0 for a
      ``[d, vocab]`` kernel).
  """
  table: Path
  features: Callable[[Params, Any, Batch], jax.Array]
  loss: Callable[..., jax.Array]
  project: Optional[Callable[[jax.Array, jax.Array], jax.Array]] = None
  table_axis: int = 1

  def __post_init__(self):
    if self.table_axis not in (0, 1):
      raise ValueError('TableProjection.table_axis is the table\'s d axis: 1 '
                       'for a [vocab, d] table, 0 for a [d, vocab] kernel; '
                       f'got {self.table_axis!r}.')
    if self.project is None:
      object.__setattr__(self, 'project', project_rows if self.table_axis
                         else project_columns)

  def __call__(self, outer: Params, hidden: Any, batch: Batch) -> jax.Array:
    features = self.features(outer, hidden, batch)
    table = table_at(outer, self.table)
    check_projection(self, features, table)
    return self.loss(self.projection(features, table), batch)

  @property
  def projection(self) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``project``: the one given, or the default ``__post_init__`` set."""
    assert self.project is not None
    return self.project


def check_projection(head: TableProjection, features: jax.Array,
                     table: jax.Array) -> None:
  """Raises, naming ``table_axis`` and ``project``, when the features' width
  is not the table's ``d`` axis."""
  if table.ndim != 2 or features.shape[-1] != table.shape[head.table_axis]:
    raise ValueError(
        f'TableProjection: the features are {features.shape[-1]} wide but the '
        f'table {head.table} has shape {tuple(table.shape)}, whose '
        f'table_axis={head.table_axis} is {table.shape[head.table_axis]} '
        'long. table_axis is the table\'s d axis: 1 for a [vocab, d] table, '
        '0 for a [d, vocab] kernel; a project= of your own must contract the '
        'features with that axis.')


@dataclasses.dataclass(frozen=True)
class TableGradient:
  """A table's gradient as the sum of its linear uses' transposes.

  Each use is linear in the table and independent along ``axis`` (a lookup
  copies columns, a projection contracts them with the features' columns), so
  a block of columns of the gradient needs only that block of the table and
  of the factors: :meth:`columns`. :meth:`dense` is the whole gradient, the
  same operations as ``jax.vjp`` of the loss.

  Attributes:
    table: the table (its values are not read; only its shape and dtype).
    axis: the axis the uses are independent along.
    uses: ``use(start, size) -> (fn, cotangent)``: ``fn(table_block)`` is
      the use restricted to columns ``[start, start + size)`` along
      ``axis``, and ``cotangent`` the cotangent of its output.
    transform: an elementwise ``g -> g'`` applied to the summed gradient
      (e.g. global-norm clipping), or ``None``.
  """
  table: jax.Array
  axis: int
  uses: tuple[Callable[[Any, int], tuple[Callable, Any]], ...]
  transform: Optional[Callable[[jax.Array], jax.Array]] = None

  @property
  def shape(self) -> tuple[int, ...]:
    return self.table.shape

  @property
  def dtype(self):
    return self.table.dtype

  def columns(self, start: jax.Array, size: int) -> jax.Array:
    """The gradient's columns ``[start, start + size)`` along ``axis``, as
    ``(size, m)`` rows (the column step's layout: one row per column).

    Differentiated with respect to the block in that layout, so XLA computes
    each product in it too; transposing a gradient block computed in the
    table's layout made XLA copy the logits' cotangent, transposed, once.
    """
    block = jax.lax.dynamic_slice_in_dim(self.table, start, size, self.axis)
    if self.axis == 0:
      return self._sum(block, start, size)
    return self._sum(block.T, start, size, lambda rows: rows.T)

  def dense(self) -> jax.Array:
    """The whole gradient."""
    return self._sum(self.table, 0, self.table.shape[self.axis])

  def _sum(self, block, start, size, layout=lambda block: block):
    grads = []
    for use in self.uses:
      fn, cotangent = use(start, size)
      _, vjp = jax.vjp(lambda x, fn=fn: fn(layout(x)), block)
      grads.append(vjp(cotangent)[0])
    total = functools.reduce(operator.add, grads)
    return total if self.transform is None else self.transform(total)

  def plus(self, other: 'Optional[TableGradient]') -> 'TableGradient':
    """Both tables' uses (the same table, read twice: tied)."""
    if other is None:
      return self
    if other.axis != self.axis:
      raise ValueError('a table read along two different column axes.')
    return dataclasses.replace(self, uses=self.uses + other.uses)


def _columns(x, start, size, axis=-1):
  if isinstance(start, int) and start == 0 and size == x.shape[axis]:
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def lookup_gradient(lookup: TableLookup, table, ids, d_rows) -> TableGradient:
  """The lookup's share of the table's gradient, from the rows' cotangent."""
  def use(start, size):
    return (lambda block: lookup.gather(block, ids),
            _columns(d_rows, start, size))
  return TableGradient(table, 1, (use,))


def projection_gradient(head: TableProjection, table, features,
                        d_logits) -> TableGradient:
  """The projection's share of the table's gradient, from its factors.

  Blocks are formed from the factors flattened to ``[rows, d]`` and ``[rows,
  vocab]``: with the leading axes kept, XLA:CPU copied the logits' cotangent,
  transposed, in every block.
  """
  flat_features = features.reshape(-1, features.shape[-1])
  flat_d_logits = d_logits.reshape(flat_features.shape[0], -1)
  def use(start, size):
    if isinstance(start, int) and start == 0 and size == features.shape[-1]:
      return lambda block: head.projection(features, block), d_logits
    return (lambda block: head.projection(
        _columns(flat_features, start, size), block), flat_d_logits)
  return TableGradient(table, head.table_axis, (use,))


class ProjectionBackward(NamedTuple):
  """The head's backward pass (:func:`projection_backward`).

  Attributes:
    value: the loss.
    grads: the gradient of every other leaf of ``outer``, by key path.
    d_hidden: the cotangent of the head's ``hidden``.
    table: the table's key path in ``outer``.
    gradient: the table's :class:`TableGradient`.
    features: the projected features (the gradient's first factor).
    d_logits: the logits' cotangent (its second factor).
  """
  value: jax.Array
  grads: dict[KeyPath, Any]
  d_hidden: Any
  table: KeyPath
  gradient: TableGradient
  features: jax.Array
  d_logits: jax.Array


class LookupBackward(NamedTuple):
  """The embedding's backward pass (:func:`lookup_backward`).

  Attributes:
    grads: the gradient of every other leaf of ``outer``, by key path.
    table: the table's key path in ``outer``.
    ids: the looked-up ids.
    d_rows: the cotangent of the looked-up rows (:func:`lookup_gradient`
      forms the table's gradient from it).
  """
  grads: dict[KeyPath, Any]
  table: KeyPath
  ids: jax.Array
  d_rows: jax.Array


class _Split(NamedTuple):
  """``outer`` as its table and the other leaves (:func:`_split_table`)."""
  table_key: KeyPath
  table: jax.Array
  keys: list[KeyPath]  # the other leaves' key paths, in leaf order
  others: list[Any]
  rebuild: Callable[[list[Any]], Params]  # others -> outer with the table

  def keyed(self, grads: list[Any]) -> dict[KeyPath, Any]:
    return dict(zip(self.keys, grads))


def _split_table(outer: Params, path: Path) -> _Split:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(outer)
  table_key = table_path(outer, path)
  keys = [key for key, _ in leaves if key != table_key]
  table = next(x for key, x in leaves if key == table_key)

  def rebuild(rest):
    rest = iter(rest)
    return jax.tree.unflatten(treedef, [table if key == table_key
                                        else next(rest) for key, _ in leaves])
  return _Split(table_key, table, keys, [x for key, x in leaves
                                         if key != table_key], rebuild)


def projection_backward(head: TableProjection, outer: Params, hidden: Any,
                        batch: Batch) -> ProjectionBackward:
  """The head's value and backward pass, without the table's dense gradient.

  ``head.features`` must not read the table (the layer-wise step checks).
  """
  split = _split_table(outer, head.table)
  features = lambda rest, hidden: head.features(split.rebuild(rest), hidden,
                                                batch)
  feats, features_vjp = jax.vjp(features, split.others, hidden)
  check_projection(head, feats, split.table)
  logits, project_vjp = jax.vjp(lambda f: head.projection(f, split.table),
                                feats)
  value, loss_vjp = jax.vjp(lambda x: head.loss(x, batch), logits)
  (d_logits,) = loss_vjp(jnp.ones_like(value))
  (d_features,) = project_vjp(d_logits)
  grads, d_hidden = features_vjp(d_features)
  return ProjectionBackward(
      value=value, grads=split.keyed(grads), d_hidden=d_hidden,
      table=split.table_key,
      gradient=projection_gradient(head, split.table, feats, d_logits),
      features=feats, d_logits=d_logits)


def lookup_backward(lookup: TableLookup, outer: Params, batch: Batch
                    ) -> Callable[[Any], LookupBackward]:
  """The embedding's backward pass, without the table's dense gradient.

  ``lookup.apply`` must not read the table (the layer-wise step checks).

  Returns:
    ``backward(d_hidden) -> LookupBackward``.
  """
  split = _split_table(outer, lookup.table)
  ids = lookup.ids(batch)
  apply = lambda rest, rows: lookup.apply(split.rebuild(rest), rows, batch)
  _, apply_vjp = jax.vjp(apply, split.others, lookup.gather(split.table, ids))

  def backward(d_hidden):
    grads, d_rows = apply_vjp(d_hidden)
    return LookupBackward(split.keyed(grads), split.table_key, ids, d_rows)
  return backward
