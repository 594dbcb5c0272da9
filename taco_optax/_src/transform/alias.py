"""``taco``: TACO on matrices, AdamW on everything else."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import optax

from taco_optax._src import kernels
from taco_optax._src import routing
from taco_optax._src.transform import hyperparams
from taco_optax._src.transform import inject_guard
from taco_optax._src.transform import parts as parts_lib
from taco_optax._src.transform import rounding as rounding_lib
from taco_optax._src.transform import scale


def taco(
    learning_rate: optax.ScalarOrSchedule,
    k: Optional[int] = scale.DEFAULT_K,
    mu: Union[float, jax.Array] = 0.95,
    *,
    update_topk: Optional[int] = None,
    weight_dimension_numbers: routing.WeightDimNumOrFn | None = None,
    update_scale: scale.ScaleTree = None,
    values_dtype: Optional[jax.typing.DTypeLike] = None,
    index_dtype: Optional[jax.typing.DTypeLike] = None,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_eps_root: float = 0.0,
    adam_weight_decay: Optional[float] = None,
    implementation: Optional[kernels.Implementation] = None,
    rounding: rounding_lib.Rounding = 'stochastic',
    rounding_seed: int = 0,
) -> optax.GradientTransformation:
  r"""TACO for matrices, AdamW for vectors and scalars.

  Matrix leaves get ``chain(scale_by_taco(...), scale_by_learning_rate(lr))``,
  i.e. the update :math:`-\eta\, s\, \mathcal{S}(M_t)` which moves one weight
  per column by :math:`\pm \eta s`; every other leaf gets
  :func:`optax.adamw`. Routing uses :func:`optax.partition` with labels
  computed from shapes only, as :func:`optax.contrib.muon` does.

  With :func:`optax.inject_hyperparams`, a ``k`` you pass goes in
  ``static_args=('k',)`` (it is a state shape; left at its default it needs
  none), and so do ``weight_dimension_numbers`` and ``update_scale`` when
  they are callables (optax would call them as schedules; taco refuses that
  with the names to add); trees of them need no ``static_args``.

  Learning rates and ``mu`` are checked: a negative or non-finite rate, or a
  ``mu`` outside ``[0, 1)``, is refused when given, a schedule at ``init``
  (its step-0 value). A value known only inside ``jit`` (injected, or a
  schedule past step 0) cannot be refused: out of range, it makes that
  step's updates NaN and TACO's histories stay as they were, as a non-finite
  gradient does, so :func:`optax.apply_if_finite` skips the step.

  The paper's defaults: ``learning_rate=3e-5``, ``k=16``, ``mu=0.95``, batch
  size 4, linear schedule with 50 warm-up steps, scale 1 for the token
  embedding (pass it through ``update_scale``).

  16-bit parameters: with ``rounding='stochastic'`` each update of a
  bfloat16/float16 leaf is chosen so that ``optax.apply_updates`` lands on
  the stochastically rounded target (a weight that a step more than halves,
  near zero, lands on the nearest value such an update reaches). The random
  bits depend only on the seed, the step, the leaf and the element, so the
  layer-wise step draws the same ones. ``update`` then needs ``params`` for
  16-bit parameters (float32 ones round nothing and need none).

  Non-finite gradients: a matrix whose gradient holds NaN/Inf gets a NaN
  update and keeps its history; AdamW leaves behave as in optax. Either way
  the weights would become NaN, so wrap the optimizer in
  :func:`optax.apply_if_finite` to skip such steps with params and state left
  intact.

  Args:
    learning_rate: TACO learning rate (or schedule), finite and ``>= 0``.
    k: history entries per column (default 16); ``None`` for a dense
      history.
    mu: history EMA decay in ``[0, 1)``.
    update_topk: signs per column in each update (``None`` = 1 is TACO).
    weight_dimension_numbers: which leaves are TACO matrices and how. ``None``
      (default) means every rank-2 leaf with ``TacoDimensionNumbers()``;
      ``init`` then warns (``taco_optax`` logger) naming the floating leaves
      of rank >= 3 it sends to Adam (einsum kernels such as ``(D, N, H)``).
      Otherwise a :class:`TacoDimensionNumbers`, a tree prefix of them with
      ``None`` for non-TACO leaves (for a Flax NNX model,
      :func:`taco_optax.nnx.dimension_numbers`), or a callable returning one
      from params. :func:`taco_optax.routing_report` shows the result.
    update_scale: per-leaf scale override, see :func:`scale_by_taco`.
    values_dtype: dtype of the stored history values (``None``:
      ``float8_e4m3fn``).
    index_dtype: dtype of the stored row indices (``None``: ``int32``).
    adam_learning_rate: AdamW learning rate; defaults to ``learning_rate``.
    adam_b1: AdamW first-moment decay.
    adam_b2: AdamW second-moment decay.
    adam_eps: AdamW epsilon.
    adam_eps_root: AdamW epsilon inside the square root.
    adam_weight_decay: AdamW decoupled weight decay. ``None`` (the default)
      or the number ``0`` means plain Adam, and ``update`` accepts
      ``params=None``; the state has the same structure either way (also
      under :func:`optax.inject_hyperparams`, where a number becomes an array
      and then needs ``params``).
    implementation: what runs TACO's column step (``'auto'``, ``'cpu'``,
      ``'pallas'``, ``'reference'``; ``None`` reads ``$TACO_OPTAX_KERNEL``),
      see :func:`scale_by_taco`.
    rounding: how updates of bfloat16 and float16 parameters are rounded.
      ``'stochastic'`` (the default): the new weight is the exact float32
      sum ``w + u`` of the weight and its update rounded up or down at
      random, unbiased (both branches; see below). ``'nearest'``:
      ``optax.apply_updates``' rounding to nearest, which drops every step
      below half an ulp (a bfloat16 weight of 0.02 has an ulp of 1.2e-4).
      Parameters of other dtypes are not affected.
    rounding_seed: the seed of stochastic rounding's random bits; a run is
      reproducible and resumes bit for bit.

  Returns:
    A :class:`optax.GradientTransformation`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import taco_optax
    >>> params = {'w': jnp.ones((4, 3)), 'b': jnp.zeros((3,))}
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
    ...                  taco_optax.taco(learning_rate=3e-5))
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> int((updates['w'] != 0).sum())  # one weight per column (4 columns)
    4

  References:
    TACO: Ternary Absolute-max Column-wise One-sparse Optimizer for LLM
    Fine-Tuning, 2026.
  """
  inject_guard.refuse_scheduled_routing('taco_optax.taco')
  parts = _parts(
      learning_rate, k, mu, update_topk=update_topk,
      weight_dimension_numbers=weight_dimension_numbers,
      update_scale=update_scale, values_dtype=values_dtype,
      index_dtype=index_dtype, adam_learning_rate=adam_learning_rate,
      adam=AdamSettings(b1=adam_b1, b2=adam_b2, eps=adam_eps,
                        eps_root=adam_eps_root,
                        weight_decay=adam_weight_decay),
      implementation=implementation, rounding=rounding,
      rounding_seed=rounding_seed)
  optimizer = parts.transformation()
  if parts.default_routing:
    optimizer = parts_lib.replace_init(
        optimizer, routing.checked_init(optimizer.init))
  return optimizer


def _parts(learning_rate: optax.ScalarOrSchedule, k: Optional[int],
           mu: Union[float, jax.Array], *, update_topk: Optional[int],
           weight_dimension_numbers: routing.WeightDimNumOrFn | None,
           update_scale: scale.ScaleTree,
           values_dtype: Optional[jax.typing.DTypeLike],
           index_dtype: Optional[jax.typing.DTypeLike],
           adam_learning_rate: Optional[optax.ScalarOrSchedule],
           adam: AdamSettings,
           implementation: Optional[kernels.Implementation],
           rounding: rounding_lib.Rounding,
           rounding_seed: int) -> parts_lib.TacoParts:
  """:func:`taco`'s pieces."""
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  default_routing = weight_dimension_numbers is None
  if default_routing:
    weight_dimension_numbers = routing.rank2_matrices
  resolved = kernels.resolve(implementation)
  stochastic = rounding_lib.check_mode(rounding) == 'stochastic'

  def dims_tree(params):
    return routing.resolve(weight_dimension_numbers, params)

  def per_leaf(params, fn):
    dims = routing.entries(dims_tree(params), params)
    return jax.tree.structure(params).unflatten([fn(d) for d in dims])

  def param_labels(params):
    # One label per box (see routing.box_structure): no Variable in the state
    # around a placeholder.
    dims = routing.entries(dims_tree(params), params)
    return routing.box_structure(params).unflatten(
        [parts_lib.ADAM_LABEL if d is None else parts_lib.TACO_LABEL
         for d in dims])

  def masked_dims(params):
    # Inside the partition the TACO branch sees MaskedNode for other leaves.
    return per_leaf(params, lambda d: optax.MaskedNode() if d is None else d)

  direction = scale.taco_direction(
      k, mu, update_topk=update_topk, weight_dimension_numbers=masked_dims,
      update_scale=update_scale, values_dtype=values_dtype,
      index_dtype=index_dtype, implementation=resolved)
  return parts_lib.TacoParts(
      param_labels=param_labels,
      dimension_numbers=dims_tree,
      direction=direction.transformation,
      learning_rate=hyperparams.scale_by_checked_learning_rate(learning_rate),
      adam=_adam(adam_learning_rate, adam,
                 rounding_seed=rounding_seed if stochastic else None),
      mu=mu, update_topk=1 if update_topk is None else update_topk,
      update_scale=update_scale, implementation=resolved,
      rounding=(rounding_lib.stochastic_rounding(rounding_seed) if stochastic
                else None),
      rounding_seed=rounding_seed, k=direction.k,
      direction_plans=direction.plans, default_routing=default_routing)


class AdamSettings(NamedTuple):
  """The Adam branch's settings: :func:`taco`'s ``adam_*`` arguments
  (arrays under :func:`optax.inject_hyperparams`)."""
  b1: Union[float, jax.Array]
  b2: Union[float, jax.Array]
  eps: Union[float, jax.Array]
  eps_root: Union[float, jax.Array]
  weight_decay: Union[None, float, jax.Array]


def _adam(learning_rate: optax.ScalarOrSchedule, settings: AdamSettings, *,
          rounding_seed: Optional[int]) -> optax.GradientTransformation:
  """AdamW, or Adam (no ``params`` needed) for a decay of ``None`` or ``0``.

  Both are ``chain(scale_by_adam, decay, scale_by_learning_rate)`` with the
  same state structure, so the state does not depend on whether the decay is a
  Python number or an array (:func:`optax.inject_hyperparams`). It runs in
  float32 for 16-bit parameters (its moments would underflow in float16, and
  its update is rounded once, at the end): these are vectors, so the float32
  moments cost a few bytes per norm or bias element. With a
  ``rounding_seed`` it ends with stochastic rounding.
  """
  weight_decay = settings.weight_decay
  no_decay = weight_decay is None or (
      isinstance(weight_decay, (int, float)) and weight_decay == 0)
  pieces = (
      optax.scale_by_adam(b1=settings.b1, b2=settings.b2, eps=settings.eps,
                          eps_root=settings.eps_root),
      optax.identity() if no_decay else optax.add_decayed_weights(
          weight_decay),
      hyperparams.scale_by_checked_learning_rate(learning_rate,
                                                 'adam_learning_rate'),
  )
  pieces = tuple(map(rounding_lib.in_float32, pieces))
  if rounding_seed is None:
    return optax.chain(*pieces, rounding_lib.rounded_to_params())
  return optax.chain(*pieces, rounding_lib.stochastic_rounding(rounding_seed))
