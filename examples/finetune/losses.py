"""Training losses of the example: completion likelihood or candidate choice.
"""

import jax
import jax.numpy as jnp

from examples.finetune import data as data_lib
from examples.finetune.model import vocab_parallel


def next_token_log_probs(model, input_ids, attention_mask):
  """``[B, T-1]`` log-probability of each next token."""
  logits = model(input_ids, attention_mask).astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  return jnp.take_along_axis(log_probs, input_ids[:, 1:, None], -1)[..., 0]


@jax.custom_vjp
def _token_log_probs(logits, targets):
  """float32 ``log_softmax(logits)[targets]`` along the last axis.

  ``jax.nn.log_softmax``'s steps, with each target's entry picked before the
  normaliser is subtracted: the value and gradient are the same bits, but no
  log-probability array as large as the logits is materialised, which was
  0.09 x weights of the layer-wise step's peak for SmolLM2-135M
  (``benchmarks/memory.py``). The backward pass keeps only ``exp(logits -
  max)`` (autodiff kept the logits beside it) and picks the target by a
  comparison, not a scatter into zeros, so the logits, their ``exp`` and
  their gradient can each be written in the place of the one before.
  """
  return _log_probs_forward(logits, targets)[0]


def _log_probs_forward(logits, targets):
  dtype = jnp.zeros((0,), logits.dtype)  # the gradient's dtype, as a residual
  logits = logits.astype(jnp.float32)
  shifted = logits - jnp.max(logits, -1, initial=-jnp.inf, keepdims=True)
  picked = jnp.take_along_axis(shifted, targets[..., None], -1)
  # The exp reads the picked entries (adding 0), so it runs after the pick
  # and can overwrite the logits; XLA otherwise picked after the exp's sum.
  exp = jnp.exp(shifted + jnp.where(jnp.isfinite(picked), picked, 0.0) * 0.0)
  total = jnp.sum(exp, -1, keepdims=True)
  return (picked - jnp.log(total))[..., 0], (exp, total, targets, dtype)


def _log_probs_backward(residuals, cotangent):
  exp, total, targets, dtype = residuals
  cotangent = cotangent[..., None]
  vocab = jax.lax.broadcasted_iota(jnp.int32, exp.shape, exp.ndim - 1)
  # The autodiff of the forward, term by term: d picked at the target, and
  # d log(total) = -cotangent / total through exp(shifted).
  d_logits = (jnp.where(vocab == targets[..., None], cotangent, 0.0)
              + (-cotangent / total) * exp)
  return d_logits.astype(dtype.dtype), None


_token_log_probs.defvjp(_log_probs_forward, _log_probs_backward)


def completion_nll(logits, batch: data_lib.Batch):
  """Mean negative log-likelihood of the completion tokens.

  ``logits`` are those of every position but the last (``[B, T - 1, V]``, or
  flattened to ``[B * (T - 1), V]``, each scoring the next token;
  :func:`scored_states` drops the last state before the projection, so no
  sliced copy of the logits is made).
  """
  rows = logits.shape[:-1]
  mask = batch.loss_mask[:, 1:].reshape(rows)
  targets = batch.input_ids[:, 1:].reshape(rows)
  if vocab_parallel.is_vocab_split(logits):  # on a mesh: the vocabulary's
    log_probs = vocab_parallel.token_log_probs(logits, targets)  # slices
  else:
    log_probs = _token_log_probs(logits, targets)
  tokens = (jnp.maximum(mask.sum(), 1.0) if batch.loss_tokens is None
            else batch.loss_tokens)
  return -(log_probs * mask).sum() / tokens


def candidate_nll(scores, labels):
  """Cross-entropy of the correct candidate among the candidate tokens.

  The classification objective of MeZO's prompt-based fine-tuning: a softmax
  over the label words' logits after the prompt (``scores``, ``[B, C]``), so
  no step is spent on the label words' prior probability.
  """
  log_probs = jax.nn.log_softmax(scores.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(log_probs, labels[:, None], -1).mean()


def last_positions(hidden, attention_mask):
  """``[B, hidden]``: each row's state at its last real (right-padded) token.
  """
  last = attention_mask.sum(-1).astype(jnp.int32) - 1
  return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def scored_states(hidden, batch):
  """The final-normed states that a batch's loss projects onto the vocabulary.

  A ``ChoiceBatch`` (candidates) scores only each row's last position
  (``[B, hidden]``), so no ``[B, T, vocab]`` logits exist; a ``Batch``
  (completion) scores every position that has a next token, flattened
  (``[B * (T - 1), hidden]``: the logits, their exp and their gradient then
  have one shape, so XLA writes each in the place of the one before).
  """
  if isinstance(batch, data_lib.ChoiceBatch):
    return last_positions(hidden, batch.attention_mask)
  return hidden[:, :-1].reshape(-1, hidden.shape[-1])


def logits_loss(logits, batch):
  """The loss of a batch from the logits of its :func:`scored_states`."""
  if isinstance(batch, data_lib.ChoiceBatch):
    if vocab_parallel.is_vocab_split(logits):
      scores = vocab_parallel.pick(logits, batch.candidate_ids)
    else:
      scores = jnp.take_along_axis(logits, batch.candidate_ids, axis=-1)
    return candidate_nll(scores, batch.labels)
  return completion_nll(logits, batch)


def batch_loss(hidden, project, batch):
  """The loss a batch asks for, from the final-normed ``hidden`` states.

  Args:
    hidden: ``[B, T, hidden]`` (``DecoderLM.hidden_states``).
    project: ``project(states)`` -> float32 logits over the vocabulary
      (``DecoderLM.project``).
    batch: a ``ChoiceBatch`` or a ``Batch`` (see :func:`scored_states`).
  """
  return logits_loss(project(scored_states(hidden, batch)), batch)


def completion_loss(model, batch):
  """The training loss of ``model`` on ``batch`` (see :func:`batch_loss`)."""
  return batch_loss(model.hidden_states(batch.input_ids, batch.attention_mask),
                    lambda states: model.project(states, vocab_split=True),
                    batch)
