"""The tasks' metrics: accuracy, MultiRC's F1a, SQuAD's exact match and F1.

:func:`score` gives a :class:`tasks.Task`'s scores for its predictions.
"""

import collections
import re
import string
from typing import Sequence

from examples.finetune import tasks


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
  """Fraction of predictions equal to the label."""
  if not labels:
    return float('nan')
  return sum(int(p == y) for p, y in zip(predictions, labels)) / len(labels)


def f1a(predictions: Sequence[int], labels: Sequence[int]) -> float:
  """MultiRC's F1a: binary F1 of the 'correct answer' class over all options.
  """
  true_pos = sum(1 for p, y in zip(predictions, labels) if p == 1 and y == 1)
  predicted = sum(1 for p in predictions if p == 1)
  actual = sum(1 for y in labels if y == 1)
  if true_pos == 0:
    return 0.0
  precision, recall = true_pos / predicted, true_pos / actual
  return 2 * precision * recall / (precision + recall)


def normalize_answer(text: str) -> str:
  """SQuAD's normalisation: lower case, no punctuation, articles or extra space.
  """
  text = text.lower()
  text = ''.join(ch for ch in text if ch not in set(string.punctuation))
  text = re.sub(r'\b(a|an|the)\b', ' ', text)
  return ' '.join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
  """1.0 when the normalised prediction equals any normalised answer."""
  return float(any(normalize_answer(prediction) == normalize_answer(a)
                   for a in answers))


def token_f1(prediction: str, answers: Sequence[str]) -> float:
  """Best bag-of-tokens F1 of the prediction against any answer (SQuAD)."""

  def f1(answer):
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(
        answer).split()
    if not predicted or not gold:
      return float(predicted == gold)
    common = collections.Counter(predicted) & collections.Counter(gold)
    overlap = sum(common.values())
    if overlap == 0:
      return 0.0
    precision, recall = overlap / len(predicted), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)

  return max(f1(a) for a in answers)


def score(task: tasks.Task, examples: Sequence[tasks.Example],
          predictions: Sequence) -> dict[str, float]:
  """The task's metric(s) for predictions of ``examples``.

  Args:
    task: the task.
    examples: the formatted examples.
    predictions: candidate indices, or generated strings for generation tasks.

  Returns:
    ``{'accuracy': ...}``, ``{'f1a': ..., 'accuracy': ...}`` or
    ``{'em': ..., 'f1': ...}``; the first key is the headline metric.
  """
  if task.generative:
    n = max(len(examples), 1)
    return {
        'f1': sum(token_f1(p, e.answers)
                  for p, e in zip(predictions, examples)) / n,
        'em': sum(exact_match(p, e.answers)
                  for p, e in zip(predictions, examples)) / n,
    }
  labels = [e.label for e in examples]
  if task.metric == 'f1a':
    return {'f1a': f1a(predictions, labels),
            'accuracy': accuracy(predictions, labels)}
  return {'accuracy': accuracy(predictions, labels)}


def first_line(generated: str) -> str:
  """A generated answer ends at the first newline, as in MeZO."""
  return generated.split('\n', 1)[0].strip()
