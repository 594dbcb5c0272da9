"""``scale_by_taco``: the TACO direction with a sparse FP8 gradient history."""

import functools
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from taco_optax import _dimension_numbers as dn
from taco_optax import _selection
from taco_optax import _sharding

ScaleTree = Union[float, None, Any, Callable[[Any], Any]]


class TacoState(NamedTuple):
  """State of :func:`scale_by_taco`.

  Each field is a pytree shaped like the parameters. For a TACO leaf with
  batch shape ``b`` and ``n`` columns it holds:

  Attributes:
    values: ``b + (k, n)`` history values (``float8_e4m3fn`` by default),
      sorted by decreasing magnitude within each column, in units of
      ``2**exponents``.
    indices: ``b + (k, n)`` row index of each retained value (``int32`` by
      default).
    exponents: ``b + (n,)`` ``int8`` power-of-two scale of each column.

  Leaves that are not TACO leaves hold :class:`optax.MaskedNode`.
  """
  values: Any
  indices: Any
  exponents: Any


class ColumnStep(NamedTuple):
  """The result of one TACO step on the rows ``(N, m)`` of a parameter."""
  history: _selection.EncodedRows  # (N, k) values, (N,) exponents
  history_indices: jax.Array       # (N, k)
  winner_indices: jax.Array        # (N, r) int32
  winner_signs: jax.Array          # (N, r) float32 in {-1, 0, +1}
  finite: jax.Array                # () bool: the gradient was finite


def history_size(k: Optional[int], m: int) -> int:
  """Retained entries per column: ``min(k, m)``; ``k=None`` keeps all ``m``."""
  return m if k is None else min(k, m)


def column_step(grad_rows: jax.Array, values: jax.Array, indices: jax.Array,
                exponents: jax.Array, mu: Union[float, jax.Array], k: int,
                update_topk: int,
                shards: Optional[_sharding.LeafSharding] = None) -> ColumnStep:
  """One TACO step on rows: ``M_t = H_k(mu M_{t-1} + (1 - mu) G_t)``.

  Args:
    grad_rows: ``(N, m)`` gradient, one row per paper column.
    values: ``(N, k)`` stored history values.
    indices: ``(N, k)`` their row indices (distinct within a row).
    exponents: ``(N,)`` their power-of-two scales.
    mu: EMA decay in ``[0, 1)``.
    k: history entries to keep per row (``<= m``).
    update_topk: signs emitted per row (1 for TACO; ``<= m``).
    shards: set inside :func:`jax.shard_map` when the ``m`` axis is split over
      devices: ``grad_rows`` is then this device's ``(N, m_local)`` slice and
      row indices (in and out) are global.

  Returns:
    A :class:`ColumnStep`. When the gradient is not finite the returned history
    equals the input history.
  """
  grads = grad_rows.astype(jnp.float32)
  previous = _selection.decode(_selection.EncodedRows(values, exponents))
  if shards is None:
    candidates = _selection.scatter_add_rows((1 - mu) * grads, indices,
                                             mu * previous)
    top_values, top_indices = _selection.column_topk(
        candidates, max(k, update_topk))
  else:
    candidates = _sharding.add_history((1 - mu) * grads, indices,
                                       mu * previous, shards)
    top_values, top_indices = _sharding.merged_column_topk(
        candidates, max(k, update_topk), shards)
  # Keep XLA from fusing the selection into its consumers and recomputing it.
  top_values, top_indices = jax.lax.optimization_barrier(
      (top_values, top_indices))
  finite = jnp.all(jnp.isfinite(grads))
  if shards is not None:
    finite = _sharding.all_finite(finite, shards)
  history = _selection.encode(top_values[:, :k], values.dtype)
  keep = lambda new, old: jnp.where(finite, new, old)
  history = _selection.EncodedRows(keep(history.values, values),
                                   keep(history.exponents, exponents))
  history_indices = keep(top_indices[:, :k].astype(indices.dtype), indices)
  return ColumnStep(history, history_indices, top_indices[:, :update_topk],
                    jnp.sign(top_values[:, :update_topk]), finite)


def _check_int(name: str, value: Any, minimum: int):
  if isinstance(value, jax.Array):
    raise ValueError(
        f'{name} determines state shapes and must be a Python int, got an '
        f'array; with optax.inject_hyperparams pass static_args=({name!r},).')
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'{name} must be an int, got {value!r}.')
  if value < minimum:
    raise ValueError(f'{name} must be >= {minimum}, got {value}.')


def _check_mu(mu: Any):
  if isinstance(mu, (int, float, np.number)) and not 0 <= mu < 1:
    raise ValueError(f'mu must be in [0, 1), got {mu}.')


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


def scale_by_taco(
    k: Optional[int] = 16,
    mu: Union[float, jax.Array] = 0.95,
    *,
    update_topk: Optional[int] = None,
    weight_dimension_numbers: dn.WeightDimNumOrFn | None = None,
    update_scale: ScaleTree = None,
    values_dtype: Any = None,
    index_dtype: Any = None,
) -> optax.GradientTransformation:
  r"""The TACO direction: per column, the sign of the largest history entry.

  For every TACO leaf, viewed as matrices :math:`G \in \mathbb{R}^{m \times n}`
  (``n`` columns = reduction axes, ``m`` rows = output axes), this keeps a
  sparse gradient history and returns the direction

  .. math::
    M_t = \mathcal{H}_k(\mu M_{t-1} + (1 - \mu) G_t), \qquad
    D_t = s \, \mathcal{S}(M_t),

  where :math:`\mathcal{H}_k` keeps the ``k`` largest-magnitude entries of
  every column (unretained entries of :math:`M_{t-1}` count as zero),
  :math:`\mathcal{S}` keeps in every column only the sign of its
  largest-magnitude entry, and :math:`s = m / n` by default. With ``mu=0`` this
  is vanilla TACO, :math:`D_t = (m/n)\,\mathcal{S}(G_t)`, the exact minimiser of
  :math:`\langle G, D \rangle` over the dimension-normalised
  :math:`1 \to 1` operator-norm unit ball, with
  :math:`\langle G, D^* \rangle = (m/n) \sum_j \|g_j\|_\infty` (the update is a
  direction, like a gradient: :func:`taco` multiplies it by ``-learning_rate``).

  The history is stored per column as ``k`` values in ``values_dtype`` scaled
  by a power of two (one ``int8`` exponent per column) plus ``k`` row indices,
  so gradient magnitudes anywhere from about 1e-30 to 1e30 keep the same
  winners, and multiplying all gradients by a power of two changes nothing but
  the exponents. Persistent state per column is
  ``k * (itemsize(values_dtype) + itemsize(index_dtype)) + 1`` bytes
  (81 bytes for the defaults, ``k=16``).

  Selection details: ties in magnitude go to the lowest row index; an all-zero
  column gives a zero update (``sign(0) = 0``); ``k > m`` keeps ``m`` entries.
  If a leaf's gradient holds a NaN or Inf, that whole leaf's update is NaN and
  its history is left unchanged, so :func:`optax.apply_if_finite` can skip the
  step and no NaN enters the state.

  Sharding: on a mesh with ``Explicit`` axes (the default of
  :func:`jax.make_mesh`) each leaf's sharding is read from its type. The state
  shards like the parameter's batch and reduction axes (only the first
  reduction axis may be sharded) and is replicated over the mesh axes that
  split the output axes; every sharded leaf is updated in :func:`jax.shard_map`
  where each device takes the top-k of its slice of every column and the
  ``k * shards`` candidates are all-gathered and merged, so results are
  bit-identical to one device and communication is ``O(k n)``, not ``O(m n)``.
  With ``Auto`` axes XLA partitions the step itself; use
  :func:`taco_optax.state_shardings` for the state's shardings either way.

  Args:
    k: history entries kept per column (the heavy-hitter threshold); ``None``
      keeps a dense history (``k = m``), the paper's dense ablation.
    mu: EMA decay of the history, in ``[0, 1)``. May be an array (e.g. from
      :func:`optax.inject_hyperparams`).
    update_topk: the number ``r`` of largest entries per column that receive a
      sign (the paper's Table 9 ablation). ``None`` means 1, which is TACO.
    weight_dimension_numbers: a :class:`TacoDimensionNumbers`, a tree of them
      (a prefix of the params; ``None`` leaves are passed through unchanged),
      or a callable returning such a tree from the params. ``None`` treats every
      leaf as a matrix with the default ``TacoDimensionNumbers()``.
    update_scale: the scale :math:`s`. ``None`` (default) uses ``m / n`` per
      matrix; a number applies to every leaf; a tree prefix or a callable of
      the params may mix numbers and ``None`` (e.g. ``1.0`` for the token
      embedding, as in the paper).
    values_dtype: dtype of stored history values; ``None`` means
      ``float8_e4m3fn`` (``float32`` and ``bfloat16`` are useful for ablations).
    index_dtype: integer dtype of stored row indices; ``None`` means ``int32``.
      ``int16`` cuts the state to ``3k + 1`` bytes per column when
      ``m <= 2**15``.

  The non-numeric defaults (``None``) keep the factory usable with
  :func:`optax.inject_hyperparams`, which turns numeric arguments into arrays
  and calls callables (dtypes are callables) as schedules; pass ``k`` (and an
  explicit ``update_topk``) in its ``static_args``.

  Returns:
    A :class:`optax.GradientTransformation` with state :class:`TacoState`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import taco_optax
    >>> tx = taco_optax.scale_by_taco(k=2, mu=0.0)
    >>> grads = {'w': jnp.array([[1., -5.], [-3., 2.], [0., 1.]])}
    >>> state = tx.init(grads)
    >>> updates, state = tx.update(grads, state)
    >>> updates['w'] * 3 / 2  # n=3 columns (rows here), m=2: scale 2/3
    Array([[ 0., -1.],
           [-1.,  0.],
           [ 0.,  1.]], dtype=float32)

  References:
    TACO: Ternary Absolute-max Column-wise One-sparse Optimizer for LLM
    Fine-Tuning, 2026 (Sections 3 and 5).
  """
  update_topk = 1 if update_topk is None else update_topk
  values_dtype = jnp.dtype(
      jnp.float8_e4m3fn if values_dtype is None else values_dtype)
  index_dtype = jnp.dtype(jnp.int32 if index_dtype is None else index_dtype)
  if k is not None:
    _check_int('k', k, 1)
  _check_int('update_topk', update_topk, 1)
  if k is not None and update_topk > k:
    raise ValueError(f'update_topk={update_topk} must be <= k={k}.')
  _check_mu(mu)
  if not jnp.issubdtype(index_dtype, jnp.integer):
    raise ValueError(f'index_dtype must be an integer dtype, got {index_dtype}.')
  if not jnp.issubdtype(values_dtype, jnp.floating):
    raise ValueError(f'values_dtype must be a float dtype, got {values_dtype}.')

  def layouts(tree):
    leaves, treedef = jax.tree.flatten(tree)
    dims = dn.leaf_dimension_numbers(weight_dimension_numbers, tree)
    found = [None if d is None else dn.matrix_layout(x.shape, d)
             for x, d in zip(leaves, dims)]
    return leaves, treedef, found, dims

  def init_leaf(param, layout, dim_num):
    if layout is None:
      return optax.MaskedNode(), optax.MaskedNode(), optax.MaskedNode()
    keep = history_size(k, layout.m)
    if layout.m - 1 > jnp.iinfo(index_dtype).max:
      raise ValueError(
          f'index_dtype={jnp.dtype(index_dtype).name} cannot index m='
          f'{layout.m} rows of a leaf of shape {param.shape}; use int32.')
    shape = layout.batch_shape + (keep, layout.n)
    # Distinct initial indices keep every history scatter collision-free.
    indices = jnp.broadcast_to(
        jnp.arange(keep, dtype=index_dtype)[:, None], shape)
    state = (jnp.zeros(shape, values_dtype), indices,
             jnp.zeros(layout.batch_shape + (layout.n,),
                       _selection.EXPONENT_DTYPE))
    sharded = _sharding.leaf_sharding_of(param, dim_num)
    if sharded is not None:
      state = _sharding.with_state_sharding(state, *sharded)
    return state

  def init_fn(params):
    leaves, treedef, found, dims = layouts(params)
    states = [init_leaf(p, lay, d) for p, lay, d in zip(leaves, found, dims)]
    unflatten = lambda i: treedef.unflatten([s[i] for s in states])
    return TacoState(values=unflatten(0), indices=unflatten(1),
                     exponents=unflatten(2))

  def update_leaf(grad, values, indices, exponents, layout, scale,
                  dim_num=None, shards=None, mu=mu):
    # With shards (inside shard_map) the arrays are one device's blocks and
    # `layout` still describes the whole leaf.
    local = layout if shards is None else dn.matrix_layout(grad.shape, dim_num)
    keep = values.shape[-2]
    rows_of_state = lambda x: jnp.swapaxes(x, -1, -2).reshape(-1, keep)
    step = column_step(
        local.to_rows(grad), rows_of_state(values), rows_of_state(indices),
        exponents.reshape(-1), mu, keep, min(update_topk, layout.m), shards)
    scale = layout.m / layout.n if scale is None else scale
    winners = step.winner_indices
    if shards is not None:
      winners, held = _sharding.local_rows(winners, shards)
      winners = jnp.where(held, winners, -1)
    direction = _selection.one_sparse_rows(
        winners, step.winner_signs * scale, local.m, grad.dtype)
    direction = jnp.where(step.finite, direction, jnp.nan)
    state_of_rows = lambda x: jnp.swapaxes(
        x.reshape(local.batch_shape + (local.n, keep)), -1, -2)
    return (local.from_rows(direction, grad.shape),
            state_of_rows(step.history.values),
            state_of_rows(step.history_indices),
            step.history.exponents.reshape(exponents.shape))

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef, found, dims = layouts(updates)
    scales = _leaf_scales(update_scale, updates, len(leaves))
    state_leaves = [treedef.flatten_up_to(s) for s in state]
    out = []
    for i, (grad, layout) in enumerate(zip(leaves, found)):
      leaf_state = tuple(s[i] for s in state_leaves)
      if layout is None:
        out.append((grad,) + leaf_state)
      elif (sharded := _sharding.leaf_sharding_of(grad, dims[i])) is not None:
        local_update = functools.partial(update_leaf, layout=layout,
                                         dim_num=dims[i])
        out.append(_sharding.map_over_shards(local_update, *sharded, grad,
                                             *leaf_state, scale=scales[i],
                                             mu=mu))
      else:
        out.append(update_leaf(grad, *leaf_state, layout, scales[i]))
    unflatten = lambda i: treedef.unflatten([o[i] for o in out])
    return unflatten(0), TacoState(values=unflatten(1), indices=unflatten(2),
                                   exponents=unflatten(3))

  return optax.GradientTransformation(init_fn, update_fn)
