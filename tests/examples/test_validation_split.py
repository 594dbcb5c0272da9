"""Validation sets (issue 53): disjoint from training and from the held-out
set, class-balanced, fixed; the held-out sets are the ones cut before
validation sets existed; ``--eval-split`` picks the scored set and
results.json says which; ``tweets-to-movies`` is scored out of domain."""

import collections
import dataclasses
import hashlib
import json

import pytest

from examples.finetune import __main__ as cli
from examples.finetune import corpora
from examples.finetune import flags
from examples.finetune import preparation
from examples.finetune import tasks

# sha256 of each held-out set (json, sorted keys), as the code before
# validation sets cut it (commit 3161c6e: Task.split() with seed 0; the
# out-of-domain task did not exist then: pinned as first cut); first 16 hex
# digits.
HELD_OUT_SHA256 = {'tweets': 'f1223a27c0a0d027', 'trec': 'b89f6c4d3475f9bc',
                   'bbc': '9007660a4ed496a4',
                   'tweets-to-movies': '5f9de216933622a8'}


def _sha(records) -> str:
  return hashlib.sha256(json.dumps(records, sort_keys=True).encode()
                        ).hexdigest()[:16]


def _counts(records):
  return collections.Counter(str(r['label']) for r in records)


def _splits_or_skip(name):
  try:
    return tasks.TASKS[name].splits()
  except corpora.DataError as e:
    pytest.skip(str(e))


@pytest.mark.parametrize('name', sorted(HELD_OUT_SHA256))
def test_real_splits_are_disjoint_balanced_and_keep_the_held_out_set(name):
  task = tasks.TASKS[name]
  train, validation, test = _splits_or_skip(name)
  assert _sha(test) == HELD_OUT_SHA256[name], 'the held-out set changed'
  assert _counts(test) == dict.fromkeys(task.labels, task.test_per_class)
  assert _counts(validation) == dict.fromkeys(task.labels,
                                              task.validation_per_class)
  assert task.validation_per_class > 0
  texts = [{r['text'] for r in part} for part in (train, validation, test)]
  assert len(texts[1]) == len(validation)
  # bbc's held-out set, cut before texts were compared, repeats one article.
  assert len(test) - len(texts[2]) == (name == 'bbc')
  assert not texts[0] & texts[1], 'validation records in training'
  assert not texts[0] & texts[2], 'held-out records in training'
  assert not texts[1] & texts[2], 'validation records held out'
  assert task.splits() == (train, validation, test), 'fixed'


def test_a_repeated_text_is_in_one_set_only():
  # 'same' is written six times, 'twin' twice: wherever a copy lands, no
  # copy of a scored text trains and validation holds each text once.
  records = ([{'text': 'same', 'label': 'positive'}] * 6
             + [{'text': 'twin', 'label': 'negative'}] * 2
             + [{'text': f't{i}', 'label': ('negative', 'positive')[i % 2]}
                for i in range(30)])
  task = dataclasses.replace(tasks.TASKS['tweets'], records=lambda: records,
                             test_per_class=3, validation_per_class=3)
  train, validation, test = task.splits()
  scored = {r['text'] for r in validation + test}
  assert not scored & {r['text'] for r in train}
  assert len({r['text'] for r in validation}) == len(validation) == 6
  assert not {r['text'] for r in validation} & {r['text'] for r in test}
  assert test == corpora.balanced_split(records, 3, task.labels)[1]


def test_in_domain_validation_comes_out_of_the_old_training_set():
  train, validation, test = _splits_or_skip('trec')
  records = tasks.TASKS['trec'].records()
  assert len(train) + len(validation) + len(test) == len(records)
  # 86 abbreviation questions: 40 held out, 20 validation, 26 to train on.
  assert _counts(train)['0'] == 26


def _write_movies(path, lines):
  path.write_text('id\tsentiment\ttext\r\n'
                  + ''.join(f'{line}\r\n' for line in lines), encoding='utf-8')
  return str(path)


def test_movie_snippets_are_labelled_by_the_sign_of_the_mean_rating(tmp_path):
  path = _write_movies(tmp_path / 'movies.txt', [
      '1\t2.26666666667\tA splash.', '2\t-1.0\tDull.', '3\t0.99\tFine-ish.',
      '4\t-0.5\tMeh.', '5\t1.0\tGood.', '6\t3.5\tA splash.',
      '7\t-3.875\tAwful, awful.'])
  assert corpora.movie_records(path) == [
      {'text': 'A splash.', 'label': 'positive'},
      {'text': 'Dull.', 'label': 'negative'},
      {'text': 'Good.', 'label': 'positive'},
      {'text': 'Awful, awful.', 'label': 'negative'}]
  (tmp_path / 'bad.txt').write_text('id\tscore\ttext\n1\t2\tx\n')
  with pytest.raises(corpora.DataError, match='header'):
    corpora.movie_records(str(tmp_path / 'bad.txt'))
  short = _write_movies(tmp_path / 'short.txt', ['1\t2.0'])
  with pytest.raises(corpora.DataError, match='short.txt:2: expected 3'):
    corpora.movie_records(short)


def test_the_out_of_domain_task_trains_on_tweets_and_scores_movies(
    tmp_path, monkeypatch):
  tweets = [{'text': f'tweet {i}', 'label': ('positive', 'negative')[i % 2]}
            for i in range(10)]
  movies = corpora.movie_records(_write_movies(
      tmp_path / 'movies.txt',
      [f'{i}\t{(-2.0, 2.0, 0.1)[i % 3]}\tsnippet {i}' for i in range(30)]))
  assert _counts(movies) == {'negative': 10, 'positive': 10}
  task = dataclasses.replace(
      tasks.TASKS['tweets-to-movies'], records=lambda: tweets,
      held_out_records=lambda: movies, test_per_class=4,
      validation_per_class=3)
  train, validation, test = task.splits()
  assert train == tweets, 'every tweet trains'
  assert _counts(test) == {'negative': 4, 'positive': 4}
  assert _counts(validation) == {'negative': 3, 'positive': 3}
  assert all(r['text'].startswith('snippet') for r in validation + test)
  assert not {r['text'] for r in validation} & {r['text'] for r in test}
  assert test == corpora.balanced_split(movies, 4, task.labels)[1]
  # Scored like the tweets: the same prompt and label words.
  record = {'text': 'snippet 0', 'label': 'negative'}
  assert task.example(record) == tasks.TASKS['tweets'].example(record)


def test_real_movie_snippets_when_installed():
  try:
    records = corpora.movie_records()
  except corpora.DataError as e:
    pytest.skip(str(e))
  # 10,605 snippets; 4,598 rated >= 1 and 4,575 <= -1, 3 texts repeated.
  assert len(records) == len({r['text'] for r in records})
  assert 9_100 < len(records) <= 4_598 + 4_575
  assert set(_counts(records)) == {'negative', 'positive'}


def test_eval_split_picks_the_scored_set_and_keeps_the_training_set(
    monkeypatch):
  records = [{'text': f'text {i}', 'label': ('negative', 'positive')[i % 2]}
             for i in range(40)]
  monkeypatch.setitem(tasks.TASKS, 'tweets', dataclasses.replace(
      tasks.TASKS['tweets'], records=lambda: records, test_per_class=5,
      validation_per_class=4))
  _, train, test = preparation.load_task(flags.RunConfig())
  _, train_v, validation = preparation.load_task(
      flags.RunConfig(eval_split='validation'))
  assert train_v == train and len(train) == 22
  assert len(test) == 10 and len(validation) == 8
  assert not set(validation) & set(test)


def test_eval_split_validation_needs_a_task_with_its_own_records():
  config = flags.RunConfig(task='sst2', train_file='a.jsonl',
                           test_file='b.jsonl', eval_split='validation')
  with pytest.raises(flags.FinetuneError, match='--eval-split validation'):
    preparation.load_task(config)


def test_eval_split_reaches_results_json(workspace, monkeypatch, capsys):
  records = [{'text': f'good text {i}' if i % 2 else f'bad text {i}',
              'label': ('neg', 'pos')[i % 2]} for i in range(24)]
  monkeypatch.setitem(tasks.TASKS, 'tweets', tasks.text_classification(
      {'neg': ' bad', 'pos': ' good'}, '{text}. It was', 'tweets',
      lambda: records, 3, 2))
  output_dir = workspace['root'] / 'run-validation'
  assert cli.main([
      '--model', workspace['model'], '--task', 'tweets', '--eval-split',
      'validation', '--steps', '1', '--batch-size', '2', '--seq-len', '24',
      '--eval-batch-size', '4', '--output-dir', str(output_dir),
      '--no-progress', '--no-checkpoint', '--no-export']) == 0
  with open(output_dir / 'results.json') as f:
    results = json.load(f)
  assert results['eval_split'] == 'validation'
  assert results['config']['eval_split'] == 'validation'
  out = capsys.readouterr().out
  assert 'validation accuracy before' in out and 'held-out' not in out
