"""Every ``--optimizer`` entry trains a tiny model through the same loop."""

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from examples.finetune import config as config_lib
from examples.finetune import data
from examples.finetune import model as model_lib
from examples.finetune import optimizers
from examples.finetune import trainers


@pytest.mark.parametrize('name', sorted(optimizers.OPTIMIZERS))
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
