"""What a :func:`taco` optimizer is made of, and the one place that reads it.

``taco(...)`` is ``optax.partition({TACO_LABEL: chain(direction,
learning_rate[, rounding]), ADAM_LABEL: adam}, param_labels)``. The
layer-wise train step and tunix's trainer apply those pieces by hand, so
they need them back: :func:`parts_of` gives them, from the
transformation :func:`taco` returns (its ``update`` is a :class:`TacoUpdate`,
which carries the :class:`TacoParts`), and refuses anything else naming
the wrapper and what to do instead. The TACO branch's pieces are named
once (:data:`TACO_PIECES`): :meth:`TacoParts.transformation` runs them in
that order (as ``branch``'s chain) and :func:`taco_states` /
:func:`with_taco_states` read and write their states by those names.
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import optax

from taco_optax._src.transform import branch
from taco_optax._src.transform import inputs
from taco_optax._src.transform import plan as plan_lib
from taco_optax._src.transform import scale

TACO_LABEL = 'taco'
ADAM_LABEL = 'adam'
# The TACO branch's chain, in order; 'rounding' is absent with 'nearest'.
TACO_PIECES = ('direction', 'learning_rate', 'rounding')


class TacoStates(NamedTuple):
  """The states of a :func:`taco` optimizer's pieces (:func:`taco_states`).

  ``rounding`` is the TACO branch's stochastic rounding state, ``None`` with
  ``rounding='nearest'``.
  """
  direction: Any
  learning_rate: Any
  adam: Any
  rounding: Any = None


class TacoParts(NamedTuple):
  """The pieces a :func:`taco` optimizer partitions its parameters between.

  Attributes:
    param_labels: ``params -> labels``, :data:`TACO_LABEL` for TACO matrices
      and :data:`ADAM_LABEL` for everything else.
    dimension_numbers: ``params -> tree`` of :class:`TacoDimensionNumbers`
      (``None`` for non-TACO leaves).
    direction: :func:`scale_by_taco` as it runs on the TACO leaves.
    learning_rate: ``optax.scale_by_learning_rate`` of the TACO leaves.
    adam: the transformation of every other leaf (Adam, or AdamW with
      ``adam_weight_decay``).
    mu: the history EMA decay.
    update_topk: signs per column.
    update_scale: the per-leaf scale override of :func:`scale_by_taco`.
    implementation: what runs the column step (resolved).
    rounding: the TACO branch's stochastic rounding of 16-bit parameters
      (:func:`stochastic_rounding`), ``None`` with ``'nearest'``; the Adam
      branch ends with its own.
    rounding_seed: the seed of the stochastic rounding's random bits.
    k: the history length of :func:`scale_by_taco` (``None``: all rows).
    direction_plans: ``updates -> list`` of each leaf's plan in the TACO
      branch, where the Adam leaves are ``optax.MaskedNode``.
    default_routing: ``weight_dimension_numbers`` was not given: every
      rank-2 leaf is a matrix, nothing else.
    leaf_order: where the parts step a re-laid tree (the layer-wise step's
      ``(outer, layers)`` pair of the user's parameters), ``leaf_order[j]``
      is the index of leaf ``j`` in the tree the optimizer was built for:
      stochastic rounding keys a leaf's bits by that index. ``None``: each
      leaf's own.
  """
  param_labels: Callable[[Any], Any]
  dimension_numbers: Callable[[Any], Any]
  direction: optax.GradientTransformation
  learning_rate: optax.GradientTransformation
  adam: optax.GradientTransformation
  mu: Union[float, jax.Array]
  update_topk: int
  update_scale: Any
  implementation: str
  rounding: Optional[optax.GradientTransformation]
  rounding_seed: int
  k: Optional[int]
  direction_plans: Callable[[Any], list[Optional[plan_lib.LeafPlan]]]
  default_routing: bool = False
  leaf_order: Optional[tuple[int, ...]] = None

  def plans(self, params: Any) -> list[Optional[plan_lib.LeafPlan]]:
    """One :class:`LeafPlan` per leaf of ``params`` (``None``: Adam)."""
    return plan_lib.leaf_plans(params, self.dimension_numbers,
                               self.update_scale, self.update_topk,
                               self.implementation)

  def transformation(self) -> optax.GradientTransformationExtraArgs:
    """The ``optax.partition`` of the pieces; its ``update`` is a
    :class:`TacoUpdate` of these parts."""
    partition = optax.partition(
        transforms={
            TACO_LABEL: branch.taco_branch(
                scale.TacoDirection(self.direction, self.direction_plans,
                                    self.mu, self.k),
                self.learning_rate, self.rounding, self.rounding_seed),
            ADAM_LABEL: self.adam,
        },
        param_labels=self.param_labels,
    )

    def update_fn(updates, state, params=None, **extra_args):
      updates, params = inputs.checked(updates, params)
      return partition.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(
        partition.init, TacoUpdate(update_fn, self))


@dataclasses.dataclass(frozen=True, eq=False)
class TacoUpdate:
  """The ``update`` of the transformation :func:`taco` returns, and the
  :class:`TacoParts` it applies (for :func:`parts_of`).

  Called as optax calls an update function. The transformation is a plain
  ``optax.GradientTransformationExtraArgs`` (``chain``, ``nnx.Optimizer``
  and ``MultiSteps`` take it as any other); one with another ``update`` has
  no parts.
  """
  fn: Callable[..., tuple[Any, Any]]
  parts: TacoParts

  def __call__(self, updates: Any, state: Any, params: Any = None,
               **extra_args: Any) -> tuple[Any, Any]:
    return self.fn(updates, state, params, **extra_args)


def replace_init(optimizer: optax.GradientTransformation,
                 init: Callable[[Any], Any]) -> optax.GradientTransformation:
  """``optimizer`` with another ``init`` (the same state); the ``update``
  of a :func:`taco` keeps its parts."""
  return optimizer._replace(init=init)


def _branch(opt_state: Any) -> tuple[dict[str, Any], Any]:
  """The TACO branch's states by piece name, and the Adam branch's state."""
  inner = opt_state.inner_states
  chained = inner[TACO_LABEL].inner_state
  return dict(zip(TACO_PIECES, chained)), inner[ADAM_LABEL].inner_state


def taco_states(opt_state: Any) -> TacoStates:
  """The pieces' states inside ``taco(...).init(params)``."""
  pieces, adam = _branch(opt_state)
  return TacoStates(adam=adam, **pieces)


def with_taco_states(opt_state: Any, states: TacoStates) -> Any:
  """``opt_state`` of :func:`taco` with its pieces' states replaced."""
  inner = opt_state.inner_states
  pieces, _ = _branch(opt_state)
  chained = tuple(getattr(states, name) for name in TACO_PIECES
                  if name in pieces)
  return opt_state._replace(inner_states={
      TACO_LABEL: inner[TACO_LABEL]._replace(inner_state=chained),
      ADAM_LABEL: inner[ADAM_LABEL]._replace(inner_state=states.adam),
  })


# What to do instead of a wrapper around taco(...), by the function optax
# builds it with (the head of its update function's __qualname__).
_INSTEAD = {
    'chain': ('for optax.clip_by_global_norm(c) in front, pass taco(...) and '
              'clip_global_norm=c; give a learning-rate schedule to '
              'taco(learning_rate=schedule) itself; optimizers other than '
              'TACO (optax.adamw is a chain too) have no layer-wise step.'),
    'inject_hyperparams': (
        'give a learning-rate schedule to taco(learning_rate=schedule) '
        'itself: an injected taco is rebuilt at every step, which the '
        'layer-wise step cannot do.'),
    'MultiSteps': 'pass taco(...) itself, with accumulation_steps=A.',
    'apply_if_finite': (
        'pass taco(...) itself: a non-finite gradient already leaves the '
        'history intact and makes the offending weights NaN; skip the step '
        'on the loss or the new params.'),
}
_ITSELF = 'pass the transformation taco_optax.taco(...) returns.'


def _wrapper(optimizer: Any) -> tuple[str, str]:
  """``(what optimizer is, what to do instead)`` for a transformation that
  is not ``taco(...)`` itself."""
  update = getattr(optimizer, 'update', None)
  if not callable(update):
    return f'{type(optimizer).__name__}, not an optax transformation', _ITSELF
  head = (getattr(update, '__qualname__', '') or '').split('.')[0]
  module = (getattr(update, '__module__', '') or '').split('.')[0]
  name = f'{module}.{head}' if module and head else head or repr(update)
  return f'a transformation built by {name}', _INSTEAD.get(head, _ITSELF)


def parts_of(optimizer: optax.GradientTransformation,
             user: str = 'The layer-wise step') -> TacoParts:
  """The :class:`TacoParts` of the transformation :func:`taco` returned.

  The one place that reads a ``taco(...)``'s parts back: the layer-wise
  step (:func:`taco_optax.layerwise.train_step`), tunix's
  ``LayerwisePeftTrainer`` and :func:`taco_optax.routing_report` call it.
  Only ``taco(...)`` itself (or :func:`taco_optax.nnx.for_nnx_optimizer` of
  it) has parts: the step applies each piece itself, so it cannot run a
  piece it does not know, such as a chain's first link.

  Args:
    optimizer: the transformation.
    user: who needs the parts, for the message.

  Raises:
    ValueError: for anything else, naming what wraps it (``optax.chain``,
      ``optax.inject_hyperparams``, ``optax.MultiSteps``, ...) and what to do
      instead.
  """
  update = getattr(optimizer, 'update', None)
  if isinstance(update, TacoUpdate):
    return update.parts
  what, instead = _wrapper(optimizer)
  raise ValueError(
      f'{user} applies the pieces of taco_optax.taco(...) itself and needs '
      f'that transformation, unwrapped; got {what}. Instead, {instead}')
