"""``trace_dimension_numbers``: TACO's axes read from the computation itself.

Any JAX model, whatever library built it: trace the loss (or the forward)
with ``jax.make_jaxpr`` and read how each parameter is used
(:mod:`trace_walk`). Each leaf's uses decide its entry:

==========================================  ==================================
rank < 2, or not floating point              ``None`` (Adam)
``dot_general`` uses that agree              their axes (TACO)
looked up by rows (``table[ids]``,           vocabulary rows as the output
``jnp.take``), alone or also in agreeing     axis, features the reduction axis;
dots (tied logits ``h @ table.T``)           update scale 1 (the paper's)
only elementwise uses or reductions          Adam (a bias, a scale)
a convolution                                Adam (no TACO rule)
two orientations, weight x weight, an        ambiguous: Adam unless an
opaque kernel (``pallas_call``, FFI), a      override says the axes
reshape that mixes a used axis
no use at all                                refused: one error naming them
==========================================  ==================================

jaxpr internals are not a stable API; the trace reads primitive names
(``dot_general``, ``ragged_dot_general``, ``gather``, ``dynamic_slice``,
``transpose``, ``reshape``, ``broadcast_in_dim``, ``squeeze``,
``all_gather``, ``jit``, ``remat2``, ``custom_vjp_call``,
``custom_jvp_call``, ``scan``, ``cond``, ``while``, ``shard_map``,
``conv_general_dilated``, ``pallas_call``, ``ffi_call``), their parameters
(dimension numbers, ``permutation``, ``num_consts``, ...), ``jnp.einsum``'s
transpose after its ``dot_general``, and ``jax.extend.core``'s ``Literal``
and ``DropVar``. ``tests/test_trace_routing.py`` pins each, and fails on a
jax that changes them.
"""

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from taco_optax._src.routing import dimension_numbers as dn
from taco_optax._src.routing import overrides as overrides_lib
from taco_optax._src.routing import trace_errors
from taco_optax._src.routing import trace_uses
from taco_optax._src.routing import trace_views
from taco_optax._src.routing import trace_walk

TABLE_SCALE = 1.0  # the paper's update scale for a token table


class TracedLeaf(NamedTuple):
  """One parameter leaf in a :class:`TraceReport`.

  Attributes:
    path: ``'/'``-joined key path.
    shape: the leaf's shape.
    dtype: its dtype's name.
    decision: ``'taco'``, ``'table'`` (TACO, scale 1), ``'adam'``,
      ``'ambiguous'`` (Adam unless overridden) or ``'override'``.
    entry: its dimension-numbers entry (decided dims or ``ToAdam``).
    how: the rule that decided it, or why it could not be decided.
  """
  path: str
  shape: tuple[int, ...]
  dtype: str
  decision: str
  entry: Any
  how: str


class TraceReport(NamedTuple):
  """Every leaf's decision; ``print(report)`` gives a table."""
  rows: tuple[TracedLeaf, ...]
  treedef: Any

  @property
  def ambiguous(self) -> tuple[str, ...]:
    """The paths no reading decided (sent to Adam), to override."""
    return tuple(row.path for row in self.rows if row.decision == 'ambiguous')

  def update_scales(self) -> Any:
    """TACO's ``update_scale`` tree: ``1.0`` for tables, ``None`` else."""
    return self.treedef.unflatten(
        [TABLE_SCALE if row.decision == 'table' else None
         for row in self.rows])

  def __getitem__(self, path):
    if isinstance(path, str):
      for row in self.rows:
        if row.path == path:
          return row
      raise KeyError(path)
    return tuple.__getitem__(self, path)

  def __str__(self) -> str:
    table = [('path', 'shape', 'decision', 'how')] + [
        (row.path, str(row.shape), row.decision, row.how)
        for row in self.rows]
    widths = [max(len(line[i]) for line in table) for i in range(3)]
    lines = [f'trace_dimension_numbers: {len(self.rows)} leaves, '
             f'{sum(r.decision in ("taco", "table") for r in self.rows)} '
             f'to TACO, {len(self.ambiguous)} ambiguous (sent to Adam unless '
             'overridden)']
    lines += ['  '.join(cell.ljust(w) for cell, w in zip(line, widths))
              + '  ' + line[3] for line in table]
    return '\n'.join(line.rstrip() for line in lines)


def _flat_params(params: Any) -> tuple[list[Any], list[str], Any]:
  """The array leaves, their paths and the tree (with a Variable holding
  one ``value``, as Flax NNX's, a leaf of it)."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=_holds_one_value)
  leaves = [jax.tree.leaves(leaf)[0] if _holds_one_value(leaf) else leaf
            for _, leaf in pairs]
  return leaves, [dn.path_name(path) for path, _ in pairs], treedef


def _holds_one_value(node: Any) -> bool:
  """A node of one array child at ``.value`` (an ``nnx.Variable``)."""
  if isinstance(node, (dict, list, tuple)) or node is None or _is_array(node):
    return False
  children, _ = jax.tree_util.tree_flatten_with_path(
      node, is_leaf=lambda child: child is not node)
  if len(children) != 1:
    return False
  (path, child), = children
  return (len(path) == 1 and isinstance(path[0], jax.tree_util.GetAttrKey)
          and path[0].name == 'value' and _is_array(child))


def _is_array(x: Any) -> bool:
  return hasattr(x, 'shape') and hasattr(x, 'dtype')


def _jaxpr(fn: Callable, leaves: list[Any], treedef: Any, args: tuple,
           kwargs: dict, names: list[str]) -> Any:
  """``fn(params, *args, **kwargs)`` traced with the array leaves of the
  arguments as inputs (others are static), parameters first."""
  inputs, inputs_def = jax.tree.flatten((args, kwargs))
  traced = [x for x in inputs if _is_array(x)]
  tracers = {}  # id of each parameter's tracer: its index, for errors

  def traceable(params_leaves, args_leaves):
    tracers.update({id(x): i for i, x in enumerate(params_leaves)})
    given = iter(args_leaves)
    a, kw = inputs_def.unflatten(
        [next(given) if _is_array(x) else x for x in inputs])
    return fn(treedef.unflatten(params_leaves), *a, **kw)

  try:
    return jax.make_jaxpr(traceable)(leaves, traced)
  except Exception as error:  # pylint: disable=broad-exception-caught
    raise ValueError(trace_errors.trace_failed(error, tracers, names)
                     ) from error


def _is_matrix(leaf: Any) -> bool:
  return jnp.ndim(leaf) >= 2 and jnp.issubdtype(leaf.dtype, jnp.floating)


def _combined(uses: Sequence[trace_uses.Use], leaf: Any
              ) -> tuple[str, Any, str]:
  """``(decision, entry, how)`` of a leaf from its uses."""
  if not _is_matrix(leaf):
    why = (f'rank {jnp.ndim(leaf)}' if jnp.ndim(leaf) < 2
           else f'{jnp.dtype(leaf.dtype).name}, not floating point')
    return 'adam', dn.ToAdam(f'trace: {why}'), why
  by_kind: dict[str, Any] = {}
  for use in uses:
    by_kind.setdefault(use.kind, []).append(use)
  for kind in (trace_uses.CONVOLUTION, trace_uses.AMBIGUOUS):
    if kind in by_kind:
      how = _unique(u.how for u in by_kind[kind])
      return _adam(kind, how)
  matrix = by_kind.get(trace_uses.MATRIX, [])
  # Rows picked at a traced index count as a lookup if nothing else reads.
  table = by_kind.get(trace_uses.TABLE, []) or (
      [] if matrix else by_kind.get(trace_uses.ROW, []))
  axes = matrix + table
  readings = {(u.reduction, u.output) for u in axes}
  if len(readings) > 1:
    return _adam('ambiguous', 'used in two orientations: '
                 + _unique(u.how for u in axes))
  if readings:
    (reduction, output), = readings
    dims = dn.TacoDimensionNumbers(_int_or_tuple(reduction),
                                   _int_or_tuple(output))
    how = _unique(u.how for u in axes)
    batch = [a for a in range(jnp.ndim(leaf))
             if a not in reduction + output]
    if batch:
      how += f'; batch axes {tuple(batch)}'
    if not table:
      return 'taco', dn.decided(dims, f'trace: {how}'), how
    if matrix:
      how = f'a tied table (lookup and logits agree: vocabulary rows): {how}'
    return 'table', dn.decided(dims, f'trace: {how}'), how
  how = 'used only elementwise or reduced (' + _unique(
      u.how for u in by_kind.get(trace_uses.ELEMENTWISE, [])) + ')'
  return 'adam', dn.ToAdam(f'trace: {how}'), how


def _adam(kind: str, how: str) -> tuple[str, Any, str]:
  if kind == trace_uses.CONVOLUTION:
    return 'adam', dn.ToAdam(f'trace: {how}'), how
  how += '; sent to Adam unless an override says its axes'
  return 'ambiguous', dn.ToAdam(f'trace: ambiguous, {how}'), how


def _unique(texts) -> str:
  return '; '.join(dict.fromkeys(texts))


def _int_or_tuple(axes: tuple[int, ...]) -> Any:
  return axes[0] if len(axes) == 1 else axes


def _overridden(names: list[str], leaves: list[Any],
                overrides: Mapping[str, Any]) -> dict[int, TracedLeaf]:
  """The rows of the leaves an override pattern names (first match wins)."""
  rows, used = {}, set()
  for index, (name, leaf) in enumerate(zip(names, leaves)):
    pattern = overrides_lib.matching(name, overrides)
    if pattern is not None:
      used.add(pattern)
      rows[index] = _override_row(name, leaf, pattern, overrides[pattern])
  unused = [pattern for pattern in overrides if pattern not in used]
  if unused:
    raise ValueError(f'trace_dimension_numbers: these override patterns '
                     f'match no parameter: {unused} (paths are like '
                     f'{names[:3]}).')
  return rows


def _override_row(name: str, leaf: Any, pattern: str, value: Any
                  ) -> TracedLeaf:
  shape = tuple(jnp.shape(leaf))
  if value is not None and not isinstance(value, dn.ToAdam):
    try:
      dn.normalize_axes(shape, value)
    except ValueError as error:
      raise ValueError(f'trace_dimension_numbers: override {pattern!r} for '
                       f'{name}: {error}') from None
  entry = overrides_lib.override_entry(pattern, value)
  return TracedLeaf(name, shape, jnp.dtype(leaf.dtype).name, 'override',
                    entry, dn.source_of(entry) or '')


def trace_dimension_numbers(
    fn: Callable[..., Any], params: Any, *args: Any,
    overrides: Optional[Mapping[str, Optional[dn.TacoDimensionNumbers]]] = None,
    **kwargs: Any) -> tuple[Any, TraceReport]:
  """TACO's ``weight_dimension_numbers`` read from how ``fn`` uses ``params``.

  Traces ``fn(params, *args, **kwargs)`` (a loss or a forward; nothing is
  compiled or run) and reads each parameter's use in the jaxpr: the
  ``dot_general`` that consumes it (its contracting axes are the reduction
  axes, its free axes the output axes, its batch axes batch axes), followed
  through casts, transposes, merging and splitting reshapes, slices,
  ``jit``, ``remat``, ``custom_vjp``/``custom_jvp``, ``scan`` (a scanned
  leading axis is a batch axis: each layer its own matrix), ``cond``,
  ``while`` and ``shard_map``. A table looked up by rows (``table[ids]``)
  has the vocabulary as its rows (output axis) and update scale 1; tied to
  the logits (``h @ table.T``) it contracts its features, which agrees. A
  free axis that the result puts in front of the input's axes
  (``einsum('BTD,SNDH->SBTNH')``: ``q, k, v = out``) is a batch axis, as
  :func:`taco_optax.nnx.dimension_numbers` reads the einsum. A leaf used in
  two orientations, multiplied by another weight (LoRA's ``A @ B``), or fed
  to an opaque kernel (``pallas_call``, FFI) is ambiguous: it goes to Adam
  unless ``overrides`` says its axes; a convolution's kernel, a leaf used
  only elementwise (a bias) and vectors go to Adam.

  Args:
    fn: called as ``fn(params, *args, **kwargs)``: the loss or the forward,
      not its gradient (the backward pass multiplies each kernel the other
      way round). Array leaves of ``args`` and ``kwargs`` are traced
      (concrete or ``jax.ShapeDtypeStruct``), other leaves passed as they
      are (static).
    params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``; Flax
      NNX Variables are read through).
    *args: the rest of ``fn``'s arguments (a batch).
    overrides: ``{pattern: TacoDimensionNumbers or None}``; a leaf whose
      ``'/'``-joined path matches a pattern (``fnmatch``) gets the first
      match's value. Every pattern must match a leaf.
    **kwargs: keyword arguments of ``fn``.

  Returns:
    ``(dimension_numbers, report)``: a tree like ``params`` of decided
    :class:`TacoDimensionNumbers` or ``ToAdam`` entries (equal to ``None``),
    for ``taco(weight_dimension_numbers=...)``; and a :class:`TraceReport`
    (``print`` it; ``report.update_scales()`` for ``taco(update_scale=...)``).

  Raises:
    ValueError: if ``fn`` does not trace with these arguments (the error
      chains jax's), if a matrix leaf is not used by ``fn`` at all (naming
      every such path), or if an override matches nothing.

  Examples:
    >>> import jax.numpy as jnp
    >>> import taco_optax
    >>> from taco_optax import trace_dimension_numbers
    >>> params = {'w': jnp.ones((4, 3)), 'b': jnp.zeros(3)}
    >>> dims, report = trace_dimension_numbers(
    ...     lambda p, x: x @ p['w'] + p['b'], params, jnp.ones((2, 4)))
    >>> dims['w']
    TacoDimensionNumbers(reduction_axis=0, output_axis=1)
  """
  leaves, names, treedef = _flat_params(params)
  closed = _jaxpr(fn, leaves, treedef, args, dict(kwargs), names)
  fixed = _overridden(names, leaves, dict(overrides or {}))
  count = len(closed.jaxpr.invars)
  inputs = [trace_uses.Value((trace_views.whole(i, jnp.ndim(leaf)),))
            for i, leaf in enumerate(leaves)]
  inputs += [trace_uses.Value(data=True)] * (count - len(leaves))
  _, found = trace_walk.walk(closed, inputs, names)
  uses: list[list[Any]] = [[] for _ in leaves]
  for index, use in found:
    uses[index].append(use)
  rows, unused = [], []
  for index, (name, leaf) in enumerate(zip(names, leaves)):
    if index in fixed:
      rows.append(fixed[index])
      continue
    decision, entry, how = _combined(uses[index], leaf)
    if not uses[index] and _is_matrix(leaf):
      unused.append((name, tuple(jnp.shape(leaf))))
    rows.append(TracedLeaf(name, tuple(jnp.shape(leaf)),
                           jnp.dtype(leaf.dtype).name, decision, entry, how))
  if unused:
    raise ValueError(trace_errors.unused(unused))
  report = TraceReport(tuple(rows), treedef)
  return treedef.unflatten([row.entry for row in rows]), report
