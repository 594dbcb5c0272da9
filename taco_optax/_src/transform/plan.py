"""One TACO leaf: its static plan, its history step, its dense direction.

A :class:`LeafPlan` says once how a parameter maps to TACO's matrices (layout,
dimension numbers, scale, signs per column, implementation). Both the optax
path (:func:`dense_direction`) and the layer-wise train step
(``_leaf_update``) run its column step through ``kernels.history_step``.
"""

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from taco_optax._src.transform import dimension_numbers as dn
from taco_optax._src import kernels
from taco_optax._src.transform import prefix

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
  layout: dn.MatrixLayout
  dim_num: dn.TacoDimensionNumbers
  scale: float
  update_topk: int
  implementation: str = 'auto'

  def axes(self, shape: tuple[int, ...]) -> kernels.LeafAxes:
    """The ``(batch, reduction, output)`` axes of this leaf (or a block of
    it) of ``shape``, normalised."""
    return dn.normalize_axes(shape, self.dim_num)

  def local_layout(self, shape: tuple[int, ...]) -> dn.MatrixLayout:
    """The layout of a block of this leaf of ``shape`` (e.g. one device's)."""
    return dn.matrix_layout(shape, self.dim_num)


def _is_scale_leaf(x: Any) -> bool:
  return x is None or isinstance(x, (int, float, optax.MaskedNode))


def leaf_scales(update_scale: ScaleTree, tree: Any) -> list[Optional[float]]:
  """``update_scale`` (a number, tree prefix or callable) for every leaf."""
  if callable(update_scale):
    update_scale = update_scale(tree)
  return prefix.per_leaf(update_scale, tree, _is_scale_leaf)


def _default_scale(layout: dn.MatrixLayout) -> float:
  """``m / n``; 0 for a matrix without columns (it has nothing to update)."""
  return layout.m / layout.n if layout.n else 0.0


def leaf_plans(tree: Any, weight_dimension_numbers: dn.WeightDimNumOrFn | None,
               update_scale: ScaleTree, update_topk: int,
               implementation: str = 'auto') -> list[Optional[LeafPlan]]:
  """One :class:`LeafPlan` per leaf of ``tree`` (``None``: not a TACO leaf).

  Raises:
    ValueError: for invalid dimension numbers, or a complex-valued TACO leaf
      (the sign of a complex number is not ternary).
  """
  leaves = jax.tree.leaves(tree)
  dims = dn.leaf_dimension_numbers(weight_dimension_numbers, tree)
  scales = leaf_scales(update_scale, tree)
  plans = []
  for leaf, dim_num, scale in zip(leaves, dims, scales):
    if dim_num is None:
      plans.append(None)
      continue
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
      raise ValueError(
          f'TACO got a complex-valued leaf of shape {leaf.shape} and dtype '
          f'{leaf.dtype}; TACO is defined for real matrices. Route it to '
          'another optimizer with None dimension numbers, or split it into '
          'real and imaginary parameters.')
    layout = dn.matrix_layout(leaf.shape, dim_num)
    plans.append(LeafPlan(
        layout=layout, dim_num=dim_num,
        scale=_default_scale(layout) if scale is None else scale,
        update_topk=min(update_topk, layout.m),
        implementation=implementation))
  return plans


def one_sparse_rows(indices: jax.Array, signs: jax.Array, m: int,
                    dtype: jnp.dtype) -> jax.Array:
  """A dense ``(N, m)`` array with ``signs[i, s]`` at ``indices[i, s]``, else 0.

  Built with comparisons rather than a scatter so that XLA writes it in one
  fused elementwise pass. Negative indices match nothing.
  """
  positions = jax.lax.broadcasted_iota(jnp.int32, (indices.shape[0], m), 1)
  dense = jnp.zeros((indices.shape[0], m), dtype)
  for slot in range(indices.shape[1]):
    hit = positions == indices[:, slot:slot + 1].astype(jnp.int32)
    dense = jnp.where(hit, signs[:, slot:slot + 1].astype(dtype), dense)
  return dense


def dense_direction(grad: jax.Array, values: jax.Array, indices: jax.Array,
                    exponents: jax.Array, *, plan: LeafPlan,
                    mu: Union[float, jax.Array],
                    shards: Optional[kernels.LeafSharding] = None
                    ) -> tuple[jax.Array, ...]:
  """``scale_by_taco`` on one leaf: the dense direction and the new state.

  With ``shards`` (inside ``shard_map``) the arrays are one device's blocks,
  ``plan`` still describes the whole leaf and row indices are global.

  Returns:
    ``(direction, values, indices, exponents)``; the direction is
    ``scale * sign`` at each column's winners, 0 elsewhere, and all NaN when
    the gradient is not finite.
  """
  layout = plan.local_layout(grad.shape)
  step, state = kernels.history_step(
      layout.to_rows(grad), values, indices, exponents,
      update_topk=plan.update_topk, mu=mu,
      implementation=plan.implementation, shards=shards)
  winners = step.winner_indices
  if shards is not None:
    winners, held = kernels.local_rows(winners, shards)
    winners = jnp.where(held, winners, -1)
  direction = one_sparse_rows(winners, step.winner_signs * plan.scale,
                              layout.m, grad.dtype)
  direction = jnp.where(step.finite, direction, jnp.nan)
  return (layout.from_rows(direction, grad.shape),) + state
