"""Every ``--optimizer`` entry trains a tiny model through the same loop."""

import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.finetune import data
from examples.finetune import flags
from examples.finetune import optimizers
from examples.finetune import trainers
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as model_lib
import taco_optax
from tests.support import tiers


@pytest.mark.parametrize('name', tiers.first_fast(
    sorted(optimizers.OPTIMIZERS), fast=['adamw', 'taco']))
def test_optimizer_lowers_the_loss_of_a_fixed_batch(name):
  config = config_lib.ModelConfig.tiny('llama')
  model = model_lib.DecoderLM(config, dtype=jnp.float32,
                              param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  batch = data.collate([data.TokenizedExample(tuple(rng.integers(3, 96, 6)),
                                              (7, 8)) for _ in range(4)],
                       seq_len=10)
  spec = optimizers.get(name)
  hints = optimizers.ModelHints(model_lib.taco_dimension_numbers,
                                model_lib.taco_update_scale,
                                config.vocab_size)
  tx = spec.build(optimizers.linear_schedule(1e-2, 8, 0), hints)
  trainer = trainers.NnxTrainer(model, tx, spec.needs_loss)
  losses = [float(trainer.step(batch)) for _ in range(6)]
  assert np.all(np.isfinite(losses))
  assert losses[-1] < losses[0], losses
  assert trainer.optimizer_state_bytes() > 0


def test_unknown_optimizer():
  with pytest.raises(ValueError, match='unknown optimizer'):
    optimizers.get('sgd')


def test_linear_schedule_warms_up_then_decays_to_zero():
  schedule = optimizers.linear_schedule(1.0, steps=10, warmup_steps=2)
  values = [float(schedule(t)) for t in (0, 1, 2, 6, 10)]
  np.testing.assert_allclose(values, [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)


@pytest.mark.parametrize('taco_step', tiers.first_fast(['layerwise', 'optax']))
def test_taco_flags_reach_the_trainer(taco_step):
  """--taco-k/--taco-mu build the same TACO on either step path."""
  config = config_lib.ModelConfig.tiny('llama')
  new_model = lambda: model_lib.DecoderLM(
      config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  batch = data.collate([data.TokenizedExample(tuple(rng.integers(3, 96, 6)),
                                              (7, 8)) for _ in range(4)],
                       seq_len=10)
  schedule = optimizers.linear_schedule(1e-2, 4, 0)
  hints = optimizers.decoder_hints(config)
  run = flags.RunConfig(taco_k=4, taco_mu=0.5, taco_step=taco_step)
  trainer = trainers.make_trainer(run, new_model(), optimizers.get(
      'taco').build(schedule, hints, run.taco))
  reference = trainers.NnxTrainer(new_model(), taco_optax.taco(
      schedule, k=4, mu=0.5,
      weight_dimension_numbers=model_lib.taco_dimension_numbers,
      update_scale=model_lib.taco_update_scale), needs_loss=False)
  paper = trainers.NnxTrainer(new_model(), optimizers.get('taco').build(
      schedule, hints), needs_loss=False)
  # k = 4 history entries per column instead of the paper's 16.
  counter = 4 if taco_step == 'optax' else 0  # nnx.Optimizer's step
  assert (trainer.optimizer_state_bytes() ==
          reference.optimizer_state_bytes() - 4 + counter)
  assert reference.optimizer_state_bytes() < paper.optimizer_state_bytes()
  for _ in range(2):
    np.testing.assert_allclose(trainer.step(batch), reference.step(batch),
                               rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               nnx.state(trainer.model, nnx.Param),
               nnx.state(reference.model, nnx.Param))


@pytest.mark.parametrize('name', sorted(optimizers.OPTIMIZERS))
def test_default_rate_follows_the_budget_rule(name):
  spec = optimizers.get(name)
  rule = spec.rule
  assert spec.default_rate(40).lr == float(f'{rule.reference:.2g}')
  for steps in (10, 20, 40):  # swept range
    rate = spec.default_rate(steps)
    exact = rule.reference * (40 / steps) ** rule.steps_exponent
    assert rate.lr == pytest.approx(exact, rel=0.05)
    assert rate.why.startswith(f'budget rule: {rule.reference:g} x '
                               f'(40/{steps})^')
    assert rule.source in rate.why
  # Not extrapolated: outside the swept steps the rate is the rate at the
  # nearest swept budget (or moves to the long-run anchor).
  assert spec.default_rate(2) == spec.default_rate(10)._replace(
      why=spec.default_rate(2).why)
  if rule.long_run is None:
    assert spec.default_rate(5000).lr == spec.default_rate(40).lr


def test_taco_reaches_the_papers_rate_at_its_budget():
  taco = optimizers.get('taco')
  assert taco.default_rate(2000).lr == 3e-5
  assert taco.default_rate(16000).lr == 3e-5
  # Past 40 steps: log-linear in log steps through the measured budgets'
  # rates, then to the paper's; past the last point it stays there.
  knots = [(40, taco.default_rate(40).lr), *taco.rule.measured, (2000, 3e-5)]
  for (start, start_lr), (end, end_lr) in zip(knots, knots[1:]):
    assert taco.default_rate(end).lr == pytest.approx(end_lr, rel=0.02)
    middle_steps = round((start * end) ** 0.5)
    middle = taco.default_rate(middle_steps)
    assert middle.lr == pytest.approx((start_lr * end_lr) ** 0.5, rel=0.05)
    assert (f'of the way (log steps) from {start_lr:g} at {start} to '
            f'{end_lr:g} at {end} steps') in middle.why


def test_budget_rule_passes_through_its_measured_budgets():
  rule = optimizers.BudgetRule(1e-3, 0.0, 'test', long_run=(1000, 1e-5),
                               measured=((100, 1e-4), (200, 1e-3)))
  assert [rule.rate(s).lr for s in (40, 100, 200, 1000, 5000)] == [
      1e-3, 1e-4, 1e-3, 1e-5, 1e-5]
  assert rule.rate(150).lr == pytest.approx(
      1e-4 * 10 ** (math.log(1.5) / math.log(2)), rel=0.02)  # 2 digits
  without_long = optimizers.BudgetRule(1e-3, 0.0, 'test',
                                       measured=((100, 1e-4),))
  assert without_long.rate(5000).lr == 1e-4
