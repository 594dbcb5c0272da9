"""One TACO leaf: its static plan, its history step, its dense direction.

A :class:`LeafPlan` says once how a parameter maps to TACO's matrices (layout,
dimension numbers, scale, signs per column). :func:`history_step` runs the
column step on a leaf's rows with the state in its stored ``batch + (k, n)``
layout; both the optax path (:func:`dense_direction`) and the layer-wise
train step (``_leaf_update``) go through it.
"""

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from taco_optax import _column_step
from taco_optax import _dimension_numbers as dn
from taco_optax import _kernels
from taco_optax import _mesh

ScaleTree = Union[float, None, Any]


class LeafPlan(NamedTuple):
  """How one TACO parameter leaf is updated (all static).

  Attributes:
    layout: the whole leaf's :class:`MatrixLayout`.
    dim_num: its :class:`TacoDimensionNumbers` (to re-derive the layout of one
      device's block on a mesh).
    scale: the update scale ``s`` (``m / n`` unless overridden).
    update_topk: signs per column, ``min(r, m)``.
  """
  layout: dn.MatrixLayout
  dim_num: dn.TacoDimensionNumbers
  scale: float
  update_topk: int

  def local_layout(self, shape: tuple[int, ...]) -> dn.MatrixLayout:
    """The layout of a block of this leaf of ``shape`` (e.g. one device's)."""
    return dn.matrix_layout(shape, self.dim_num)


def _leaf_scales(update_scale: ScaleTree, tree: Any,
                 num_leaves: int) -> list[Optional[float]]:
  """Broadcasts ``update_scale`` (a number, tree prefix or callable)."""
  if update_scale is None or isinstance(update_scale, (int, float)):
    return [update_scale] * num_leaves
  scales = update_scale(tree) if callable(update_scale) else update_scale
  per_leaf = []
  jax.tree.map(
      lambda s, sub: per_leaf.extend([s] * len(jax.tree.leaves(sub))),
      scales, tree,
      is_leaf=lambda x: x is None or isinstance(x, (int, float, optax.MaskedNode)))
  return per_leaf


def leaf_plans(tree: Any, weight_dimension_numbers: dn.WeightDimNumOrFn | None,
               update_scale: ScaleTree, update_topk: int
               ) -> list[Optional[LeafPlan]]:
  """One :class:`LeafPlan` per leaf of ``tree`` (``None``: not a TACO leaf).

  Raises:
    ValueError: for invalid dimension numbers, or a complex-valued TACO leaf
      (the sign of a complex number is not ternary).
  """
  leaves = jax.tree.leaves(tree)
  dims = dn.leaf_dimension_numbers(weight_dimension_numbers, tree)
  scales = _leaf_scales(update_scale, tree, len(leaves))
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
        scale=layout.m / layout.n if scale is None else scale,
        update_topk=min(update_topk, layout.m)))
  return plans


def history_step(grad_rows: jax.Array, values: jax.Array, indices: jax.Array,
                 exponents: jax.Array, plan: LeafPlan,
                 mu: Union[float, jax.Array],
                 shards: Optional[_mesh.LeafSharding] = None
                 ) -> tuple[_column_step.ColumnStep, tuple[jax.Array, ...]]:
  """The column step on rows, with the state in its stored layout.

  Args:
    grad_rows: ``(N, m)`` rows of the gradient (or of a block of its columns).
    values: ``batch + (k, n)`` history values for the same columns.
    indices: ``batch + (k, n)`` their row indices.
    exponents: ``batch + (n,)`` their scales.
    plan: the leaf's plan.
    mu: EMA decay.
    shards: set inside ``shard_map``: the rows are this device's slices.

  Returns:
    ``(step, (values, indices, exponents))``: the :class:`ColumnStep` on rows
    and the new state in the stored layout.
  """
  keep = values.shape[-2]
  to_rows = lambda x: jnp.swapaxes(x, -1, -2).reshape(-1, keep)
  step = _kernels.column_step(
      grad_rows, to_rows(values), to_rows(indices), exponents.reshape(-1), mu,
      plan.update_topk, None if shards is None else _mesh.selection(shards))
  stored = values.shape[:-2] + (values.shape[-1], keep)
  from_rows = lambda x: jnp.swapaxes(x.reshape(stored), -1, -2)
  return step, (from_rows(step.values), from_rows(step.indices),
                step.exponents.reshape(exponents.shape))


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
                    shards: Optional[_mesh.LeafSharding] = None
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
  step, state = history_step(layout.to_rows(grad), values, indices, exponents,
                             plan, mu, shards)
  winners = step.winner_indices
  if shards is not None:
    winners, held = _mesh.local_rows(winners, shards)
    winners = jnp.where(held, winners, -1)
  direction = one_sparse_rows(winners, step.winner_signs * plan.scale,
                              layout.m, grad.dtype)
  direction = jnp.where(step.finite, direction, jnp.nan)
  return (layout.from_rows(direction, grad.shape),) + state
