"""Evaluation reads the model: same scores as the full logits, no copies."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from examples.finetune import data
from examples.finetune import evaluation
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as model_lib


def _model(family):
  return model_lib.DecoderLM(config_lib.ModelConfig.tiny(family),
                             dtype=jnp.float32, param_dtype=jnp.float32,
                             rngs=nnx.Rngs(0))


def _prompts(vocab_size):
  rng = np.random.default_rng(0)
  return data.collate([data.TokenizedExample(
      tuple(int(t) for t in rng.integers(3, vocab_size, n)), ())
                       for n in (5, 1, 8, 3)], seq_len=8)


def test_last_token_scores_equal_the_full_logits_at_the_last_token():
  for family in ('llama', 'opt'):  # tied and untied output embedding
    model = _model(family)
    batch = _prompts(model.config.vocab_size)
    scores = evaluation._last_token_log_probs(  # pylint: disable=protected-access
        model, batch.input_ids, batch.attention_mask)
    logits = model(batch.input_ids, batch.attention_mask)
    last = batch.attention_mask.sum(-1) - 1
    expected = jax.nn.log_softmax(np.asarray(logits)[np.arange(4), last], -1)
    assert scores.shape == (4, model.config.vocab_size)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5)


def test_evaluation_leaves_the_parameters_in_place():
  model = _model('llama')
  batch = _prompts(model.config.vocab_size)
  before = jax.tree.leaves(nnx.state(model))
  live = sum(a.nbytes for a in jax.live_arrays())
  for _ in range(2):
    evaluation._last_token_log_probs(  # pylint: disable=protected-access
        model, batch.input_ids, batch.attention_mask).block_until_ready()
  after = jax.tree.leaves(nnx.state(model))
  assert all(a is b for a, b in zip(before, after))
  # Only the scores themselves were added (nothing holds parameter copies).
  assert sum(a.nbytes for a in jax.live_arrays()) <= live + 4 * 4 * (
      model.config.vocab_size) * 2
