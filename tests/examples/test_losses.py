"""Training losses of the fine-tuning loop, against hand computations."""

from flax import nnx
import jax
import numpy as np

from examples.finetune import data
from examples.finetune import losses
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as model


def _identity_project(states, token_ids=None):
  """``model.project`` with an identity output table: logits = the states."""
  table = np.eye(states.shape[-1], dtype=np.float32)
  return model.project(states, table, np.float32, token_ids)


def test_candidate_loss_is_cross_entropy_over_candidate_logits():
  logits = np.zeros((2, 3, 5), np.float32)
  logits[0, 1, [2, 4]] = [1.0, 3.0]  # last prompt token of row 0 at 1
  logits[1, 2, [2, 4]] = [0.5, 0.5]
  logits[0, 2, 2] = 100.0  # padding position: must be ignored
  logits[0, 0, 4] = 100.0  # an earlier position: must be ignored
  batch = data.ChoiceBatch(
      input_ids=np.zeros((2, 3), np.int32),
      attention_mask=np.array([[1, 1, 0], [1, 1, 1]], bool),
      candidate_ids=np.array([[2, 4], [2, 4]], np.int32),
      labels=np.array([0, 1], np.int32))
  expected = np.mean([-np.log(np.exp(1) / (np.exp(1) + np.exp(3))),
                      np.log(2)])
  loss = losses.batch_loss(logits, _identity_project, batch)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  scores = np.array([[1.0, 3.0], [0.5, 0.5]], np.float32)
  assert loss == losses.candidate_nll(scores, batch.labels)


def test_project_scores_only_the_asked_tokens():
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(2, 3, 4)).astype(np.float32)
  table = rng.normal(size=(7, 4)).astype(np.float32)
  full = model.project(hidden, table, np.float32)
  assert full.shape == (2, 3, 7) and full.dtype == np.float32
  np.testing.assert_allclose(full, hidden @ table.T, rtol=1e-5)
  ids = np.array([[[6, 0], [1, 1], [2, 5]]] * 2, np.int32)
  picked = model.project(hidden, table, np.float32, ids)
  np.testing.assert_allclose(
      picked, np.take_along_axis(np.asarray(full), ids, -1), rtol=1e-5)


def test_candidate_loss_of_a_model_equals_the_loss_of_its_full_logits():
  net = model.DecoderLM(config_lib.ModelConfig.tiny('opt'),
                        dtype=np.float32, param_dtype=np.float32,
                        rngs=nnx.Rngs(0))
  batch = data.ChoiceBatch(
      input_ids=np.array([[5, 7, 9, 0], [3, 4, 0, 0]], np.int32),
      attention_mask=np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool),
      candidate_ids=np.array([[10, 11], [12, 10]], np.int32),
      labels=np.array([1, 0], np.int32))
  logits = net(batch.input_ids, batch.attention_mask)
  last = batch.attention_mask.sum(-1) - 1
  rows = np.asarray(logits)[np.arange(2), last]
  expected = losses.candidate_nll(
      np.take_along_axis(rows, batch.candidate_ids, -1), batch.labels)
  np.testing.assert_allclose(losses.completion_loss(net, batch), expected,
                             rtol=1e-5)


def test_completion_nll_counts_only_completion_tokens():
  batch = data.collate([data.TokenizedExample((1, 2), (3,))], seq_len=4)
  logits = np.zeros((1, 4, 5), np.float32)
  logits[0, 1, 3] = 2.0  # position 1 predicts token 3 (the completion)
  logits[0, 0, 0] = 50.0  # predicting a prompt token: not in the loss
  expected = -jax.nn.log_softmax(logits[0, 1])[3]
  # The logits of every position that has a next token (scored_states).
  np.testing.assert_allclose(losses.completion_nll(logits[:, :-1], batch),
                             expected, rtol=1e-6)
  np.testing.assert_allclose(
      losses.batch_loss(logits, _identity_project, batch), expected,
      rtol=1e-6)


def _reference_completion_nll(logits, batch):
  log_probs = jax.nn.log_softmax(logits.astype(np.float32), axis=-1)
  picked = np.take_along_axis(log_probs, batch.input_ids[:, 1:, None], -1)
  mask = batch.loss_mask[:, 1:]
  return -(picked[..., 0] * mask).sum() / np.maximum(mask.sum(), 1.0)


def test_completion_nll_value_and_gradient_equal_log_softmax():
  # The loss's own VJP (exp kept, target picked by comparison) against
  # autodiff of log_softmax, on flattened and unflattened logits, with a
  # padded row and a target at a tied maximum.
  batch = data.collate([data.TokenizedExample((1, 2), (3, 4)),
                        data.TokenizedExample((5,), (6,))], seq_len=5)
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 4, 7)).astype(np.float32) * 3
  logits[0, 1, [4, 6]] = 9.0  # the target (4) ties the row's maximum
  expected, expected_grad = jax.value_and_grad(_reference_completion_nll)(
      logits, batch)
  for shape in [(2, 4, 7), (8, 7)]:
    value, grad = jax.value_and_grad(losses.completion_nll)(
        logits.reshape(shape), batch)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    np.testing.assert_allclose(grad.reshape(logits.shape), expected_grad,
                               rtol=1e-5, atol=1e-7)
  grad = jax.grad(losses.completion_nll)(logits.astype(jax.numpy.bfloat16),
                                         batch)
  assert grad.dtype == jax.numpy.bfloat16
