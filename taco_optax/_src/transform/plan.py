"""One TACO leaf's static plan: how a parameter maps to TACO's matrices.

A :class:`LeafPlan` says once a leaf's layout, dimension numbers, scale,
signs per column and implementation; :func:`leaf_plans` is the only place
they are derived, for the optax path (``scale``) and the layer-wise step
alike.
"""

import math
from typing import Any, Callable, NamedTuple, Optional, Union, cast

import jax
import jax.numpy as jnp
import optax

from taco_optax._src import routing
from taco_optax._src import sharding

ScaleTree = Union[float, None, Any]


class LeafPlan(NamedTuple):
  """How one TACO parameter leaf is updated (all static).

  Attributes:
    layout: the whole leaf's :class:`MatrixLayout`.
    dim_num: its :class:`TacoDimensionNumbers` (to re-derive the layout of one
      device's block on a mesh).
    scale: the update scale ``s`` (``m / n`` unless overridden).
    update_topk: signs per column, ``min(r, m)``.
    implementation: what runs the column step (``kernels.IMPLEMENTATIONS``,
      resolved).
  """
  layout: routing.MatrixLayout
  dim_num: routing.TacoDimensionNumbers
  scale: float
  update_topk: int
  implementation: str = 'auto'

  def axes(self, shape: tuple[int, ...]) -> sharding.LeafAxes:
    """The ``(batch, reduction, output)`` axes of this leaf (or a block of
    it) of ``shape``, normalised."""
    return routing.normalize_axes(shape, self.dim_num)

  def local_layout(self, shape: tuple[int, ...]) -> routing.MatrixLayout:
    """The layout of a block of this leaf of ``shape`` (e.g. one device's)."""
    return routing.matrix_layout(shape, self.dim_num)


def _is_scale_leaf(x: Any) -> bool:
  return x is None or isinstance(x, (int, float, optax.MaskedNode))


def leaf_scales(update_scale: ScaleTree, tree: Any) -> list[Optional[float]]:
  """``update_scale`` (a number, tree prefix or callable) for every leaf."""
  if not routing.is_tree_of(update_scale, _is_scale_leaf):
    update_scale = cast(Callable[[Any], Any], update_scale)(tree)
  return routing.per_leaf(update_scale, tree, _is_scale_leaf)


def _checked_scale(scale: Any, path: Any) -> Any:
  """``scale`` if it is a valid update scale; a negative or non-finite one
  (a negative scale turns every step into ascent) raises, naming the leaf."""
  if scale is None or isinstance(scale, jax.core.Tracer):
    return scale
  if not (math.isfinite(float(scale)) and float(scale) >= 0):
    raise ValueError(
        f'update_scale={scale} for the TACO leaf '
        f'{routing.path_name(path)!r}: an update scale must be finite and '
        '>= 0 (a negative one turns every step into ascent; 0 freezes the '
        'matrix). None means m / n.')
  return scale


def _default_scale(layout: routing.MatrixLayout) -> float:
  """``m / n``; 0 for a matrix without columns (it has nothing to update)."""
  return layout.m / layout.n if layout.n else 0.0


def leaf_plans(tree: Any,
               weight_dimension_numbers: routing.WeightDimNumOrFn | None,
               update_scale: ScaleTree, update_topk: int,
               implementation: str = 'auto') -> list[Optional[LeafPlan]]:
  """One :class:`LeafPlan` per leaf of ``tree`` (``None``: not a TACO leaf).

  Raises:
    ValueError: for invalid dimension numbers, or a complex-valued TACO leaf
      (the sign of a complex number is not ternary).
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  dims = routing.leaf_dimension_numbers(weight_dimension_numbers, tree)
  scales = leaf_scales(update_scale, tree)
  plans: list[Optional[LeafPlan]] = []
  for (path, leaf), dim_num, scale in zip(leaves, dims, scales):
    if dim_num is None:
      plans.append(None)
      continue
    scale = _checked_scale(scale, path)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
      raise ValueError(
          f'TACO got a complex-valued leaf of shape {leaf.shape} and dtype '
          f'{leaf.dtype}; TACO is defined for real matrices. Route it to '
          'another optimizer with None dimension numbers, or split it into '
          'real and imaginary parameters.')
    layout = routing.matrix_layout(leaf.shape, dim_num)
    plans.append(LeafPlan(
        layout=layout, dim_num=dim_num,
        scale=_default_scale(layout) if scale is None else scale,
        update_topk=min(update_topk, layout.m),
        implementation=implementation))
  return plans
