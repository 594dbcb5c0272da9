"""The layer-wise TACO step on DecoderLM equals the nnx.Optimizer path."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.finetune import config as config_lib
from examples.finetune import data
from examples.finetune import layerwise
from examples.finetune import losses
from examples.finetune import model as model_lib
from examples.finetune import optimizers
from examples.finetune import trainers


def _batch(vocab_size, seed=0):
  rng = np.random.default_rng(seed)
  examples = [data.TokenizedExample(tuple(rng.integers(3, vocab_size, n)),
                                    tuple(rng.integers(3, vocab_size, 2)))
              for n in (5, 9, 3, 7)]
  return data.collate(examples, seq_len=12)


def _model(family, scan_layers):
  config = config_lib.ModelConfig.tiny(family)
  return model_lib.DecoderLM(config, dtype=jnp.float32,
                             param_dtype=jnp.float32, scan_layers=scan_layers,
                             rngs=nnx.Rngs(0))


def _hints(config):
  return optimizers.ModelHints(model_lib.taco_dimension_numbers,
                               model_lib.taco_update_scale, config.vocab_size)


@pytest.mark.parametrize('family,scan_layers', [
    ('llama', False), ('qwen3', False), ('opt', False), ('llama', True)])
def test_layered_loss_equals_model_loss(family, scan_layers):
  model = _model(family, scan_layers)
  batch = _batch(model.config.vocab_size)
  layered = layerwise.layered_model(model, losses.batch_loss)
  np.testing.assert_allclose(layered.loss(layered.params, batch),
                             losses.completion_loss(model, batch), rtol=1e-5)
  choices = data.collate_choices(
      [data.ChoiceExample((5, 6, 7), (10, 11), 1),
       data.ChoiceExample((8,), (10, 11), 0)], seq_len=6)
  np.testing.assert_allclose(layered.loss(layered.params, choices),
                             losses.completion_loss(model, choices), rtol=1e-5)


@pytest.mark.parametrize('family', ['llama', 'qwen3'])
def test_layerwise_steps_equal_optax_path(family):
  batches = [_batch(96, seed) for seed in range(2)]
  schedule = optimizers.linear_schedule(1e-2, 4, 1)
  reference = _model(family, False)
  spec = optimizers.get('taco')
  plain = trainers.NnxTrainer(reference, spec.build(schedule,
                                                    _hints(reference.config)),
                              needs_loss=False)
  lean_model = _model(family, False)
  lean = trainers.LayerwiseTacoTrainer(lean_model, schedule,
                                       _hints(lean_model.config))
  for batch in batches:
    np.testing.assert_allclose(lean.step(batch), plain.step(batch),
                               rtol=1e-5)
  expected = nnx.state(reference, nnx.Param)
  actual = nnx.state(lean_model, nnx.Param)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               actual, expected)
  # Both paths really moved the weights.
  assert not np.allclose(nnx.state(_model(family, False),
                                   nnx.Param)['embed']['embedding'][...],
                         actual['embed']['embedding'][...])
  # The same optax state; nnx.Optimizer adds its own int32 step counter.
  assert lean.optimizer_state_bytes() == plain.optimizer_state_bytes() - 4
