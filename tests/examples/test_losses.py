"""Training losses of the fine-tuning loop, against hand computations."""

from flax import nnx
import jax
import numpy as np

from examples.finetune import config as config_lib
from examples.finetune import data
from examples.finetune import losses
from examples.finetune import model


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
