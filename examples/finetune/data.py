"""Data: JSONL readers, tokenised batches.

A sequence is ``prompt + completion`` tokens, right-padded to ``seq_len``;
the loss mask covers the completion only. Prompts that do not fit are cut from
the left so that the completion and the text nearest to it survive.
"""

import json
import os
from typing import Iterator, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from examples.finetune import corpora
from examples.finetune import tasks as tasks_lib

DataError = corpora.DataError


def read_jsonl(path: str) -> list[dict]:
  """Reads one JSON object per line; blank lines are skipped."""
  if not os.path.isfile(path):
    raise DataError(f'data file not found: {path}')
  records = []
  with open(path, encoding='utf-8') as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(
            f'{path}:{line_number}: not valid JSON ({e.msg})') from e
      if not isinstance(record, dict):
        raise DataError(f'{path}:{line_number}: expected a JSON object')
      records.append(record)
  if not records:
    raise DataError(f'{path}: no records')
  return records


def load_examples(task: tasks_lib.Task,
                  path: str) -> list[tasks_lib.Example]:
  """Reads ``path`` and formats every record, naming the line of a bad one."""
  return examples(task, read_jsonl(path), path)


def examples(task: tasks_lib.Task, records: Sequence[dict],
             path: Optional[str] = None) -> list[tasks_lib.Example]:
  """Formats every record; a bad one is named by its number (in ``path``)."""
  formatted = []
  for number, record in enumerate(records, 1):
    try:
      formatted.append(task.example(record))
    except tasks_lib.TaskDataError as e:
      where = f'{path}: ' if path else ''
      raise DataError(f'{where}record {number}: {e}') from e
  return formatted


def balanced_subset(examples: Sequence[tasks_lib.Example], size: int,
                    seed: int = 0) -> list[tasks_lib.Example]:
  """``size`` examples with their labels as equally represented as possible.

  Labels take turns (in sorted order) giving their next example in a seeded
  shuffle until ``size`` are taken; a label that runs out leaves its turns to
  the others. Generation tasks (every label ``-1``) get a seeded random
  subset.

  Args:
    examples: the held-out set.
    size: how many to keep; all when ``size >= len(examples)``.
    seed: seed of the shuffle; fixed so every run scores the same subset.

  Returns:
    The kept examples in their original order.
  """
  if size >= len(examples):
    return list(examples)
  by_label = {}
  for i in np.random.default_rng(seed).permutation(len(examples)):
    by_label.setdefault(examples[i].label, []).append(int(i))
  queues = [iter(by_label[label]) for label in sorted(by_label)]
  keep = []
  while len(keep) < size:
    for queue in queues:
      index = next(queue, None)
      if index is not None and len(keep) < size:
        keep.append(index)
  return [examples[i] for i in sorted(keep)]


# Tokenisation and batches.


class TokenizedExample(NamedTuple):
  """A training example's prompt and completion as token ids."""
  prompt_ids: tuple[int, ...]
  completion_ids: tuple[int, ...]


def encode(tokenizer, text: str, *, special: bool) -> tuple[int, ...]:
  """The ids of ``text``, with the tokenizer's special tokens if ``special``.
  """
  return tuple(tokenizer.encode(text, add_special_tokens=special).ids)


def tokenize(tokenizer, prompt: str, completion: str) -> TokenizedExample:
  """Encodes prompt (with the tokenizer's special tokens) and completion."""
  return TokenizedExample(encode(tokenizer, prompt, special=True),
                          encode(tokenizer, completion, special=False))


def fit(example: TokenizedExample, seq_len: int) -> tuple[list[int], int]:
  """``(ids, prompt_length)`` with the prompt cut from the left to fit."""
  completion = list(example.completion_ids)[:seq_len - 1]
  room = seq_len - len(completion)
  prompt = list(example.prompt_ids)[-room:] if room else []
  return prompt + completion, len(prompt)


class Batch(NamedTuple):
  """A padded batch.

  Attributes:
    input_ids: int32 ``[B, T]``.
    attention_mask: bool ``[B, T]``, False on padding.
    loss_mask: float32 ``[B, T]``, 1 where the token is a completion token to
      predict (from the position before it).
    loss_tokens: the tokens the mean loss divides by; ``None``: this batch's
      own (a micro-batch of :func:`micro_batches` carries its whole batch's,
      over the number of micro-batches).
  """
  input_ids: np.ndarray
  attention_mask: np.ndarray
  loss_mask: np.ndarray
  loss_tokens: Optional[np.ndarray] = None


def collate(examples: Sequence[TokenizedExample], seq_len: int,
            pad_id: int = 0) -> Batch:
  """Right-pads ``prompt + completion`` sequences to ``seq_len``."""
  n = len(examples)
  input_ids = np.full((n, seq_len), pad_id, np.int32)
  attention_mask = np.zeros((n, seq_len), bool)
  loss_mask = np.zeros((n, seq_len), np.float32)
  for row, example in enumerate(examples):
    ids, prompt_length = fit(example, seq_len)
    input_ids[row, :len(ids)] = ids
    attention_mask[row, :len(ids)] = True
    loss_mask[row, prompt_length:len(ids)] = 1.0
  return Batch(input_ids, attention_mask, loss_mask)


class ChoiceExample(NamedTuple):
  """A prompt whose candidates are single tokens, and the correct one."""
  prompt_ids: tuple[int, ...]
  candidate_ids: tuple[int, ...]
  label: int


class ChoiceBatch(NamedTuple):
  """A padded batch of prompts scored over their candidate tokens.

  Attributes:
    input_ids: int32 ``[B, T]`` prompts.
    attention_mask: bool ``[B, T]``, False on padding.
    candidate_ids: int32 ``[B, C]`` token of each candidate.
    labels: int32 ``[B]`` index of the correct candidate.
  """
  input_ids: np.ndarray
  attention_mask: np.ndarray
  candidate_ids: np.ndarray
  labels: np.ndarray


def collate_choices(examples: Sequence[ChoiceExample], seq_len: int,
                    pad_id: int = 0) -> ChoiceBatch:
  """Right-pads prompts (cut from the left) to ``seq_len``."""
  prompts = collate([TokenizedExample(e.prompt_ids, ()) for e in examples],
                    seq_len, pad_id)
  return ChoiceBatch(
      prompts.input_ids, prompts.attention_mask,
      np.asarray([e.candidate_ids for e in examples], np.int32),
      np.asarray([e.label for e in examples], np.int32))


def choice_examples(tokenizer, examples) -> Optional[list[ChoiceExample]]:
  """Tokenised examples when every candidate is one token, else None."""
  choices = []
  for example in examples:
    candidates = [encode(tokenizer, c, special=False)
                  for c in example.candidates]
    if not candidates or any(len(c) != 1 for c in candidates):
      return None
    choices.append(ChoiceExample(encode(tokenizer, example.prompt,
                                        special=True),
                                 tuple(c[0] for c in candidates),
                                 example.label))
  return choices


def training_batches(examples: Sequence[TokenizedExample], batch_size: int,
                     seq_len: int, seed: int, pad_id: int = 0,
                     collate_fn=None) -> Iterator[Batch]:
  """Endless batches, reshuffled each epoch, reproducible from ``seed``."""
  collate_fn = collate_fn or collate
  if not examples:
    raise DataError('no training examples')
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(len(examples))
    if len(order) < batch_size:  # Keep one batch shape: no recompilation.
      order = np.resize(order, batch_size)
    for start in range(0, len(order) - batch_size + 1, batch_size):
      yield collate_fn([examples[i] for i in order[start:start + batch_size]],
                       seq_len, pad_id)


def longest(examples: Sequence[TokenizedExample]) -> int:
  return max(len(e.prompt_ids) + len(e.completion_ids) for e in examples)


def micro_batches(batch: Union[Batch, 'ChoiceBatch'], count: int):
  """``batch`` split into ``count`` micro-batches along a new leading axis.

  Micro-batch ``a`` holds rows ``[a B/count, (a+1) B/count)``. The mean of
  the micro-batches' losses is the whole batch's loss: a completion batch's
  micro-batches divide by the whole batch's loss tokens over ``count``
  (a mean over each micro-batch's own tokens would weigh a token by how few
  its micro-batch holds); a candidates batch's loss is a mean over rows,
  which equal micro-batches keep. Works on numpy and jax arrays (in ``jit``).
  """
  rows = batch.input_ids.shape[0]
  if count < 1 or rows % count:
    raise ValueError(f'{rows} sequences do not split into {count} '
                     'micro-batches')
  split = lambda x: _split_rows(x, count)
  if isinstance(batch, Batch):
    tokens = jnp.maximum(jnp.sum(batch.loss_mask[:, 1:]), 1.0) / count
    batch = batch._replace(loss_tokens=None)
    return jax.tree.map(split, batch)._replace(
        loss_tokens=jnp.broadcast_to(tokens, (count,)).astype(jnp.float32))
  return jax.tree.map(split, batch)


def _split_rows(x, count: int):
  """``x``'s rows as ``count`` micro-batches along a new leading axis.

  On a mesh (explicit axes) the rows are split over the batch axes; after the
  reshape the new leading axis would carry them, so that each micro-batch
  sits on some devices only (and slicing one out is refused). The micro-batch
  axis is made whole and its rows split over the same axes, or left whole
  where those do not divide a micro-batch's rows, as ``shard_batch`` leaves a
  batch the axes do not divide.
  """
  shape = (count, x.shape[0] // count) + x.shape[1:]
  if not isinstance(x, jax.Array):
    return x.reshape(shape)
  sharding = jax.typeof(x).sharding
  spec = tuple(getattr(sharding, 'spec', ()) or ())
  if not spec or spec[0] is None:
    return x.reshape(shape)
  names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
  devices = int(np.prod([sharding.mesh.shape[name] for name in names]))
  rows = spec[0] if shape[1] % devices == 0 else None
  # One reshape to the target sharding: a plain reshape first would have to
  # put the rows' devices on the micro-batch axis, which fewer micro-batches
  # than devices cannot carry (fsdp=8, 2 micro-batches).
  return x.reshape(shape, out_sharding=jax.sharding.PartitionSpec(
      None, rows, *spec[1:]))
