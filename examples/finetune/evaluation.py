"""Held-out evaluation: the task metric of a model on a tokenised set.

Classification tasks are scored by the candidates' likelihood (one forward
per example when every candidate is one token); generative tasks by greedy
decoding. Every call has one batch shape, so nothing recompiles.
"""

import dataclasses
import functools
from typing import Callable, Iterable, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from examples.finetune import data as data_lib
from examples.finetune import losses as losses_lib
from examples.finetune import metrics as metrics_lib
from examples.finetune import tasks as tasks_lib


def _read_only_jit(fn):
  """``jax.jit`` of ``fn(model, *args)`` for a model that ``fn`` only reads.

  ``nnx.jit`` hands the model's state back out of the compiled call, so
  every evaluation call replaced the parameters with fresh copies while the
  trainer still held the originals: +0.5 GB of live arrays in the default
  run. Here the state goes in as an argument and only ``fn``'s result comes
  out.
  """
  @functools.partial(jax.jit, static_argnums=0)
  def pure(graphdef, state, *args):
    return fn(nnx.merge(graphdef, state), *args)

  @functools.wraps(fn)
  def call(model, *args):
    graphdef, state = nnx.split(model)
    return pure(graphdef, state, *args)

  return call


@_read_only_jit
def _completion_scores(model, batch: data_lib.Batch):
  """Per-row mean log-likelihood of the completion."""
  log_probs = losses_lib.next_token_log_probs(model, batch.input_ids,
                                              batch.attention_mask)
  mask = batch.loss_mask[:, 1:]
  return (log_probs * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)


@_read_only_jit
def _last_token_log_probs(model, input_ids, attention_mask):
  """``[B, V]`` next-token log-probabilities after each row's last token.

  Only the last positions are projected onto the vocabulary: ``[B, V]``
  logits, not ``[B, T, V]``.
  """
  hidden = model.hidden_states(input_ids, attention_mask)
  rows = model.project(losses_lib.last_positions(hidden, attention_mask))
  return jax.nn.log_softmax(rows, axis=-1)


# ``track(items, total)`` wraps the batch loop (a progress bar or nothing).
Track = Callable[[Iterable, int], Iterable]


def _no_bar(items: Iterable, total: int) -> Iterable:
  del total
  return items


def _chunks(items: Sequence, size: int, track: Track = _no_bar):
  """Fixed-size chunks, the last one padded by repeating its first item, so
  every call has one shape (no recompilation); yields (chunk, real_count)."""
  yield from track(_padded_chunks(items, size), -(-len(items) // size))


def _padded_chunks(items: Sequence, size: int):
  for start in range(0, len(items), size):
    chunk = list(items[start:start + size])
    real = len(chunk)
    chunk += [chunk[0]] * (size - real)
    yield chunk, real


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """A held-out set, tokenised once."""
  task: tasks_lib.Task
  examples: list[tasks_lib.Example]
  prompts: list[tuple[int, ...]]
  candidates: list[list[tuple[int, ...]]]

  @property
  def single_token(self) -> bool:
    """Every candidate is one token after one shared prompt: one forward per
    example scores all candidates."""
    return all(len(c) == 1 for cands in self.candidates for c in cands)


def make_eval_set(task, examples, tokenizer) -> EvalSet:
  prompts = [data_lib.encode(tokenizer, e.prompt, special=True)
             for e in examples]
  candidates = [[data_lib.encode(tokenizer, c, special=False)
                 for c in e.candidates] for e in examples]
  return EvalSet(task, list(examples), prompts, candidates)


def _predict_single_token(model, eval_set, seq_len, batch_size, track):
  predictions = []
  pairs = list(zip(eval_set.prompts, eval_set.candidates))
  for chunk, real in _chunks(pairs, batch_size, track):
    batch = data_lib.collate(
        [data_lib.TokenizedExample(p, ()) for p, _ in chunk], seq_len)
    log_probs = np.asarray(_last_token_log_probs(
        model, batch.input_ids, batch.attention_mask))
    for row in range(real):
      ids = [c[0] for c in chunk[row][1]]
      predictions.append(int(np.argmax(log_probs[row, ids])))
  return predictions


def _predict_by_likelihood(model, eval_set, seq_len, batch_size, track):
  flat = [(i, data_lib.TokenizedExample(p, c))
          for i, (p, cands) in enumerate(zip(eval_set.prompts,
                                             eval_set.candidates))
          for c in cands]
  scores = []
  for chunk, real in _chunks(flat, batch_size, track):
    batch = data_lib.collate([e for _, e in chunk], seq_len)
    scores.extend(np.asarray(_completion_scores(model, batch))[:real])
  predictions, position = [], 0
  for cands in eval_set.candidates:
    predictions.append(int(np.argmax(scores[position:position + len(cands)])))
    position += len(cands)
  return predictions


def _generate(model, eval_set, tokenizer, seq_len, batch_size,
              max_new_tokens, stop_ids, track):
  """Greedy decoding in a fixed ``[B, seq_len]`` buffer (no KV cache)."""
  texts = []
  room = seq_len - max_new_tokens
  for chunk, real in _chunks(eval_set.prompts, batch_size, track):
    ids = np.zeros((batch_size, seq_len), np.int32)
    lengths = np.zeros((batch_size,), np.int32)
    for row, prompt in enumerate(chunk):
      prompt = prompt[-room:]
      ids[row, :len(prompt)] = prompt
      lengths[row] = len(prompt)
    start = lengths.copy()
    done = np.zeros((batch_size,), bool)
    for _ in range(max_new_tokens):
      mask = np.arange(seq_len)[None] < lengths[:, None]
      log_probs = _last_token_log_probs(model, ids, mask)
      next_ids = np.asarray(jnp.argmax(log_probs, -1))
      for row in range(batch_size):
        if done[row]:
          continue
        ids[row, lengths[row]] = next_ids[row]
        lengths[row] += 1
        done[row] = next_ids[row] in stop_ids
      if done[:real].all():
        break
    for row in range(real):
      new = [t for t in ids[row, start[row]:lengths[row]] if t not in stop_ids]
      texts.append(metrics_lib.first_line(tokenizer.decode(new)))
  return texts


def evaluate(model, eval_set: EvalSet, tokenizer, *, seq_len: int,
             batch_size: int, max_new_tokens: int = 16,
             stop_ids=(), track: Track = _no_bar) -> dict[str, float]:
  """The task metric(s) of ``model`` on ``eval_set``.

  Args:
    model: a :class:`decoder.DecoderLM`.
    eval_set: the held-out set.
    tokenizer: decodes generated tokens (generative tasks).
    seq_len: padded length of every evaluation sequence.
    batch_size: sequences per forward pass.
    max_new_tokens: generation length (generative tasks).
    stop_ids: token ids that end a generation.
    track: ``track(batches, count)`` wraps the loop over batches, e.g. in a
      progress bar (:func:`phases.tracker`).

  Returns:
    ``{metric name: value}`` as :func:`metrics.score` gives it.
  """
  model.eval()
  try:
    if eval_set.task.generative:
      predictions = _generate(model, eval_set, tokenizer, seq_len, batch_size,
                              max_new_tokens, set(stop_ids), track)
    elif eval_set.single_token:
      predictions = _predict_single_token(model, eval_set, seq_len,
                                          batch_size, track)
    else:
      predictions = _predict_by_likelihood(model, eval_set, seq_len,
                                           batch_size, track)
  finally:
    model.train()
  return metrics_lib.score(eval_set.task, eval_set.examples, predictions)
