"""``taco``: TACO on matrices, AdamW on everything else."""

from typing import Any, Optional, Union

import jax
import optax

from taco_optax import _dimension_numbers as dn
from taco_optax import _transform

_TACO, _ADAM = 'taco', 'adam'


def taco(
    learning_rate: optax.ScalarOrSchedule,
    k: Optional[int] = 16,
    mu: Union[float, jax.Array] = 0.95,
    *,
    update_topk: Optional[int] = None,
    weight_dimension_numbers: dn.WeightDimNumOrFn | None = None,
    update_scale: _transform.ScaleTree = None,
    values_dtype: Any = None,
    index_dtype: Any = None,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
) -> optax.GradientTransformation:
  r"""TACO for matrices, AdamW for vectors and scalars.

  Matrix leaves get ``chain(scale_by_taco(...), scale_by_learning_rate(lr))``,
  i.e. the update :math:`-\eta\, s\, \mathcal{S}(M_t)` which moves one weight
  per column by :math:`\pm \eta s`; every other leaf gets
  :func:`optax.adamw`. Routing uses :func:`optax.partition` with labels
  computed from shapes only, as :func:`optax.contrib.muon` does.

  With :func:`optax.inject_hyperparams`, pass ``static_args=('k',)``.

  The paper's defaults: ``learning_rate=3e-5``, ``k=16``, ``mu=0.95``, batch
  size 4, linear schedule with 50 warm-up steps, scale 1 for the token
  embedding (pass it through ``update_scale``).

  Non-finite gradients: a matrix whose gradient holds NaN/Inf gets a NaN
  update and keeps its history; AdamW leaves behave as in optax. Either way
  the weights would become NaN, so wrap the optimizer in
  :func:`optax.apply_if_finite` to skip such steps with params and state left
  intact.

  Args:
    learning_rate: TACO learning rate (or schedule).
    k: history entries per column; ``None`` for a dense history.
    mu: history EMA decay in ``[0, 1)``.
    update_topk: signs per column in each update (``None`` = 1 is TACO).
    weight_dimension_numbers: which leaves are TACO matrices and how. ``None``
      (default) means every rank-2 leaf with ``TacoDimensionNumbers()``.
      Otherwise a :class:`TacoDimensionNumbers`, a tree prefix of them with
      ``None`` for non-TACO leaves, or a callable returning one from params.
    update_scale: per-leaf scale override, see :func:`scale_by_taco`.
    values_dtype: dtype of the stored history values (``None``:
      ``float8_e4m3fn``).
    index_dtype: dtype of the stored row indices (``None``: ``int32``).
    adam_learning_rate: AdamW learning rate; defaults to ``learning_rate``.
    adam_b1: AdamW first-moment decay.
    adam_b2: AdamW second-moment decay.
    adam_eps: AdamW epsilon.
    adam_eps_root: AdamW epsilon inside the square root.
    adam_weight_decay: AdamW decoupled weight decay. When it is the number
      ``0`` (the default), plain Adam is used, so ``update`` accepts
      ``params=None``.

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
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate

  if weight_dimension_numbers is None:
    weight_dimension_numbers = lambda params: jax.tree.map(
        lambda x: dn.TacoDimensionNumbers() if x.ndim == 2 else None, params)

  def dims_tree(params):
    return dn.resolve(weight_dimension_numbers, params)

  is_dims_leaf = lambda x: (x is None or dn.is_dimension_numbers(x)
                            or isinstance(x, optax.MaskedNode))

  def param_labels(params):
    return jax.tree.map(
        lambda d, sub: jax.tree.map(lambda _: _ADAM if d is None else _TACO,
                                    sub),
        dims_tree(params), params, is_leaf=is_dims_leaf)

  def masked_dims(params):
    # Inside the partition the TACO branch sees MaskedNode for other leaves.
    labels = param_labels(params)
    return jax.tree.map(
        lambda d, sub: jax.tree.map(
            lambda label: d if label == _TACO else optax.MaskedNode(), sub),
        dims_tree(params), labels, is_leaf=is_dims_leaf)

  return optax.partition(
      transforms={
          _TACO: optax.chain(
              _transform.scale_by_taco(
                  k=k, mu=mu, update_topk=update_topk,
                  weight_dimension_numbers=masked_dims,
                  update_scale=update_scale, values_dtype=values_dtype,
                  index_dtype=index_dtype),
              optax.scale_by_learning_rate(learning_rate),
          ),
          _ADAM: _adam(adam_learning_rate, adam_b1, adam_b2, adam_eps,
                       adam_eps_root, adam_weight_decay),
      },
      param_labels=param_labels,
  )


def _adam(learning_rate, b1, b2, eps, eps_root, weight_decay):
  """AdamW, or Adam when the decay is a literal zero (then params are optional)."""
  if isinstance(weight_decay, (int, float)) and weight_decay == 0:
    return optax.adam(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                      eps_root=eps_root)
  return optax.adamw(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                     eps_root=eps_root, weight_decay=weight_decay)
