"""``scale_by_taco``: the TACO direction with a sparse FP8 gradient history."""

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from taco_optax._src import kernels
from taco_optax._src import routing
from taco_optax._src import sharding
from taco_optax._src.transform import hyperparams
from taco_optax._src.transform import inject_guard
from taco_optax._src.transform import inputs
from taco_optax._src.transform import plan as plan_lib

ScaleTree = plan_lib.ScaleTree


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


def leaf_histories(state: TacoState, treedef: Any) -> list[kernels.History]:
  """Each leaf's :class:`History` in ``state``, for the leaves of ``treedef``
  (a masked leaf's entries are ``optax.MaskedNode`` when ``treedef`` counts
  it as a leaf)."""
  fields = [treedef.flatten_up_to(getattr(state, name))
            for name in kernels.History._fields]
  return [kernels.History(*entries) for entries in zip(*fields)]


def taco_state(treedef: Any, histories: list[kernels.History]) -> TacoState:
  """The :class:`TacoState` of one :class:`History` per leaf of
  ``treedef``."""
  return TacoState(**{
      name: treedef.unflatten([getattr(h, name) for h in histories])
      for name in kernels.History._fields})


class _DefaultK:
  """``k``'s default, 16 (the paper's), shown as ``16``.

  Not an ``int``, so that :func:`optax.inject_hyperparams`, which binds the
  defaults and turns every number into an array, leaves it as it is:
  ``inject_hyperparams(taco)(learning_rate=...)`` needs no ``static_args``
  when ``k`` is not given. A ``k`` that is given is a state shape and must
  be in ``static_args``.
  """

  def __index__(self) -> int:
    return 16

  def __repr__(self) -> str:
    return '16'


DEFAULT_K: Any = _DefaultK()


def history_size(k: Optional[int], m: int) -> int:
  """Retained entries per column: ``min(k, m)``; ``k=None`` keeps all ``m``."""
  return m if k is None else min(k, m)


def _check_int(name: str, value: Any, minimum: int):
  if isinstance(value, jax.Array):
    raise ValueError(
        f'{name} determines state shapes and must be a Python int, got an '
        f'array; with optax.inject_hyperparams pass static_args=({name!r},).')
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'{name} must be an int, got {value!r}.')
  if value < minimum:
    raise ValueError(f'{name} must be >= {minimum}, got {value}.')


def _checked_settings(k, mu, update_topk, values_dtype, index_dtype):
  """``(k, update_topk, values_dtype, index_dtype)``, defaults filled in,
  validated."""
  update_topk = 1 if update_topk is None else update_topk
  if isinstance(k, _DefaultK):
    k = int(k)
  values_dtype = jnp.dtype(
      jnp.float8_e4m3fn if values_dtype is None else values_dtype)
  index_dtype = jnp.dtype(jnp.int32 if index_dtype is None else index_dtype)
  if k is not None:
    _check_int('k', k, 1)
  _check_int('update_topk', update_topk, 1)
  if k is not None and update_topk > k:
    raise ValueError(f'update_topk={update_topk} must be <= k={k}.')
  hyperparams.check_mu(mu)
  if not jnp.issubdtype(index_dtype, jnp.integer):
    raise ValueError(
        f'index_dtype must be an integer dtype, got {index_dtype}.')
  if not jnp.issubdtype(values_dtype, jnp.floating):
    raise ValueError(f'values_dtype must be a float dtype, got {values_dtype}.')
  return k, update_topk, values_dtype, index_dtype


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


def dense_direction(grad: jax.Array, history: kernels.History, *,
                    plan: plan_lib.LeafPlan, mu: Union[float, jax.Array],
                    shards: Optional[sharding.LeafSharding] = None
                    ) -> tuple[jax.Array, kernels.History]:
  """``scale_by_taco`` on one leaf: the dense direction and the new history.

  With ``shards`` (inside ``shard_map``) the arrays are one device's blocks,
  ``plan`` still describes the whole leaf and row indices are global.

  Returns:
    ``(direction, history)``; the direction is ``scale * sign`` at each
    column's winners, 0 elsewhere, and all NaN when the gradient is not
    finite.
  """
  layout = plan.local_layout(grad.shape)
  step, history = kernels.history_step(
      layout.to_rows(grad), history, update_topk=plan.update_topk, mu=mu,
      implementation=plan.implementation, shards=shards)
  winners = step.winner_indices
  if shards is not None:
    winners, held = sharding.local_rows(winners, shards)
    winners = jnp.where(held, winners, -1)
  direction = one_sparse_rows(winners, step.winner_signs * plan.scale,
                              layout.m, grad.dtype)
  direction = jnp.where(step.finite, direction, jnp.nan)
  return layout.from_rows(direction, grad.shape), history


def scale_by_taco(
    k: Optional[int] = DEFAULT_K,
    mu: Union[float, jax.Array] = 0.95,
    *,
    update_topk: Optional[int] = None,
    weight_dimension_numbers: routing.WeightDimNumOrFn | None = None,
    update_scale: ScaleTree = None,
    values_dtype: Optional[jax.typing.DTypeLike] = None,
    index_dtype: Optional[jax.typing.DTypeLike] = None,
    implementation: Optional[kernels.Implementation] = None,
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
  With ``Auto`` axes XLA chooses the shardings and a
  :func:`jax.experimental.custom_partitioning` rule runs the column step on
  each device's rows (only a finiteness flag is combined) or, when a column's
  candidates are split, merges ``k`` candidates per shard the same exact way;
  use :func:`taco_optax.state_shardings` for the state's shardings either way.

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
    implementation: what runs the column step: ``'auto'`` (the fused CPU
      kernel on CPU where it builds, else the reference), ``'cpu'``,
      ``'pallas'`` or ``'reference'`` (plain ``jax.numpy``). All give the
      same bits. ``None`` reads ``$TACO_OPTAX_KERNEL`` now (default
      ``'auto'``), so the transformation keeps one choice; the choice is
      logged on the ``taco_optax`` logger and names the step's scope
      (``taco_column_step_<implementation>``).

  The non-numeric defaults (``None``) keep the factory usable with
  :func:`optax.inject_hyperparams`, which turns numeric arguments into arrays
  and calls callables (dtypes are callables) as schedules; pass a ``k`` you
  give (its default is left alone) and an explicit ``update_topk`` in its
  ``static_args``, and so every callable
  ``weight_dimension_numbers``, ``update_scale`` or dtype (left out, they
  are refused with a message naming them).

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
  inject_guard.refuse_scheduled_routing('taco_optax.scale_by_taco')
  return taco_direction(
      k, mu, update_topk=update_topk,
      weight_dimension_numbers=weight_dimension_numbers,
      update_scale=update_scale, values_dtype=values_dtype,
      index_dtype=index_dtype, implementation=implementation).transformation


class TacoDirection(NamedTuple):
  """:func:`scale_by_taco`'s ``transformation`` and what :func:`taco`'s
  branch reads of it: ``plans`` (``tree -> list`` of each leaf's
  :class:`LeafPlan`, ``None`` for a non-TACO leaf), ``mu`` and ``k``."""
  transformation: optax.GradientTransformation
  plans: Callable[[Any], list[Optional[plan_lib.LeafPlan]]]
  mu: Union[float, jax.Array]
  k: Optional[int]


def taco_direction(k: Optional[int], mu: Union[float, jax.Array], *,
                   update_topk: Optional[int],
                   weight_dimension_numbers: routing.WeightDimNumOrFn | None,
                   update_scale: ScaleTree,
                   values_dtype: Optional[jax.typing.DTypeLike],
                   index_dtype: Optional[jax.typing.DTypeLike],
                   implementation: Optional[kernels.Implementation]
                   ) -> TacoDirection:
  """:func:`scale_by_taco` of these arguments, with its plans, ``mu`` and
  ``k`` (:class:`TacoDirection`)."""
  k, update_topk, values_dtype, index_dtype = _checked_settings(
      k, mu, update_topk, values_dtype, index_dtype)
  resolved = kernels.resolve(implementation)

  def plans(tree):
    return plan_lib.leaf_plans(tree, weight_dimension_numbers, update_scale,
                            update_topk, resolved)

  def init_leaf(param, plan):
    if plan is None:
      masked = optax.MaskedNode()
      return kernels.History(masked, masked, masked)
    layout = plan.layout
    keep = history_size(k, layout.m)
    if layout.m - 1 > jnp.iinfo(index_dtype).max:
      raise ValueError(
          f'index_dtype={jnp.dtype(index_dtype).name} cannot index m='
          f'{layout.m} rows of a leaf of shape {param.shape}; use int32.')
    shape = layout.batch_shape + (keep, layout.n)
    # Distinct initial indices keep every history scatter collision-free.
    indices = jnp.broadcast_to(
        jnp.arange(keep, dtype=index_dtype)[:, None], shape)
    history = kernels.History(
        jnp.zeros(shape, values_dtype), indices,
        jnp.zeros(layout.batch_shape + (layout.n,), kernels.EXPONENT_DTYPE))
    sharded = sharding.leaf_sharding_of(param, plan.axes(param.shape))
    if sharded is not None:
      history = sharding.with_state_sharding(history, *sharded)
    return history

  def init_fn(params):
    if routing.is_params_placeholder(params):
      # tree_map_params: the histories are (k, n), not like the params.
      return TacoState(*(routing.NotParams() for _ in TacoState._fields))
    leaves, treedef = jax.tree.flatten(params)
    state = taco_state(treedef, [init_leaf(p, plan) for p, plan in
                                 zip(leaves, plans(params))])
    # Boxed parameters (nnx.Variables, as nnx.Optimizer passes them) box
    # their histories too; a masked leaf's box goes: no Variable around a
    # placeholder (routing.box_structure says why).
    return routing.without_masked_boxes(state)

  def update_fn(updates, state, params=None):
    updates, params = inputs.checked(updates, params)
    leaves, treedef = jax.tree.flatten(updates)
    histories = leaf_histories(state, treedef)
    leaf_plans = plans(updates)
    check_history_shapes(updates, histories, leaf_plans, k)
    out = [leaf_direction(grad, history, plan, mu) for grad, history, plan
           in zip(leaves, histories, leaf_plans)]
    return (treedef.unflatten([direction for direction, _ in out]),
            taco_state(treedef, [history for _, history in out]))

  return TacoDirection(optax.GradientTransformation(init_fn, update_fn),
                       plans, mu, k)


def check_history_shapes(updates: Any, histories: list[kernels.History],
                         plans: list[Optional[plan_lib.LeafPlan]],
                         k: Optional[int]) -> None:
  """Raises, naming the leaf, if a TACO gradient's shape is not the one its
  history (made by ``init`` from the parameter) was made for: its columns,
  and its rows where they set the history's length (``m <= k``; ``update``
  checks larger ones against ``params`` when given)."""
  paths = jax.tree_util.tree_leaves_with_path(updates)
  for (path, grad), history, plan in zip(paths, histories, plans):
    if plan is None or routing.is_masked(history.indices):
      continue
    layout = plan.layout
    made_for = history.indices.shape[:-2] + history.indices.shape[-1:]
    kept = history.indices.shape[-2]
    if (made_for != layout.batch_shape + (layout.n,)
        or kept != history_size(k, layout.m)):
      raise ValueError(
          f'The gradient of the TACO leaf {routing.path_name(path)!r} has '
          f'shape {grad.shape} ({layout.num_matrices} x {layout.m} x '
          f'{layout.n} as a matrix), but its state was initialised for '
          f'{math.prod(made_for[:-1])} matrices of {made_for[-1]} columns '
          f'keeping {kept} of their rows: '
          'give update gradients of the shapes given to init.')



def leaf_direction(grad: jax.Array, history: kernels.History,
                   plan: Optional[plan_lib.LeafPlan],
                   mu: Union[float, jax.Array]
                   ) -> tuple[jax.Array, kernels.History]:
  """One leaf's dense direction and new history (a non-TACO leaf passes),
  per device when the leaf is split over an explicit mesh."""
  if plan is None:
    return grad, history
  sharded = sharding.leaf_sharding_of(grad, plan.axes(grad.shape))
  if sharded is None:
    return dense_direction(grad, history, plan=plan, mu=mu)
  return kernels.map_over_shards(dense_direction, *sharded, (grad,),
                                 history, plan=plan, mu=mu)
