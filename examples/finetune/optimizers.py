"""The ``--optimizer`` registry: TACO and optax's own peers, one flag apart.

Every entry takes the same arguments (learning-rate schedule, what the model
tells an optimizer, TACO's own settings) and returns an
:class:`optax.GradientTransformation`, so the training loop never branches on
the optimizer.

Default learning rates depend on the number of steps: ``rate = reference *
(40 / steps) ** steps_exponent``, the peak of the example's warm-up +
linear-decay schedule. TACO's and AdamW's 40-step references are fitted over
seeds on three tasks (``docs/measured/multiclass.md``, ``python -m
benchmarks.multiclass_runs``); their exponents carry them to the 10-step rates
of the sweep in ``docs/measured/learning_rate.md`` (two real tasks, three
budgets, ``python -m benchmarks.lr_sweep``), which found no effect of the
batch size (the same best rate at 10 x 4 and 10 x 16), so the batch does not
enter the rule; the other optimizers keep their papers' rate relative to
AdamW and scale with AdamW's exponent (not swept).
"""

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import optax
from optax import contrib

from examples.finetune.model import decoder as decoder_lib
import taco_optax

# The steps every reference rate is given at: the CLI's default run.
REFERENCE_STEPS = 40
# The steps the sweep measured; the power law is not extrapolated past them.
SWEPT_STEPS = (10, 40)


class DefaultRate(NamedTuple):
  """A budget's default peak learning rate and where it comes from."""
  lr: float
  why: str


def _clip(value: float, bounds: tuple[float, float]) -> float:
  return min(max(value, bounds[0]), bounds[1])


@dataclasses.dataclass(frozen=True)
class BudgetRule:
  """``lr = reference * (40 / steps) ** steps_exponent`` on the swept steps.

  Outside 10-40 steps the power law is not extrapolated: below, ``steps`` is
  clipped to 10; beyond 40 the rate passes through the rates ``measured`` at
  longer budgets and then to ``long_run`` (a long budget's known rate, e.g.
  the paper's 3e-5 at 2000 steps), log-linearly in ``steps`` between two
  such points, and stays at the last one; with neither it stays at the
  40-step rate.

  Attributes:
    reference: the rate at 40 steps (at any batch size).
    steps_exponent: how fast the rate falls with more steps (10-40).
    source: where the numbers come from.
    long_run: optional ``(steps, rate)`` of a long budget.
    measured: ``(steps, rate)`` fitted at budgets between 40 steps and
      ``long_run``, in increasing steps.
  """
  reference: float
  steps_exponent: float
  source: str
  long_run: Optional[tuple[int, float]] = None
  measured: tuple[tuple[int, float], ...] = ()

  def rate(self, steps: int) -> DefaultRate:
    """The peak learning rate of a ``steps``-step run, and why."""
    swept_steps = _clip(steps, SWEPT_STEPS)
    lr = (self.reference
          * (REFERENCE_STEPS / swept_steps) ** self.steps_exponent)
    why = (f'budget rule: {self.reference:g} x (40/{swept_steps})^'
           f'{self.steps_exponent:g}')
    knots = [(REFERENCE_STEPS, self.reference), *self.measured,
             *([self.long_run] if self.long_run is not None else [])]
    segments = list(zip(knots, knots[1:]))
    for i, ((start, start_lr), (end, end_lr)) in enumerate(segments):
      if start < steps and (steps <= end or i == len(segments) - 1):
        share = min(1.0, math.log(steps / start) / math.log(end / start))
        lr = start_lr * (end_lr / start_lr) ** share
        why += (f', then {share:.0%} of the way (log steps) from '
                f'{start_lr:g} at {start} to {end_lr:g} at {end} steps')
    return DefaultRate(float(f'{lr:.2g}'), f'{why}; {self.source}')


class Rounding(NamedTuple):
  """How updates of 16-bit parameters are rounded.

  Attributes:
    mode: ``'stochastic'`` (unbiased: every update lands on average) or
      ``'nearest'`` (``optax.apply_updates``). Parameters of other dtypes are
      updated exactly either way.
    seed: the seed of stochastic rounding's random bits.
  """
  mode: str = 'stochastic'
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """How to build one optimizer.

  Attributes:
    name: the ``--optimizer`` value.
    rule: its default learning rate as a function of the budget.
    factory: ``(schedule, hints, taco settings) -> GradientTransformation``;
      with ``rounds_itself``, also the :class:`Rounding`.
    needs_loss: the update needs ``obj_fn`` (Sophia's Hessian estimate).
    rounds_itself: the factory rounds 16-bit parameters itself (TACO);
      the others end with ``taco_optax.stochastic_rounding`` when asked.
  """
  name: str
  rule: BudgetRule
  factory: Callable[..., optax.GradientTransformation]
  needs_loss: bool = False
  rounds_itself: bool = False

  def default_rate(self, steps: int) -> DefaultRate:
    """The peak learning rate when ``--lr`` is not given, and why."""
    return self.rule.rate(steps)

  def build(self, schedule: optax.ScalarOrSchedule, hints: 'ModelHints',
            taco: Optional['TacoSettings'] = None,
            rounding: Optional[Rounding] = None
            ) -> optax.GradientTransformation:
    """The transformation.

    Args:
      schedule: the learning rate.
      hints: what the model tells the optimizer.
      taco: TACO's settings (default: the paper's); only TACO reads them.
      rounding: how 16-bit parameters are updated; ``None``: each
        optimizer's own default (TACO's stochastic rounding, optax's round
        to nearest).
    """
    taco = TacoSettings() if taco is None else taco
    if self.rounds_itself:
      return self.factory(schedule, hints, taco,
                          Rounding() if rounding is None else rounding)
    tx = self.factory(schedule, hints, taco)
    if rounding is not None and rounding.mode == 'stochastic':
      tx = optax.chain(tx, taco_optax.stochastic_rounding(rounding.seed))
    return tx


@dataclasses.dataclass(frozen=True)
class ModelHints:
  """What an optimizer may want to know about the model.

  Attributes:
    taco_dimension_numbers: params -> tree of ``TacoDimensionNumbers``/None.
    taco_update_scale: params -> tree of per-leaf TACO scales (or None).
    vocab_size: rows of the token embedding; matrices with a dimension this
      large (embedding, LM head) stay with AdamW in Muon and GaLore, whose
      per-step matrix work on a 49k-row matrix would dominate the step.
  """
  taco_dimension_numbers: Any = None
  taco_update_scale: Any = None
  vocab_size: Optional[int] = None


def decoder_hints(model_config) -> ModelHints:
  """The hints of an example ``decoder.DecoderLM`` of ``model_config``."""
  return ModelHints(
      taco_dimension_numbers=decoder_lib.taco_dimension_numbers,
      taco_update_scale=decoder_lib.taco_update_scale,
      vocab_size=model_config.vocab_size)


@dataclasses.dataclass(frozen=True)
class TacoSettings:
  """TACO's own settings (``--taco-k``, ``--taco-mu``; Top-r for ablations).

  Attributes:
    k: history entries per column; ``None`` keeps a dense history.
    mu: history decay in ``[0, 1)``.
    update_topk: signs per column in each update (``None``: 1, TACO).
  """
  k: Optional[int] = 16
  mu: float = 0.95
  update_topk: Optional[int] = None


def linear_schedule(peak_lr: float, steps: int,
                    warmup_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to ``peak_lr``, then linear decay to 0 at ``steps``.
  """
  warmup_steps = max(0, min(warmup_steps, steps))
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak_lr, max(warmup_steps, 1)),
       optax.linear_schedule(peak_lr, 0.0, max(steps - warmup_steps, 1))],
      boundaries=[warmup_steps])


def _is_vocab_matrix(leaf, vocab_size):
  return vocab_size is not None and vocab_size in getattr(leaf, 'shape', ())


def _matrix_dims(dims_type, hints):
  def dims(params):
    return jax.tree.map(
        lambda x: dims_type() if decoder_lib.is_matrix(x) and not
        _is_vocab_matrix(x, hints.vocab_size) else None, params)
  return dims


def taco_optimizer(schedule, hints: ModelHints, taco: TacoSettings,
                   rounding: Rounding = Rounding()
                   ) -> optax.GradientTransformation:
  """``taco_optax.taco`` for a model, settings and rounding.

  Both paths of the example (``taco_optax.layerwise.train_step`` takes the
  transformation itself) and the benchmarks build TACO here.
  """
  return taco_optax.taco(schedule, k=taco.k, mu=taco.mu,
                         update_topk=taco.update_topk,
                         weight_dimension_numbers=hints.taco_dimension_numbers,
                         update_scale=hints.taco_update_scale,
                         rounding=rounding.mode, rounding_seed=rounding.seed)


def _adamw(schedule, hints, taco):
  del hints, taco
  return optax.adamw(schedule, weight_decay=0.0)


def _adafactor(schedule, hints, taco):
  del hints, taco
  # An explicit learning rate with no parameter-scale factor, as HF's
  # fine-tuning recipe does, so the schedule means what it says.
  return optax.adafactor(schedule, multiply_by_parameter_scale=False)


def _lion(schedule, hints, taco):
  del hints, taco
  return optax.lion(schedule, weight_decay=0.0)


def _muon(schedule, hints, taco):
  del taco
  # consistent_rms=0.2 matches AdamW's update RMS (Moonlight), so Muon runs at
  # an AdamW learning rate on a model pretrained with AdamW.
  return contrib.muon(
      schedule, consistent_rms=0.2,
      muon_weight_dimension_numbers=_matrix_dims(contrib.MuonDimensionNumbers,
                                                 hints))


def _sophia(schedule, hints, taco):
  del hints, taco
  return contrib.sophia(schedule)


def _galore(schedule, hints, taco):
  del taco
  return contrib.galore(
      schedule, rank=128, update_proj_gap=200,
      weight_dimension_numbers=_matrix_dims(contrib.GaLoreDimensionNumbers,
                                            hints))


# The budget rules: a 40-step rate chosen over three seeds on three tasks'
# validation sets, a steps exponent to the sweep's 10-step rate, no batch
# term, and past 40 steps (TACO) the paper's 3e-5 at 2000 steps. Where each
# constant comes from: docs/measured/multiclass_findings.md ("The budget
# rule's constants"); tests/test_lr_sweep.py ties them to the recorded runs.
_SOURCE = ('docs/measured/multiclass.md (40 steps, validation sets), '
           'docs/measured/learning_rate.md (10 steps)')
TACO_RULE = BudgetRule(5.6e-4, -0.41, _SOURCE,
                       long_run=(2000, 3e-5))  # the paper's rate at 2000 steps
ADAMW_RULE = BudgetRule(6.4e-5, -1.34, _SOURCE)


def _relative_to_adamw(factor: float, why: str) -> BudgetRule:
  return BudgetRule(ADAMW_RULE.reference * factor, ADAMW_RULE.steps_exponent,
                    f'{why}; AdamW\'s steps exponent (not swept)')


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec for spec in (
        OptimizerSpec('taco', TACO_RULE, taco_optimizer,
                      rounds_itself=True),
        OptimizerSpec('adamw', ADAMW_RULE, _adamw),
        OptimizerSpec('adafactor', _relative_to_adamw(
            1.0, 'AdamW\'s rate, no parameter scaling'), _adafactor),
        OptimizerSpec('lion', _relative_to_adamw(
            0.3, 'Lion paper: 3-10x below AdamW'), _lion),
        OptimizerSpec('muon', _relative_to_adamw(
            1.0, 'AdamW\'s rate with consistent_rms=0.2'), _muon),
        OptimizerSpec('sophia', _relative_to_adamw(
            1.0, 'optax defaults at AdamW\'s rate'), _sophia,
                      needs_loss=True),
        OptimizerSpec('galore', _relative_to_adamw(
            1.0, 'GaLore paper: rank 128, projection every 200'), _galore),
    )
}


def get(name: str) -> OptimizerSpec:
  if name not in OPTIMIZERS:
    raise ValueError(f'unknown optimizer {name!r}; choose from '
                     f'{", ".join(OPTIMIZERS)}')
  return OPTIMIZERS[name]

