"""``routing_report``: which leaves :func:`taco` sends where, and the bytes."""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from taco_optax._src import routing
from taco_optax._src.transform import parts as parts_lib


class LeafRoute(NamedTuple):
  """One parameter leaf in a :class:`RoutingReport`.

  Attributes:
    path: ``'/'``-joined key path (``'layers/0/attn/q_proj/w'``).
    shape: the leaf's shape.
    dtype: its dtype's name.
    route: ``'taco'`` or ``'adam'``.
    why: for Adam, the reason (``'vector'``, ``'rank 3, default routing'``,
      ...); for TACO the dimension numbers.
    matrices: independent matrices (the product of the batch axes); TACO only.
    m: rows per matrix (output axes); TACO only.
    n: columns per matrix (reduction axes); TACO only.
    k: history entries kept per column; TACO only.
    scale: the update scale ``s``; TACO only.
    state_bytes: the optimizer state this leaf holds in this optimizer.
    adamw_state_bytes: what ``optax.adamw`` allocates for it (two moments in
      the leaf's dtype).
  """
  path: str
  shape: tuple[int, ...]
  dtype: str
  route: str
  why: str
  matrices: Optional[int]
  m: Optional[int]
  n: Optional[int]
  k: Optional[int]
  scale: Optional[float]
  state_bytes: int
  adamw_state_bytes: int


class RoutingReport(NamedTuple):
  """Every leaf's route, and the state against AdamW's.

  ``print(report)`` gives a table. ``state_bytes`` and ``adamw_state_bytes``
  are the whole states (step counts included), from ``jax.eval_shape`` of the
  two ``init`` functions.
  """
  rows: tuple[LeafRoute, ...]
  state_bytes: int
  adamw_state_bytes: int

  @property
  def taco_rows(self) -> tuple[LeafRoute, ...]:
    return tuple(row for row in self.rows if row.route == 'taco')

  def __str__(self) -> str:
    taco_rows = self.taco_rows
    ratio = self.adamw_state_bytes / max(self.state_bytes, 1)
    lines = [
        f'TACO routing: {len(taco_rows)} of {len(self.rows)} leaves to TACO '
        f'({sum(_size(r.shape) for r in taco_rows):,} of '
        f'{sum(_size(r.shape) for r in self.rows):,} parameters), the rest '
        f'to Adam; optimizer state {self.state_bytes:,} B vs AdamW '
        f'{self.adamw_state_bytes:,} B ({ratio:.1f}x smaller)']
    table: list[tuple[str, ...]] = [('path', 'shape', 'dtype', 'route', 'm x n', 'state B each',
              'why')]
    for (path, *cells), count in _grouped(self.rows):
      table.append((path + (f' (x{count})' if count > 1 else ''), *cells))
    widths = [max(len(line[i]) for line in table) for i in range(6)]
    lines += ['  '.join(cell.ljust(w) for cell, w in zip(line, widths))
              + '  ' + line[6] for line in table]
    return '\n'.join(line.rstrip() for line in lines)


def _cells(row: LeafRoute) -> tuple[str, ...]:
  matrix = ('' if row.route != 'taco' else
            f'{row.matrices} x ' * ((row.matrices or 1) > 1)
            + f'{row.m} x {row.n}, k={row.k}, s={row.scale:.3g}')
  return (str(row.shape), row.dtype, row.route, matrix,
          f'{row.state_bytes:,}', row.why)


def _grouped(rows: tuple[LeafRoute, ...]) -> list[tuple[tuple[str, ...], int]]:
  """Rows alike but for layer numbers in their paths, as one ``*`` row."""
  groups: dict[tuple[str, ...], list[Any]] = {}
  for row in rows:
    path = '/'.join('*' if part.isdigit() else part
                    for part in row.path.split('/'))
    group = groups.setdefault((path,) + _cells(row), [row.path, 0])
    group[1] += 1
  return [((key[0] if count > 1 else first,) + key[1:], count)
          for key, (first, count) in groups.items()]


def _size(shape: tuple[int, ...]) -> int:
  size = 1
  for d in shape:
    size *= d
  return size


def _abstract(params: Any) -> Any:
  """``params`` as ShapeDtypeStructs, Variables (Flax NNX) unwrapped."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype),
                      routing.unboxed(params))


def _leaf_bytes(params: Any, *trees: Any) -> list[int]:
  """Bytes per leaf of ``params`` over state trees shaped like it."""
  treedef = jax.tree.structure(params)
  totals = [0] * treedef.num_leaves
  for tree in trees:
    for i, entry in enumerate(treedef.flatten_up_to(tree)):
      totals[i] += sum(x.size * x.dtype.itemsize
                       for x in jax.tree.leaves(entry))
  return totals


def _total_bytes(tree: Any) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _adam_why(leaf: jax.ShapeDtypeStruct, source: Optional[str],
              default_routing: bool, framework: str) -> str:
  if leaf.ndim < 2:
    return 'scalar' if leaf.ndim == 0 else 'vector'
  if source is not None:
    return source
  if default_routing:
    return (f'default: rank {leaf.ndim}, the default routes rank-2 leaves '
            f'only (give its axes: {routing.HELPERS[framework]})')
  return 'weight_dimension_numbers gives None'


def _taco_why(dims: routing.TacoDimensionNumbers) -> str:
  source = routing.source_of(dims)
  return _dims_text(dims) + ('' if source is None else f'; {source}')


def routing_report(tx: optax.GradientTransformation, params: Any
                   ) -> RoutingReport:
  """Which leaves ``tx = taco(...)`` updates with TACO, and their state.

  Args:
    tx: the transformation :func:`taco` returned (also wrapped by
      :func:`taco_optax.nnx.for_nnx_optimizer`); for an
      :func:`optax.inject_hyperparams` one, report the :func:`taco` built
      with the same routing arguments.
    params: the parameters (arrays, ``ShapeDtypeStruct`` or an
      ``nnx.state(model, nnx.Param)``); nothing is allocated.

  Returns:
    A :class:`RoutingReport`; ``print`` it for a table.

  Examples:
    >>> import jax.numpy as jnp, taco_optax
    >>> params = {'w': jnp.ones((64, 32)), 'b': jnp.ones((32,))}
    >>> report = taco_optax.routing_report(taco_optax.taco(1e-3), params)
    >>> [(row.path, row.route, row.m, row.n) for row in report.rows]
    [('b', 'adam', None, None), ('w', 'taco', 32, 64)]
    >>> print(report)  # doctest: +NORMALIZE_WHITESPACE
    TACO routing: 1 of 2 leaves to TACO (2,048 of 2,080 parameters), the rest
    to Adam; optimizer state 5,444 B vs AdamW 16,644 B (3.1x smaller)
    path  shape     dtype    route  m x n                 state B each  why
    b     (32,)     float32  adam                         256           vector
    w     (64, 32)  float32  taco   32 x 64, k=16, s=0.5  5,184         reduction (0,), output (1,); default: rank 2, a Flax (in, out) kernel
  """
  parts = parts_lib.parts_of(tx, user='routing_report')
  params = _abstract(params)
  state = jax.eval_shape(tx.init, params)
  states = parts_lib.taco_states(state)
  adam_moments = states.adam[0]
  ours = _leaf_bytes(params, *states.direction, adam_moments.mu,
                     adam_moments.nu)
  adamw_state = jax.eval_shape(optax.adamw(1e-3).init, params)
  theirs = _leaf_bytes(params, adamw_state[0].mu, adamw_state[0].nu)
  histories = jax.tree.structure(params).flatten_up_to(
      states.direction.indices)
  entries = routing.entries(parts.dimension_numbers(params), params,
                       reasons=True)
  framework = routing.framework_of(params)
  rows = []
  leaves = jax.tree_util.tree_leaves_with_path(params)
  for (path, leaf), plan, own, adamw, history, entry in zip(
      leaves, parts.plans(params), ours, theirs, histories, entries):
    common = dict(path=routing.path_name(path), shape=tuple(leaf.shape),
                  dtype=jnp.dtype(leaf.dtype).name, state_bytes=own,
                  adamw_state_bytes=adamw)
    if plan is None:
      rows.append(LeafRoute(route='adam',
                            why=_adam_why(leaf, routing.source_of(entry),
                                          parts.default_routing, framework),
                            matrices=None, m=None, n=None, k=None, scale=None,
                            **common))
      continue
    layout = plan.layout
    rows.append(LeafRoute(
        route='taco', why=_taco_why(entry),
        matrices=layout.num_matrices, m=layout.m, n=layout.n,
        k=history.shape[-2], scale=float(plan.scale), **common))
  return RoutingReport(tuple(rows), _total_bytes(state),
                       _total_bytes(adamw_state))


def _dims_text(dims: routing.TacoDimensionNumbers) -> str:
  return (f'reduction {routing.as_tuple(dims.reduction_axis)}, '
          f'output {routing.as_tuple(dims.output_axis)}')
