"""Which axes of a parameter each axis of a traced value comes from.

:func:`taco_optax.trace_dimension_numbers` follows every parameter through
the jaxpr of a loss or a forward. A value that is the parameter moved about
without mixing in data (cast, transposed, reshaped, sliced, broadcast, or
combined elementwise with other weights and constants) is a *view* of it: a
:class:`View` says, per axis of the value, which of the parameter's axes it
spans. A merging reshape ``(N, H, D) -> (N*H, D)`` gives axis 0 both ``N``
and ``H``; a splitting one gives each piece the axis it came from; an axis a
slice or a squeeze removed (a scanned layer axis) is in no axis of the view,
so it is a batch axis of whatever uses the view.

The rules below read the parameters of jax's primitives
(``permutation``, ``broadcast_dimensions``, ``dimensions``, ...) through
:mod:`jaxpr_internals`.
"""

from typing import Any, NamedTuple, Optional, Sequence

from taco_optax._src.routing import jaxpr_internals as jx

Axes = tuple[int, ...]


class View(NamedTuple):
  """A traced value seen as (a piece of) parameter number ``leaf``.

  Attributes:
    leaf: the parameter's index among the flattened params.
    axes: per axis of the value, the parameter's axes it spans (``()`` for an
      axis that broadcasting added).
  """
  leaf: int
  axes: tuple[Axes, ...]


def whole(leaf: int, ndim: int) -> View:
  """The parameter itself: axis ``i`` is parameter axis ``i``."""
  return View(leaf, tuple((axis,) for axis in range(ndim)))


def spanned(view: View, positions: Sequence[int]) -> Axes:
  """The parameter axes spanned by the value axes at ``positions``, sorted."""
  return tuple(sorted({a for p in positions for a in view.axes[p]}))


def _transposed(view: View, permutation: Sequence[int]) -> View:
  return View(view.leaf, tuple(view.axes[p] for p in permutation))


def _blocks(in_shape: Sequence[int], out_shape: Sequence[int]
            ) -> Optional[list[tuple[list[int], list[int]]]]:
  """Groups of input and output axes of a reshape with equal products.

  Size-1 axes are left out; each group is the smallest run of axes whose
  sizes multiply to the same number (a merge, a split, or a mix).
  """
  ins = [k for k, size in enumerate(in_shape) if size != 1]
  outs = [k for k, size in enumerate(out_shape) if size != 1]
  blocks, a, b = [], 0, 0
  while a < len(ins) and b < len(outs):
    group_in, group_out = [ins[a]], [outs[b]]
    size_in, size_out = in_shape[ins[a]], out_shape[outs[b]]
    a, b = a + 1, b + 1
    while size_in != size_out:
      if size_in < size_out and a < len(ins):
        group_in.append(ins[a])
        size_in, a = size_in * in_shape[ins[a]], a + 1
      elif size_out < size_in and b < len(outs):
        group_out.append(outs[b])
        size_out, b = size_out * out_shape[outs[b]], b + 1
      else:
        return None
    blocks.append((group_in, group_out))
  if a != len(ins) or b != len(outs):
    return None
  return blocks


def _reshaped(view: View, in_shape: Sequence[int], out_shape: Sequence[int]
              ) -> Optional[View]:
  blocks = _blocks(in_shape, out_shape)
  if blocks is None:
    return None
  axes: list[tuple[int, ...]] = [()] * len(out_shape)
  for group_in, group_out in blocks:
    for position in group_out:
      axes[position] = spanned(view, group_in)
  return View(view.leaf, tuple(axes))


def _broadcast(view: View, in_shape: Sequence[int], out_shape: Sequence[int],
               dimensions: Sequence[int]) -> View:
  """A size-1 axis broadcast wider repeats one slice: it spans nothing."""
  axes: list[tuple[int, ...]] = [()] * len(out_shape)
  for axis, position in enumerate(dimensions):
    if in_shape[axis] == out_shape[position]:
      axes[position] = view.axes[axis]
  return View(view.leaf, tuple(axes))


def _squeezed(view: View, dimensions: Sequence[int]) -> View:
  ndim = len(view.axes)
  dropped = {d % ndim for d in dimensions}
  return View(view.leaf, tuple(a for k, a in enumerate(view.axes)
                               if k not in dropped))


def _inserted(view: View, position: int) -> View:
  axes = list(view.axes)
  axes.insert(position, ())
  return View(view.leaf, tuple(axes))


# Primitives whose result is their first operand, relabelled or cut: every
# axis stays where it was (sizes may shrink: a slice of a fused kernel).
SAME_AXES = frozenset((
    'convert_element_type', 'copy', 'copy_p', 'reduce_precision', 'slice',
    'dynamic_slice', 'rev', 'sharding_constraint', 'device_put', 'pvary',
    'pcast', 'mesh_cast', 'reshard', 'stop_gradient', 'auto_axes',
    'explicit_axes', 'pad'))
# Primitives that may return views of several operands (weights only).
JOINS = frozenset(('concatenate', 'optimization_barrier', 'split'))
STRUCTURAL = SAME_AXES | JOINS | frozenset((
    'transpose', 'reshape', 'broadcast_in_dim', 'squeeze', 'all_gather'))


def moved(eqn: Any, view: View, in_shape: Sequence[int],
          out_shape: Sequence[int]) -> Optional[View]:
  """The view that the structural equation ``eqn`` makes of its first
  operand's ``view``, or ``None`` where the axes cannot be followed (a
  reshape that mixes axes unevenly)."""
  name = jx.primitive(eqn)
  if name in SAME_AXES or name in JOINS:
    return view
  if name == 'transpose':
    return _transposed(view, jx.permutation(eqn))
  if name == 'reshape':
    return _reshaped(view, in_shape, out_shape)
  if name == 'broadcast_in_dim':
    return _broadcast(view, in_shape, out_shape,
                      jx.broadcast_dimensions(eqn))
  if name == 'squeeze':
    return _squeezed(view, jx.squeezed_dimensions(eqn))
  if name == 'all_gather':
    tiled, axis = jx.all_gather_axis(eqn)
    return view if tiled else _inserted(view, axis)
  raise KeyError(name)


def stacked(view: View) -> View:
  """``view`` stacked by a ``scan`` along a new leading axis."""
  return _inserted(view, 0)


def sliced(view: View) -> View:
  """``view`` with its leading axis taken away (a ``scan`` over it)."""
  return View(view.leaf, view.axes[1:])


def elementwise_views(in_views: Sequence[Sequence[View]],
                      in_shapes: Sequence[Sequence[int]],
                      out_shape: Sequence[int]) -> tuple[View, ...]:
  """The views an elementwise primitive passes on: those of its operands of
  the result's shape (a weight times a mask, a weight plus another)."""
  return tuple(view for views, shape in zip(in_views, in_shapes)
               if tuple(shape) == tuple(out_shape) for view in views)
