"""The uses of a parameter that the walk of a jaxpr records, in its axes.

A :class:`Use` is what one equation does with a view of a parameter
(:mod:`trace_views`): multiply it as a matrix (``dot_general``,
``ragged_dot``: its axes, read from the equation's dimension numbers), look
rows of it up (``gather``, a traced ``dynamic_slice``), or something no
single reading explains (ambiguous). The equations' parameters are read
through :mod:`jaxpr_internals`.
"""

from typing import Any, NamedTuple, Optional, Sequence

from taco_optax._src.routing import jaxpr_internals as jx
from taco_optax._src.routing import trace_views
from taco_optax._src.routing.trace_views import View

# Use kinds.
MATRIX = 'matrix'          # a dot_general: dims say the axes
TABLE = 'table'            # a gather by rows: dims say the axes
AMBIGUOUS = 'ambiguous'    # no single reading (weight x weight, opaque, ...)
CONVOLUTION = 'convolution'
ROW = 'row'                # a slice picked by a traced index: a table if
                           # nothing else reads the axes
ELEMENTWISE = 'elementwise'


class Value(NamedTuple):
  """What the walk knows of a traced value."""
  views: tuple[View, ...] = ()
  data: bool = False  # depends on the inputs other than the parameters


class Use(NamedTuple):
  """One use of a parameter: its kind, the axes it implies, and how."""
  kind: str
  how: str
  reduction: tuple[int, ...] = ()
  output: tuple[int, ...] = ()


Found = list[tuple[int, Use]]  # (parameter index, use)


def shape_of(var: Any) -> tuple[int, ...]:
  return tuple(getattr(var.aval, 'shape', ()))


def _permutation_after(var: Any, consumers: dict[Any, list[Any]]
                       ) -> Optional[tuple[int, ...]]:
  """The permutation of the transpose that alone reads ``var`` (through
  casts), as ``jnp.einsum`` emits after a ``dot_general``."""
  while True:
    readers = consumers.get(var, [])
    if len(readers) != 1 or readers[0] is None:
      return None
    name = jx.primitive(readers[0])
    if name == 'transpose':
      return jx.permutation(readers[0])
    if name not in ('convert_element_type', 'copy', 'copy_p'):
      return None
    var = readers[0].outvars[0]


def dot_uses(eqn: Any, ins: list[Value], names: Sequence[str],
             consumers: dict[Any, list[Any]]) -> Found:
  """The uses of the weights a ``dot_general`` multiplies (``consumers``:
  the equations reading each variable, for the transpose after it)."""
  permutation = _permutation_after(eqn.outvars[0], consumers)
  (contracting, batch) = jx.dot_dimension_numbers(eqn)
  ndims = [len(shape_of(v)) for v in eqn.invars[:2]]
  free = [[a for a in range(ndims[s])
           if a not in (*contracting[s], *batch[s])]
          for s in (0, 1)]
  # The product's axes: batch, then the lhs's free, then the rhs's free.
  starts = (len(batch[0]), len(batch[0]) + len(free[0]))
  found = []
  for side in (0, 1):
    other = ins[1 - side]
    for view in ins[side].views:
      if other.views:
        partners = ', '.join(sorted({names[v.leaf] for v in other.views}))
        found.append((view.leaf, Use(
            AMBIGUOUS, f'a weight-times-weight product (with {partners})')))
        continue
      positions = [starts[side] + k for k in range(len(free[side]))]
      inputs = [k for k in range(starts[1] + len(free[1]))
                if k not in positions]
      front = _in_front(positions, inputs, permutation)
      use = _matrix_use(
          view, contracting[side], batch[side],
          [a for a, p in zip(free[side], positions) if p not in front],
          [a for a, p in zip(free[side], positions) if p in front])
      pieces = _pieces_after(eqn.outvars[0], consumers,
                             [p for p in positions if p not in front])
      if use.kind == MATRIX and pieces > 1:
        use = Use(AMBIGUOUS, f'{use.how}, then splits that output axis into '
                  f'{pieces} pieces (a fused projection, e.g. PyTorch\'s '
                  f'(3 D, D) qkv): as one matrix, one weight per input would '
                  f'move across all {pieces}, at {pieces}x the scale. Store '
                  f'it as {pieces} matrices (a leading axis of {pieces}, a '
                  'batch axis), or override it to keep one matrix')
      found.append((view.leaf, use))
  return found


_PASSED_BEFORE_A_SPLIT = ('convert_element_type', 'copy', 'copy_p', 'add',
                          'add_any')


def _pieces_after(var: Any, consumers: dict[Any, list[Any]],
                  positions: Sequence[int]) -> int:
  """Into how many pieces the equations reading ``var`` (through casts)
  split it along one of the axes ``positions``: a ``split``, or only
  ``slice``s each taking part of the axis; 1 when they do not."""
  readers = consumers.get(var, [])
  # Through casts and a bias (same shape out: the axes stay where they are).
  while (len(readers) == 1 and readers[0] is not None
         and readers[0].primitive.name in _PASSED_BEFORE_A_SPLIT
         and shape_of(readers[0].outvars[0]) == shape_of(var)):
    var = readers[0].outvars[0]
    readers = consumers.get(var, [])
  if not readers or any(r is None for r in readers):
    return 1
  shape = shape_of(var)
  if len(readers) == 1 and readers[0].primitive.name == 'split':
    split = readers[0]
    if split.params['axis'] not in positions:
      return 1
    pieces = list(split.outvars)
  elif len(readers) < 2 or any(r.primitive.name != 'slice' for r in readers):
    return 1
  else:
    axes = [a for a in positions if all(
        r.params['limit_indices'][a] - r.params['start_indices'][a] < shape[a]
        for r in readers)]
    if not axes:
      return 1
    pieces = [r.outvars[0] for r in readers]
  return 1 if _rejoined(pieces, consumers) else len(pieces)


def _rejoined(pieces: list[Any], consumers: dict[Any, list[Any]],
              depth: int = 6) -> bool:
  """Whether a ``concatenate`` within ``depth`` equations reads two of the
  pieces: a rotation (RoPE's halves), not several projections."""
  reached: dict[int, set[int]] = {}
  for index, piece in enumerate(pieces):
    frontier, seen = [piece], set()
    for _ in range(depth):
      following = []
      for var in frontier:
        for eqn in consumers.get(var, []):
          if eqn is None or id(eqn) in seen:
            continue
          seen.add(id(eqn))
          if eqn.primitive.name == 'concatenate':
            reached.setdefault(id(eqn), set()).add(index)
          following.extend(eqn.outvars)
      frontier = following
  return any(len(indices) > 1 for indices in reached.values())


def ragged_uses(eqn: Any, ins: list[Value]) -> Found:
  """``ragged_dot`` of tokens by a stack of experts' weights: the experts'
  (group) axis is a batch axis, the rest read as in ``dot_general``."""
  contracting, batch, groups = jx.ragged_dot_axes(eqn)
  stacked = (*batch, *groups)
  ndim = len(shape_of(eqn.invars[1]))
  free = [a for a in range(ndim) if a not in (*contracting, *stacked)]
  if ins[0].views:
    why = ('a weight-times-weight ragged_dot' if ins[1].views
           else 'the ragged (token) operand of a ragged_dot')
    return [(v.leaf, Use(AMBIGUOUS, why)) for value in ins[:2]
            for v in value.views]
  return [(v.leaf, _matrix_use(v, contracting, stacked, free, [],
                               'ragged_dot')) for v in ins[1].views]


def _in_front(positions: list[int], inputs: list[int],
              permutation: Optional[tuple[int, ...]]) -> set[int]:
  """The weight's free positions that the transpose puts before all of the
  input's axes, when it puts others after (otherwise none)."""
  if permutation is None or not inputs:
    return set()
  final = {p: permutation.index(p) for p in range(len(permutation))}
  first_input = min(final[p] for p in inputs)
  front = {p for p in positions if final[p] < first_input}
  return front if len(front) < len(positions) else set()


def _matrix_use(view: View, contracting: Sequence[int],
                batch: Sequence[int], free: Sequence[int],
                front: Sequence[int], op: str = 'dot_general') -> Use:
  reduction = trace_views.spanned(view, contracting)
  output = trace_views.spanned(view, free)
  stacked = trace_views.spanned(view, list(batch) + list(front))
  how = f'{op} contracts axes {reduction}, keeps {output}'
  if front:
    how += (f', puts {trace_views.spanned(view, front)} in front of the '
            "input's axes (q, k, v = out: batch)")
  mixed = (set(reduction) & set(output)) | (
      set(stacked) & (set(reduction) | set(output)))
  if mixed:
    return Use(AMBIGUOUS, f'{how}: a reshape gives axes {sorted(mixed)} two '
               'roles')
  if not reduction:  # constant along what it meets: a scale
    return Use(ELEMENTWISE, f'{how}: contracts none of its axes')
  if not output:
    return Use(AMBIGUOUS, f'{how}: no output axis')
  return Use(MATRIX, how, reduction, output)


def lookups(eqn: Any, ins: list[Value]) -> Found:
  """The tables a ``gather`` looks rows up in."""
  return [(view.leaf, _lookup(eqn, view)) for view in ins[0].views]


def picked_rows(eqn: Any, ins: list[Value]) -> Found:
  """A ``dynamic_slice`` at a traced index: rows, should nothing else say
  the axes (a lookup traced one token at a time)."""
  found = []
  for view in ins[0].views:
    use = _rows(view, shape_of(eqn.invars[0]), jx.slice_sizes(eqn),
                (), 'dynamic_slice: a traced index picks rows', ROW)
    if use is not None:
      found.append((view.leaf, use))
  return found


def _lookup(eqn: Any, view: View) -> Use:
  """A gather: the axes it picks slices of (slice size below the axis's)
  are the rows (the vocabulary: output), the axes it keeps whole the
  features (reduction)."""
  use = _rows(view, shape_of(eqn.invars[0]), jx.slice_sizes(eqn),
              jx.gather_batching_dims(eqn), 'gather: a lookup of rows')
  return use or Use(AMBIGUOUS, 'gather: picks single entries, not rows')


def _rows(view: View, shape: Sequence[int], sizes: Sequence[int],
          batching: Sequence[int], how: str, kind: str = TABLE
          ) -> Optional[Use]:
  picked = [k for k in range(len(shape))
            if k not in batching and sizes[k] < shape[k]]
  whole = [k for k in range(len(shape))
           if k not in batching and sizes[k] == shape[k]]
  rows = trace_views.spanned(view, picked)
  features = trace_views.spanned(view, whole)
  if not rows or not features or set(rows) & set(features):
    return None
  return Use(kind, f'{how} along axes {rows} (vocabulary rows)',
             features, rows)
