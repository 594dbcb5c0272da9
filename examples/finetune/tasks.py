"""The task registry: prompt formats, metric names and where the data are.

Each task turns one record into an :class:`Example`: a prompt plus either the
candidate completions scored by log-likelihood (classification and multiple
choice, as in MeZO) or the gold answers of a greedy generation (SQuAD, DROP).
Training always maximises the log-likelihood of :attr:`Example.target` after
the prompt. :data:`TASKS` is the one registry the CLI (``--task``) and the
benchmarks read: the paper's tasks read Hugging Face records (same field
names) from local JSONL files; ``tweets``, ``bbc``, ``trec`` and
``tweets-to-movies`` bring their own records (:mod:`corpora`) and fixed,
class-balanced validation and held-out splits (:meth:`Task.splits`). ``text``
is the one task the flags describe (:func:`get`).
"""

import dataclasses
from typing import Callable, Mapping, NamedTuple, Optional

from examples.finetune import corpora

# The task for any JSONL of ``{"text", "label"}`` records, described by flags.
TEXT = 'text'


class TaskDataError(ValueError):
  """A record lacks a field or holds a label the task does not know."""


class Example(NamedTuple):
  """One formatted example.

  Attributes:
    prompt: text the model conditions on.
    candidates: completions scored by log-likelihood, each with its leading
      space; empty for generation tasks.
    label: index of the correct candidate; ``-1`` for generation tasks.
    answers: gold answers of a generation task; empty otherwise.
    group: id of the question an answer option belongs to (MultiRC).
  """
  prompt: str
  candidates: tuple[str, ...] = ()
  label: int = -1
  answers: tuple[str, ...] = ()
  group: Optional[str] = None

  @property
  def target(self) -> str:
    """The completion trained on: the correct candidate or first answer."""
    if self.candidates:
      return self.candidates[self.label]
    return ' ' + self.answers[0]


@dataclasses.dataclass(frozen=True)
class Task:
  """A prompt format and its metric.

  Attributes:
    name: task name as given on the command line.
    fields: fields every record must have.
    format: record -> :class:`Example`.
    metric: ``'accuracy'``, ``'f1a'`` (MultiRC) or ``'em_f1'`` (generation).
    labels: a classification task's labels as its records write them
      (compared as strings); empty when the format checks them itself.
    records: the task's own records (``None``: it reads ``--train-file`` and
      ``--test-file``).
    test_per_class: the held-out records of each label that :meth:`split`
      sets apart from :attr:`records`.
    validation_per_class: the validation records of each label, cut from
      what the held-out split leaves for training (0: no validation split).
    held_out_records: an out-of-domain task's held-out source: the held-out
      and validation records are cut from it and :attr:`records` all train
      (``None``: both come from :attr:`records`).
  """
  name: str
  fields: tuple[str, ...]
  format: Callable[[Mapping], Example]
  metric: str
  labels: tuple[str, ...] = ()
  records: Optional[Callable[[], list[dict]]] = None
  test_per_class: int = 0
  validation_per_class: int = 0
  held_out_records: Optional[Callable[[], list[dict]]] = None

  @property
  def generative(self) -> bool:
    return self.metric == 'em_f1'

  @property
  def headline_metric(self) -> str:
    """The score a run reports first: the first key of :func:`score`."""
    return 'f1' if self.generative else self.metric

  def example(self, record: Mapping) -> Example:
    """Checks the fields of ``record`` and formats it."""
    missing = [f for f in self.fields if f not in record]
    if missing:
      raise TaskDataError(
          f'task {self.name!r} needs field(s) {missing}; record has '
          f'{sorted(record)}')
    return self.format(record)

  def split(self, eval_split: str = 'test'
            ) -> tuple[list[dict], list[dict]]:
    """``(train, evaluated)`` of the task's own records: a fixed split.

    Args:
      eval_split: ``'test'``: the held-out set; ``'validation'``: the
        validation set (what rates are chosen on). The training set is the
        same for both: the records in neither.
    """
    train, validation, test = self.splits()
    if eval_split == 'test':
      return train, test
    if eval_split != 'validation':
      raise ValueError(f"eval_split must be 'test' or 'validation', got "
                       f'{eval_split!r}')
    if not validation:
      raise ValueError(f'task {self.name!r} has no validation split')
    return train, validation

  def splits(self) -> tuple[list[dict], list[dict], list[dict]]:
    """``(train, validation, held-out)``: disjoint, fixed, class-balanced.

    The held-out set is :func:`corpora.balanced_split`'s cut with seed 0, as
    it was before validation sets existed, so that held-out figures stay
    comparable; the validation set is cut with seed 1 from what that leaves
    for training (for an out-of-domain task, from what it leaves of
    :attr:`held_out_records`), one record per text. Every run (any
    ``--seed``, any optimizer) sees the same three sets, and no text of the
    held-out or validation set trains.
    """
    if self.records is None:
      raise ValueError(f'task {self.name!r} reads its records from files')
    if self.held_out_records is None:
      train, test = corpora.balanced_split(self.records(),
                                           self.test_per_class, self.labels)
      pool = train
    else:
      train = self.records()
      pool, test = corpora.balanced_split(self.held_out_records(),
                                          self.test_per_class, self.labels)
    # A text repeated in the source (BBC's corpus repeats 122 articles) is
    # scored once: none of a held-out text's copies is a validation record
    # or trains, and none of a validation text's trains.
    held = {record['text'] for record in test}
    validation = []
    if self.validation_per_class:
      seen, distinct = set(held), []
      for record in pool:
        if record['text'] not in seen:
          seen.add(record['text'])
          distinct.append(record)
      _, validation = corpora.balanced_split(
          distinct, self.validation_per_class, self.labels, split_seed=1)
      held |= {record['text'] for record in validation}
    train = [record for record in train if record['text'] not in held]
    return train, validation, test


def _label_index(record: Mapping, num_labels: int, task: str) -> int:
  label = record['label']
  if isinstance(label, bool):
    label = int(label)
  if not isinstance(label, int) or not 0 <= label < num_labels:
    raise TaskDataError(
        f'task {task!r}: unknown label {label!r} '
        f'(expected 0..{num_labels - 1})')
  return label


def _sst2(record):
  return Example(f"{record['sentence']} It was",
                 (' terrible', ' great'), _label_index(record, 2, 'sst2'))


def _rte(record):
  # label 0 = entailment.
  prompt = (f"{record['premise']}\nDoes this mean that "
            f"\"{record['hypothesis']}\" is true? Yes or No?\n")
  return Example(prompt, ('Yes', 'No'), _label_index(record, 2, 'rte'))


def _cb(record):
  # labels: 0 entailment, 1 contradiction, 2 neutral.
  prompt = (f"Suppose {record['premise']} Can we infer that "
            f"\"{record['hypothesis']}\"? Yes, No, or Maybe?\n")
  return Example(prompt, ('Yes', 'No', 'Maybe'), _label_index(record, 3, 'cb'))


def _boolq(record):
  question = record['question'].rstrip('?')
  prompt = f"{record['passage']} {question}?"
  return Example(prompt, (' No', ' Yes'), _label_index(record, 2, 'boolq'))


def _multirc(record):
  prompt = (f"{record['paragraph']}\nQuestion: {record['question']}\n"
            f"I found this answer \"{record['answer']}\". Is that correct? "
            'Yes or No?\n')
  idx = record.get('idx')
  group = None
  if isinstance(idx, Mapping):
    group = f"{idx.get('paragraph')}-{idx.get('question')}"
  else:
    group = record['question']
  return Example(prompt, ('No', 'Yes'), _label_index(record, 2, 'multirc'),
                 group=group)


def _lowercase_first(text: str) -> str:
  return text[:1].lower() + text[1:]


def _copa(record):
  if record['question'] not in ('cause', 'effect'):
    raise TaskDataError(
        f"task 'copa': question must be 'cause' or 'effect', got "
        f"{record['question']!r}")
  connector = ' because' if record['question'] == 'cause' else ' so'
  prompt = record['premise'].rstrip().rstrip('.') + connector
  choices = tuple(' ' + _lowercase_first(record[c])
                  for c in ('choice1', 'choice2'))
  return Example(prompt, choices, _label_index(record, 2, 'copa'))


def _answers(record, key, field, task):
  answers = record[key]
  texts = answers.get(field) if isinstance(answers, Mapping) else None
  if not texts or not all(isinstance(t, str) for t in texts):
    raise TaskDataError(
        f'task {task!r}: field {key!r} must hold a non-empty {field!r} list')
  return tuple(texts)


def _squad(record):
  prompt = (f"Title: {record['title']}\nContext: {record['context']}\n"
            f"Question: {record['question']}\nAnswer:")
  return Example(prompt, answers=_answers(record, 'answers', 'text', 'squad'))


def _drop(record):
  prompt = (f"Passage: {record['passage']}\nQuestion: {record['question']}\n"
            'Answer:')
  return Example(prompt,
                 answers=_answers(record, 'answers_spans', 'spans', 'drop'))


def parse_label_words(spec: str) -> dict[str, str]:
  """Parses ``'negative=terrible,positive=great'`` into a label -> word map.

  Words get a leading space (they follow the prompt) unless they already
  start with whitespace.
  """
  words = {}
  for item in spec.split(','):
    label, sep, word = item.partition('=')
    if not sep or not label.strip() or not word.strip():
      raise ValueError(
          f'--label-words: expected LABEL=WORD pairs separated by commas, got '
          f'{item!r}')
    words[label.strip()] = word if word[:1].isspace() else ' ' + word
  return words


def text_classification(label_words: Mapping[str, str],
                        template: str = '{text} It was',
                        name: str = TEXT,
                        records: Optional[Callable[[], list[dict]]] = None,
                        test_per_class: int = 0,
                        validation_per_class: int = 0,
                        held_out_records: Optional[
                            Callable[[], list[dict]]] = None) -> Task:
  """A task for JSONL ``{"text": ..., "label": ...}`` records.

  Args:
    label_words: label (as written in the file, compared as a string) -> the
      completion scored for it, e.g. ``{'0': ' terrible', '1': ' great'}``.
    template: prompt with a ``{text}`` placeholder.
    name: task name used in messages.
    records: the task's own records (``None``: read from files).
    test_per_class: held-out records of each label split from ``records``.
    validation_per_class: validation records of each label (see
      :meth:`Task.splits`).
    held_out_records: an out-of-domain task's held-out source.

  Returns:
    A :class:`Task` scored by accuracy.
  """
  if '{text}' not in template:
    raise ValueError(f'--template must contain {{text}}, got {template!r}')
  labels = tuple(label_words)
  candidates = tuple(label_words[label] for label in labels)

  def format_record(record):
    label = str(record['label'])
    if label not in label_words:
      raise TaskDataError(
          f'task {name!r}: unknown label {record["label"]!r} (known: '
          f'{", ".join(labels)})')
    prompt = template.replace('{text}', str(record['text']))
    return Example(prompt, candidates, labels.index(label))

  return Task(name, ('text', 'label'), format_record, 'accuracy', labels,
              records, test_per_class, validation_per_class, held_out_records)


_PAPER_TASKS = (
    Task('sst2', ('sentence', 'label'), _sst2, 'accuracy'),
    Task('rte', ('premise', 'hypothesis', 'label'), _rte, 'accuracy'),
    Task('cb', ('premise', 'hypothesis', 'label'), _cb, 'accuracy'),
    Task('boolq', ('question', 'passage', 'label'), _boolq, 'accuracy'),
    Task('multirc', ('paragraph', 'question', 'answer', 'label'), _multirc,
         'f1a'),
    Task('copa', ('premise', 'choice1', 'choice2', 'question', 'label'), _copa,
         'accuracy'),
    Task('squad', ('title', 'context', 'question', 'answers'), _squad,
         'em_f1'),
    Task('drop', ('passage', 'question', 'answers_spans'), _drop, 'em_f1'),
)

# The tasks with their own records; the tweets are the CLI's default. Their
# held-out sets: 100 tweets of each label (whatever --eval-size scores of them,
# so the training set never changes with it), 40 of each class otherwise. Their
# validation sets (rates are chosen on these): as large, but 20 of each TREC
# class (it has 86 distinct abbreviation questions: 40 + 40 would leave 6 to
# train on). ``tweets-to-movies`` trains on every tweet and is scored on
# movie-review snippets (:func:`corpora.movie_records`): out of domain.
TWEETS_LABEL_WORDS = {'negative': ' terrible', 'positive': ' great'}
_OWN_DATA = (
    text_classification(TWEETS_LABEL_WORDS, '{text} It was', 'tweets',
                        corpora.read_tweets, 100, 100),
    text_classification({label: ' ' + label for label in corpora.BBC_LABELS},
                        '{text}\nTopic:', 'bbc', corpora.bbc_records, 40, 40),
    text_classification({str(i): ' ' + word for i, (_, word)
                         in enumerate(corpora.TREC_CLASSES)},
                        '{text}\nAnswer type:', 'trec', corpora.trec_records,
                        40, 20),
    text_classification(TWEETS_LABEL_WORDS, '{text} It was',
                        'tweets-to-movies', corpora.read_tweets, 100, 100,
                        corpora.movie_records),
)

TASKS: dict[str, Task] = {task.name: task for task in _OWN_DATA + _PAPER_TASKS}
# What --task accepts: the default first, then the task the flags describe.
TASK_NAMES = ('tweets', TEXT) + tuple(name for name in TASKS
                                      if name != 'tweets')


def get(name: str, label_words: Optional[str] = None,
        template: str = '{text} It was') -> Task:
  """The registry's task ``name``, or the ``text`` task of the flags.

  Args:
    name: a :data:`TASK_NAMES` entry.
    label_words: for ``text``: ``--label-words`` (see
      :func:`parse_label_words`).
    template: for ``text``: the prompt, with a ``{text}`` placeholder.

  Raises:
    ValueError: an unknown name, or ``text`` without usable label words.
  """
  if name in TASKS:
    return TASKS[name]
  if name != TEXT:
    raise ValueError(f'unknown task {name!r}; known: {", ".join(TASK_NAMES)}')
  if not label_words:
    raise ValueError('--task text needs --label-words, e.g. '
                     '"negative=terrible,positive=great"')
  return text_classification(parse_label_words(label_words), template)
