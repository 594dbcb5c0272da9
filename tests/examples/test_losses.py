"""Training losses of the fine-tuning loop, against hand computations."""

import jax
import numpy as np

from examples.finetune import data
from examples.finetune import losses


def test_candidate_nll_is_cross_entropy_over_candidate_logits():
  logits = np.zeros((2, 3, 5), np.float32)
  logits[0, 1, [2, 4]] = [1.0, 3.0]  # last prompt token of row 0 at 1
  logits[1, 2, [2, 4]] = [0.5, 0.5]
  logits[0, 2, 2] = 100.0  # padding position: must be ignored
  batch = data.ChoiceBatch(
      input_ids=np.zeros((2, 3), np.int32),
      attention_mask=np.array([[1, 1, 0], [1, 1, 1]], bool),
      candidate_ids=np.array([[2, 4], [2, 4]], np.int32),
      labels=np.array([0, 1], np.int32))
  expected = np.mean([-np.log(np.exp(1) / (np.exp(1) + np.exp(3))),
                      np.log(2)])
  np.testing.assert_allclose(losses.candidate_nll(logits, batch), expected,
                             rtol=1e-6)
  assert losses.batch_loss(logits, batch) == losses.candidate_nll(logits, batch)


def test_completion_nll_counts_only_completion_tokens():
  batch = data.collate([data.TokenizedExample((1, 2), (3,))], seq_len=4)
  logits = np.zeros((1, 4, 5), np.float32)
  logits[0, 1, 3] = 2.0  # position 1 predicts token 3 (the completion)
  logits[0, 0, 0] = 50.0  # predicting a prompt token: not in the loss
  expected = -jax.nn.log_softmax(logits[0, 1])[3]
  np.testing.assert_allclose(losses.completion_nll(logits, batch), expected,
                             rtol=1e-6)
