"""TACO in tunix: PeftTrainer with taco(...), and the LayerwisePeftTrainer.

Needs ``pip install "taco_optax[tunix]"`` (the test extra installs it).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip('tunix')

from flax import nnx  # pylint: disable=g-import-not-at-top
from tunix.sft import peft_trainer  # pylint: disable=g-import-not-at-top

from benchmarks import tunix_models  # pylint: disable=g-import-not-at-top
import taco_optax  # pylint: disable=g-import-not-at-top
from taco_optax._src.integrations import tunix_model as _tunix_model  # pylint: disable=g-import-not-at-top
from taco_optax import tunix as taco_tunix  # pylint: disable=g-import-not-at-top
from tests import docs_pages  # pylint: disable=g-import-not-at-top



@pytest.fixture(autouse=True)
def _tunix_flags():
  with tunix_models.tunix_flags():
    yield


MODELS = {
    'qwen3': lambda: tunix_models.qwen3(),
    'qwen3_tied': lambda: tunix_models.qwen3(tied=True),
    'qwen3_remat': lambda: tunix_models.qwen3(remat='DECODER'),
    'llama3': lambda: tunix_models.llama3(),
    'gemma3': lambda: tunix_models.gemma3(),
}


def _config(steps, **kwargs):
  return peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=steps,
                                     pbar_description=None, **kwargs)


def _train(trainer_class, model, steps, data, optimizer=None, **config):
  optimizer = optimizer or tunix_models.taco(model)
  trainer = trainer_class(model, optimizer, _config(steps, **config))
  trainer = trainer.with_gen_model_input_fn(tunix_models.model_input)
  trainer.train(data)
  return trainer


def _losses(trainer):
  return np.asarray(trainer.metrics_logger.get_metric_history(
      '', 'loss', 'train'))


def _leaves(trainer):
  return jax.tree.leaves((nnx.as_pure(nnx.state(trainer.model, nnx.Param)),
                          nnx.as_pure(trainer.optimizer.opt_state)))


@pytest.mark.parametrize('name', sorted(MODELS))
def test_layered_loss_is_tunix_default_loss(name):
  model = MODELS[name]()
  inputs = tunix_models.model_input(tunix_models.batches(1)[0])
  layered = _tunix_model.layered(model)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  ours = layered.loss(layered.relayout.forward(params), inputs)
  theirs = peft_trainer._default_loss_fn(model, **inputs)  # pylint: disable=protected-access
  np.testing.assert_allclose(ours, theirs, rtol=2e-6)


@pytest.mark.parametrize('name', sorted(MODELS))
def test_layerwise_trainer_matches_peft_trainer(name):
  data = tunix_models.batches(4)
  peft = _train(peft_trainer.PeftTrainer, MODELS[name](), 4, data)
  ours = _train(taco_tunix.LayerwisePeftTrainer, MODELS[name](), 4, data)
  np.testing.assert_allclose(_losses(ours), _losses(peft), rtol=1e-5)
  theirs = _leaves(peft)
  for mine, other in zip(_leaves(ours), theirs, strict=True):
    if jnp.issubdtype(mine.dtype, jnp.integer):  # TACO's winners' rows
      np.testing.assert_array_equal(mine, other)
    else:
      np.testing.assert_allclose(np.asarray(mine, np.float32),
                                 np.asarray(other, np.float32), atol=1e-5)


def test_layerwise_trainer_compiles_once():
  trainer = _train(taco_tunix.LayerwisePeftTrainer, MODELS['qwen3'](), 3,
                   tunix_models.batches(3))
  train_step, _ = trainer.jit_train_and_eval_step()
  assert train_step.func.jitted_fn._cache_size() == 1  # pylint: disable=protected-access


def _state_after(tmp_path, trainer_class, steps, data):
  trainer = _train(trainer_class, MODELS['qwen3'](), steps, data,
                   checkpoint_root_directory=str(tmp_path))
  return trainer


def _assert_same(trainer, other, exact=True):
  for mine, theirs in zip(_leaves(trainer), _leaves(other), strict=True):
    if exact or jnp.issubdtype(mine.dtype, jnp.integer):
      np.testing.assert_array_equal(np.asarray(mine, np.float32),
                                    np.asarray(theirs, np.float32))
    else:
      np.testing.assert_allclose(np.asarray(mine, np.float32),
                                 np.asarray(theirs, np.float32), atol=1e-5)


def test_layerwise_checkpoint_resumes_in_peft_trainer(tmp_path):
  """The other way round: PeftTrainer continues a layer-wise checkpoint."""
  data = tunix_models.batches(4)
  straight = _train(taco_tunix.LayerwisePeftTrainer, MODELS['qwen3'](), 4,
                    data)
  _state_after(tmp_path, taco_tunix.LayerwisePeftTrainer, 2, data)
  resumed = _state_after(tmp_path, peft_trainer.PeftTrainer, 4, data)
  assert resumed.train_steps == 4
  assert len(_losses(resumed)) == 2  # restored at 2, not trained afresh
  _assert_same(resumed, straight, exact=False)


@pytest.mark.parametrize('first', ['LayerwisePeftTrainer', 'PeftTrainer'])
def test_checkpoint_resumes(tmp_path, first):
  """Two steps, a tunix checkpoint, two more = four straight, bit for bit;
  from a PeftTrainer checkpoint (same state layout) up to the float order of
  PeftTrainer's first two steps."""
  data = tunix_models.batches(4)
  straight = _train(taco_tunix.LayerwisePeftTrainer, MODELS['qwen3'](), 4,
                    data)
  first_class = (taco_tunix.LayerwisePeftTrainer
                 if first == 'LayerwisePeftTrainer'
                 else peft_trainer.PeftTrainer)
  _state_after(tmp_path, first_class, 2, data)
  resumed = _state_after(tmp_path, taco_tunix.LayerwisePeftTrainer, 4, data)
  assert resumed.train_steps == 4
  assert len(_losses(resumed)) == 2  # restored at 2, not trained afresh
  _assert_same(resumed, straight, exact=first_class is not
               peft_trainer.PeftTrainer)


def _taco_winners(trainer):
  state = nnx.as_pure(trainer.optimizer.opt_state)
  state = getattr(state, 'inner_opt_state', state)  # optax.MultiSteps
  return taco_optax._src.transform.parts.taco_states(state).direction.indices  # pylint: disable=protected-access


def test_accumulation_is_fused_and_matches_multisteps(caplog):
  """gradient_accumulation_steps=2 in the layer-wise step (no warning, no
  MultiSteps buffer) = PeftTrainer's MultiSteps on the same 4 batches."""
  data = tunix_models.batches(4)
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    ours = _train(taco_tunix.LayerwisePeftTrainer, MODELS['qwen3'](), 2,
                  data, gradient_accumulation_steps=2)
  assert not [r for r in caplog.records if r.name == 'taco_optax']
  assert ours.train_steps == 2
  peft = _train(peft_trainer.PeftTrainer, MODELS['qwen3'](), 2, data,
                gradient_accumulation_steps=2)
  np.testing.assert_allclose(_losses(ours), _losses(peft), rtol=1e-5)
  chex_like = zip(jax.tree.leaves(_taco_winners(ours)),
                  jax.tree.leaves(_taco_winners(peft)), strict=True)
  for mine, theirs in chex_like:
    np.testing.assert_array_equal(mine, theirs)
  for mine, theirs in zip(
      jax.tree.leaves(nnx.as_pure(nnx.state(ours.model, nnx.Param))),
      jax.tree.leaves(nnx.as_pure(nnx.state(peft.model, nnx.Param))),
      strict=True):
    np.testing.assert_allclose(mine, theirs, atol=1e-5)
  state_bytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(
      nnx.as_pure(t.optimizer.opt_state)))
  params_bytes = sum(x.nbytes for x in jax.tree.leaves(
      nnx.as_pure(nnx.state(ours.model, nnx.Param))))
  # MultiSteps holds a float32 gradient-sized accumulator; the fused step not.
  assert state_bytes(peft) - state_bytes(ours) >= params_bytes


def test_accumulation_with_a_later_custom_loss_is_refused():
  model = MODELS['qwen3']()
  trainer = taco_tunix.LayerwisePeftTrainer(
      model, tunix_models.taco(model),
      _config(1, gradient_accumulation_steps=2))
  trainer.with_loss_fn(lambda model, **inputs: jnp.zeros(()))
  with pytest.raises(ValueError, match='use PeftTrainer for this loss'):
    trainer.create_train_step_fn()


def test_custom_loss_falls_back_with_its_reason(caplog):
  model = MODELS['qwen3']()
  trainer = taco_tunix.LayerwisePeftTrainer(model, tunix_models.taco(model),
                                            _config(1))
  trainer.with_loss_fn(lambda model, **inputs: jnp.zeros(()))
  assert 'with_loss_fn' in trainer.fallback_reason()
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    trainer.create_train_step_fn()
  assert 'with_loss_fn' in caplog.text


def test_refuses_an_optimizer_that_is_not_taco():
  with pytest.raises(ValueError, match="tunix's PeftTrainer for other"):
    taco_tunix.LayerwisePeftTrainer(MODELS['qwen3'](), optax.adamw(1e-3),
                                    _config(1))
  model = MODELS['qwen3']()
  chained = optax.chain(optax.clip_by_global_norm(1.0),
                        tunix_models.taco(model))
  with pytest.raises(ValueError, match='unwrapped'):
    taco_tunix.LayerwisePeftTrainer(MODELS['qwen3'](), chained, _config(1))


def test_unsupported_model_is_named():
  class Plain(nnx.Module):

    def __init__(self):
      self.dense = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

  assert 'has no `embedder`' in _tunix_model.unsupported(Plain())
  with pytest.raises(ValueError, match='cannot split this model'):
    _tunix_model.layered(Plain())


def test_peft_trainer_recipe_routes_attention_to_taco():
  """docs/with_tunix.md's recipe: every rank >= 2 weight has a TACO history."""
  model = MODELS['qwen3']()
  trainer = peft_trainer.PeftTrainer(model, tunix_models.taco(model),
                                     _config(1))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  states = taco_optax._src.transform.parts.taco_states(  # pylint: disable=protected-access
      nnx.as_pure(trainer.optimizer.opt_state))
  for param, values in zip(jax.tree.leaves(params),
                           jax.tree.leaves(states.direction.values,
                                           is_leaf=lambda x: isinstance(
                                               x, optax.MaskedNode)),
                           strict=True):
    assert isinstance(values, optax.MaskedNode) == (param.ndim < 2)


def test_with_tunix_page_example_runs():
  block = docs_pages.block('docs/with_tunix.md', 'LayerwisePeftTrainer')
  namespace = {}
  exec(block, namespace)  # pylint: disable=exec-used
  trainer = namespace['trainer']
  assert trainer.train_steps == 2
  assert np.isfinite(_losses(trainer)).all()
  report = taco_optax.routing_report(namespace['tx'],
                                     nnx.state(trainer.model, nnx.Param))
  taco_paths = {row.path for row in report.taco_rows}
  ranks = {row.path: len(row.shape) for row in report.rows}
  assert taco_paths == {path for path, rank in ranks.items() if rank >= 2}
  assert any('q_proj' in path for path in taco_paths)
