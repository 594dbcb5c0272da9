"""TACO in tunix: PeftTrainer with taco(...), and the LayerwisePeftTrainer.

Needs ``pip install "taco_optax[tunix]"`` (the test extra installs it).
"""

import inspect
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
from taco_optax import tunix as taco_tunix  # pylint: disable=g-import-not-at-top
from taco_optax._src.integrations import tunix_api as _tunix_api  # pylint: disable=g-import-not-at-top
from taco_optax._src.integrations import tunix_model as _tunix_model  # pylint: disable=g-import-not-at-top
from tests.support import docs_pages  # pylint: disable=g-import-not-at-top
from tests.support import tiers  # pylint: disable=g-import-not-at-top


@pytest.fixture(autouse=True)
def _tunix_flags():
  with tunix_models.tunix_flags():
    yield


# One model per path through the layer-wise trainer: an untied head, a tied
# one (the embedder's decode), tunix's own remat, local and global layers.
# Llama3 takes Qwen3's path (its routing: tests/test_nnx_routing.py).
MODELS = {
    'qwen3': lambda: tunix_models.qwen3(),
    'qwen3_tied': lambda: tunix_models.qwen3(tied=True),
    'qwen3_remat': lambda: tunix_models.qwen3(remat='DECODER'),
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


def _metric(trainer, name):
  return np.asarray(trainer.metrics_logger.get_metric_history(
      '', name, 'train'))


def _losses(trainer):
  return _metric(trainer, 'loss')


def _leaves(trainer):
  return jax.tree.leaves((nnx.as_pure(nnx.state(trainer.model, nnx.Param)),
                          nnx.as_pure(trainer.optimizer.opt_state)))


@pytest.mark.parametrize('name', tiers.first_fast(sorted(MODELS)))
def test_layerwise_trainer_matches_peft_trainer(name):
  data = tunix_models.batches(4)
  peft = _train(peft_trainer.PeftTrainer, MODELS[name](), 4, data)
  ours = _train(taco_tunix.LayerwisePeftTrainer, MODELS[name](), 4, data)
  # The first step's loss, from the same weights: the layered loss the step
  # is built from is tunix's default loss, to float order.
  np.testing.assert_allclose(_losses(ours)[0], _losses(peft)[0], rtol=2e-6)
  np.testing.assert_allclose(_losses(ours), _losses(peft), rtol=1e-5)
  # The global gradient norm, summed as the layer-wise step goes.
  np.testing.assert_allclose(_metric(ours, 'grad_norm'),
                             _metric(peft, 'grad_norm'), rtol=1e-5)
  assert len(_metric(ours, 'grad_norm')) and np.isfinite(
      _metric(ours, 'grad_norm')).all()
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


@pytest.mark.parametrize('first', tiers.first_fast(
    ['LayerwisePeftTrainer', 'PeftTrainer']))
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


def _params_of(trainer):
  return jax.tree.leaves(nnx.as_pure(nnx.state(trainer.model, nnx.Param)))


def _accumulation_bytes(trainer):
  """What the trainer keeps for accumulation between micro-batches:
  0.1.7's ``MultiSteps`` state, 0.1.8's ``GradientAccumulator``."""
  state = nnx.as_pure(trainer.optimizer.opt_state)
  kept = [getattr(state, 'acc_grads', None)]
  kept.append(getattr(getattr(trainer, 'grad_accumulator', None), 'grads',
                      None))
  return sum(x.nbytes for x in jax.tree.leaves(nnx.as_pure(kept)))


def _assert_same_training(ours, theirs):
  np.testing.assert_allclose(_losses(ours), _losses(theirs), rtol=1e-5)
  for mine, other in zip(jax.tree.leaves(_taco_winners(ours)),
                         jax.tree.leaves(_taco_winners(theirs)), strict=True):
    np.testing.assert_array_equal(mine, other)
  for mine, other in zip(_params_of(ours), _params_of(theirs), strict=True):
    np.testing.assert_allclose(mine, other, atol=1e-5)


@pytest.mark.long
def test_accumulation_is_fused_and_matches_tunix_accumulator(caplog):
  """gradient_accumulation_steps=2 in the layer-wise step (no warning, no
  gradient-sized buffer) = PeftTrainer's own accumulator on the same 4
  (padded) batches: 0.1.7's MultiSteps, 0.1.8's token-weighted
  GradientAccumulator."""
  data = tunix_models.batches(4)
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    ours = _train(taco_tunix.LayerwisePeftTrainer, MODELS['qwen3'](), 2,
                  data, gradient_accumulation_steps=2)
  assert not [r for r in caplog.records if r.name == 'taco_optax']
  assert ours.train_steps == 2 and ours.fused_accumulation_steps == 2
  peft = _train(peft_trainer.PeftTrainer, MODELS['qwen3'](), 2, data,
                gradient_accumulation_steps=2)
  _assert_same_training(ours, peft)
  # tunix keeps a float32 gradient-sized accumulator; the fused step not.
  params_bytes = sum(x.nbytes for x in _params_of(ours))
  assert _accumulation_bytes(peft) >= params_bytes
  assert _accumulation_bytes(ours) == 0


def _concatenated(data, steps):
  return [jax.tree.map(lambda *xs: np.concatenate(xs), *data[i:i + steps])
          for i in range(0, len(data), steps)]


def _mean_loss(default):
  # Named arguments: tunix's step resolves the inputs to positions.
  def loss(model, input_tokens, input_mask, positions, attention_mask):
    out = default(model, input_tokens, input_mask, positions, attention_mask)
    return out.primary_loss.compute() if hasattr(out, 'primary_loss') else out
  return loss


@pytest.mark.long
@pytest.mark.parametrize('weights', ['tokens', 'equal'])
def test_micro_batch_weights(weights):
  """'tokens': the gradient of the group's summed loss over its tokens,
  which is PeftTrainer's on the group's batches concatenated. 'equal': the
  mean of the micro-batches' mean-loss gradients, which is PeftTrainer's
  accumulator on a loss returning the mean (0.1.7's default; 0.1.8 adds 1
  per micro-batch to its denominator then). The batches are padded to other
  lengths, so the two differ."""
  data = tunix_models.batches(4)
  model = MODELS['qwen3']()
  ours = taco_tunix.LayerwisePeftTrainer(
      model, tunix_models.taco(model),
      _config(2, gradient_accumulation_steps=2), micro_batch_weights=weights)
  ours.with_gen_model_input_fn(tunix_models.model_input).train(data)
  model = MODELS['qwen3']()
  if weights == 'tokens':
    theirs = peft_trainer.PeftTrainer(model, tunix_models.taco(model),
                                      _config(2))
    batches = _concatenated(data, 2)
  else:
    theirs = peft_trainer.PeftTrainer(
        model, tunix_models.taco(model),
        _config(2, gradient_accumulation_steps=2))
    theirs.with_loss_fn(_mean_loss(theirs.loss_fn))
    batches = data
  theirs.with_gen_model_input_fn(tunix_models.model_input).train(batches)
  _assert_same_training(ours, theirs)
  other = 'equal' if weights == 'tokens' else 'tokens'
  model = MODELS['qwen3']()
  different = taco_tunix.LayerwisePeftTrainer(
      model, tunix_models.taco(model),
      _config(2, gradient_accumulation_steps=2), micro_batch_weights=other)
  different.with_gen_model_input_fn(tunix_models.model_input).train(data)
  assert not np.allclose(_losses(different)[-1:], _losses(ours)[-1:],
                         rtol=1e-6, atol=0)


def test_micro_batch_weights_are_checked():
  model = MODELS['qwen3']()
  with pytest.raises(ValueError, match="'tokens', 'equal' or None"):
    taco_tunix.LayerwisePeftTrainer(model, tunix_models.taco(model),
                                    _config(1), micro_batch_weights='mean')


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


# What the trainer relies on in tunix, each checked with a message that says
# what changed (docs/tunix.md lists them).


def test_the_train_step_form_is_one_the_trainer_knows():
  model = MODELS['qwen3']()
  peft = peft_trainer.PeftTrainer(model, tunix_models.taco(model), _config(1))
  api = _tunix_api.check(peft.create_train_step_fn(),
                         _tunix_api.installed_version())
  assert api.step_parameters in (_tunix_api.STEP_0_1_7, _tunix_api.STEP_0_1_8)
  ours = taco_tunix.LayerwisePeftTrainer(model, tunix_models.taco(model),
                                         _config(1))
  # The layer-wise step takes what tunix's step takes (tunix calls it so).
  assert (tuple(inspect.signature(ours.create_train_step_fn()).parameters)
          == api.step_parameters)
  assert ours.donated_arguments == (
      ('model', 'optimizer', 'grad_accumulator') if api.accumulator
      else ('model', 'optimizer'))


def test_an_unknown_train_step_is_refused_naming_the_range():
  def step(model, optimizer, inputs, rng):
    del model, optimizer, inputs, rng
  with pytest.raises(ValueError, match=r'supports tunix 0\.1\.7 to 0\.1\.8.*'
                     r'\(model, optimizer, inputs, rng\)'):
    _tunix_api.check(step, '0.2.0')


def test_a_known_step_outside_the_range_warns(caplog):
  def step(model, optimizer, inputs):
    del model, optimizer, inputs
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    api = _tunix_api.check(step, '0.1.9')
  assert 'outside the tested range (tunix 0.1.7 to 0.1.8)' in caplog.text
  assert not api.accumulator
  caplog.clear()
  for version in ('0.1.7', '0.1.8', '0.1.8.dev0'):
    _tunix_api.check(step, version)
  assert not caplog.text


def test_the_extra_names_the_supported_range():
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  (pin,) = [r for r in importlib.metadata.requires('taco_optax')
            if r.startswith('google-tunix')]
  specifiers = set(pin.split(';')[0][len('google-tunix'):].replace(
      ' ', '').split(','))
  low, high = _tunix_api.SUPPORTED
  assert specifiers == {f'>={low}', f'<{high[:-1]}{int(high[-1]) + 1}'}, pin
  assert _tunix_api.in_range(_tunix_api.installed_version())


def test_the_tunix_surface_the_trainer_uses_exists():
  """Public names of tunix the trainer builds on; a rename fails here."""
  from tunix.sft import utils  # pylint: disable=import-outside-toplevel
  for name in ('create_train_step_fn', 'create_eval_step_fn',
               'jit_train_and_eval_step', 'clear_jit_cache', 'with_loss_fn',
               'with_gen_model_input_fn', 'train'):
    assert callable(getattr(peft_trainer.PeftTrainer, name, None)), (
        f'tunix PeftTrainer has no {name}: taco_optax.tunix overrides it')
  assert callable(getattr(utils, 'is_lora_enabled', None))
  model = MODELS['qwen3']()
  trainer = peft_trainer.PeftTrainer(model, tunix_models.taco(model),
                                     _config(1))
  for name in ('model', 'optimizer', 'config', 'loss_fn',
               'gen_model_input_fn', 'data_hooks'):
    assert hasattr(trainer, name), f'tunix PeftTrainer has no .{name}'
  api = _tunix_api.check(trainer.create_train_step_fn(),
                         _tunix_api.installed_version())
  if api.accumulator:
    assert hasattr(trainer, 'grad_accumulator')
    assert callable(getattr(utils, 'LossOutput', None))
    assert callable(getattr(utils, 'WeightedMetric', None))


def test_an_unfamiliar_layer_call_falls_back_with_its_reason(caplog):
  class OddLayer(nnx.Module):

    def __init__(self, layer):
      self.layer = layer

    def __call__(self, x, positions, mask):  # no cache argument
      return self.layer(x, positions, None, mask)

  model = MODELS['qwen3']()
  model.layers = nnx.List([OddLayer(layer) for layer in model.layers])
  reason = _tunix_model.unsupported(model)
  assert 'OddLayer is called as (x, positions, mask)' in reason
  trainer = taco_tunix.LayerwisePeftTrainer(model, tunix_models.taco(model),
                                            _config(1))
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    trainer.create_train_step_fn()
  assert 'OddLayer is called as' in caplog.text


def test_inputs_the_default_loss_does_not_take_are_refused():
  model = MODELS['qwen3']()
  trainer = taco_tunix.LayerwisePeftTrainer(model, tunix_models.taco(model),
                                            _config(1))
  trainer.with_gen_model_input_fn(
      lambda batch: dict(tunix_models.model_input(batch),
                         extra=batch['input_mask']))
  with pytest.raises(ValueError, match=r"\['extra'\], which tunix's default"):
    trainer.train(tunix_models.batches(1))


def test_segment_ids_reach_the_layers_as_in_the_model_call():
  """tunix 0.1.8's decoders pass ``segment_ids`` to every layer (its flash
  attention reads them; the CPU path does not), and so does the layered
  loss: layers that read them give the model's own loss."""
  class SegmentedLayer(nnx.Module):

    def __init__(self, layer):
      self.layer = layer

    def __call__(self, x, segment_pos, cache, attn_mask, segment_ids=None):
      if segment_ids is not None:
        x = x + 0.1 * segment_ids[..., None].astype(x.dtype)
      return self.layer(x, segment_pos, cache, attn_mask)

  model = MODELS['qwen3']()
  if 'segment_ids' not in inspect.signature(model).parameters:
    pytest.skip('this tunix Qwen3 takes no segment_ids')
  model.layers = nnx.List([SegmentedLayer(layer) for layer in model.layers])
  inputs = tunix_models.model_input(tunix_models.batches(1)[0])
  segments = (np.arange(16)[None] >= 8).astype(np.int32).repeat(4, 0) + 1
  logits, _ = model(inputs['input_tokens'], inputs['positions'], None,
                    inputs['attention_mask'], segment_ids=segments)
  plain, _ = model(inputs['input_tokens'], inputs['positions'], None,
                   inputs['attention_mask'])
  assert not np.allclose(logits, plain)  # the layers read them
  layered = _tunix_model.layered(model)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  ours = layered.loss(layered.relayout.forward(params),
                      dict(inputs, segment_ids=segments))
  expected = _tunix_model.next_token_loss(
      logits[:, :-1].reshape(-1, logits.shape[-1]), inputs)
  np.testing.assert_allclose(ours, expected, rtol=2e-6)


def test_layerwise_trainer_equals_peft_trainer_in_bf16():
  # 16-bit weights, rounded stochastically: the layer-wise step keys each
  # leaf's bits by its index in the model's parameter State, as
  # PeftTrainer's optimizer does, so the two runs are bit for bit alike.
  def model():
    model = tunix_models.qwen3()
    params = nnx.state(model, nnx.Param)
    noise = lambda x: x + 0.05 * jax.random.normal(jax.random.key(3), x.shape)
    nnx.update(model, jax.tree.map(lambda x: noise(x).astype(jnp.bfloat16),
                                   params))
    return model

  data = tunix_models.batches(2)
  peft = _train(peft_trainer.PeftTrainer, model(), 2, data)
  layerwise = _train(taco_tunix.LayerwisePeftTrainer, model(), 2, data)
  start = jax.tree.leaves(nnx.state(model(), nnx.Param))
  got = jax.tree.leaves(nnx.state(layerwise.model, nnx.Param))
  assert all(x.dtype == jnp.bfloat16 for x in got)
  assert all((np.asarray(a) != np.asarray(b)).any() for a, b in zip(got, start)
             if a.ndim >= 2)
  for a, b in zip(_leaves(layerwise), _leaves(peft)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
