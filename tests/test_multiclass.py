"""The multi-class tasks' files and the table over seeds (issue 33's runs)."""

import json
import os

import pytest

from benchmarks import multiclass_runs
from benchmarks import multiclass_task


@pytest.mark.parametrize('raw, clean', [
    ('What is the capital of France ?', 'What is the capital of France?'),
    ("Who wrote `` Hamlet '' ?", 'Who wrote "Hamlet"?'),
    ("What 's the name of the dog , and who is n't here ?",
     "What's the name of the dog, and who isn't here?"),
    ('  How   far  ?  ', 'How far?'),
])
def test_detokenize_undoes_the_files_spacing(raw, clean):
  assert multiclass_task.detokenize(raw) == clean


def _trec_package(tmp_path, lines):
  (tmp_path / 'data').mkdir()
  (tmp_path / 'data' / 'question_labels.txt').write_text(
      '\n'.join(lines) + '\n', encoding='latin-1')
  return str(tmp_path)


def test_trec_records_are_the_distinct_questions_with_coarse_labels(tmp_path):
  root = _trec_package(tmp_path, [
      'NUM:date When was it built ?', 'HUM:ind Who built it ?', '',
      'NUM:date When was it built ?',  # the nested sets repeat questions
      'ABBR:exp What does NASA stand for ?'])
  assert multiclass_task.trec_records(root) == [
      {'text': 'When was it built?', 'label': 5},
      {'text': 'Who built it?', 'label': 3},
      {'text': 'What does NASA stand for?', 'label': 0}]


def test_a_question_with_two_labels_is_refused(tmp_path):
  root = _trec_package(tmp_path, ['NUM:date When ?', 'LOC:city When ?'])
  with pytest.raises(ValueError, match='two labels'):
    multiclass_task.trec_records(root)


def test_files_are_a_balanced_held_out_split_written_once(tmp_path,
                                                          monkeypatch):
  records = [{'text': f'q{i}', 'label': i % 3} for i in range(150)]
  task = multiclass_task.Task('toy', 'json', '', lambda root: records,
                              (0, 1, 2), ('a', 'b', 'c'), '{text}\nX:')
  monkeypatch.setitem(multiclass_task.TASKS, 'toy', task)
  monkeypatch.setattr(multiclass_task, 'package_dir', lambda task: '')
  train, test = multiclass_task.write_files('toy', str(tmp_path))
  read = lambda p: [json.loads(l) for l in open(p)]
  held = read(test)
  assert sorted(r['label'] for r in held) == [0] * 40 + [1] * 40 + [2] * 40
  assert len(read(train)) == 30
  assert not {r['text'] for r in held} & {r['text'] for r in read(train)}
  assert sorted(os.listdir(tmp_path)) == ['toy-test.jsonl', 'toy-train.jsonl']
  records.clear()  # a second call reads nothing: the files are kept
  assert multiclass_task.write_files('toy', str(tmp_path)) == (train, test)
  assert len(read(test)) == 120
  assert multiclass_task.task_flags('toy', str(tmp_path)) == [
      '--task', 'text', '--train-file', train, '--test-file', test,
      '--label-words', '0=a,1=b,2=c', '--template', '{text}\nX:']


def _result(root, name, optimizer, lr, given, seed, after, task='trec'):
  directory = os.path.join(root, name)
  os.makedirs(directory)
  with open(os.path.join(directory, 'results.json'), 'w') as f:
    json.dump({'optimizer': optimizer, 'learning_rate': lr,
               'after': {'accuracy': after}, 'before': {'accuracy': 0.2},
               'config': {'task': 'text', 'lr': lr if given else None,
                          'steps': 40, 'seed': seed,
                          'train_file': f'data/{task}-train.jsonl'}}, f)


def test_table_gives_means_errors_and_paired_differences(tmp_path,
                                                         monkeypatch, capsys):
  monkeypatch.setattr(multiclass_runs, 'ROOT', str(tmp_path))
  for seed, (taco, adamw) in enumerate(((0.47, 0.48), (0.46, 0.55),
                                        (0.50, 0.50))):
    _result(tmp_path, f't{seed}', 'taco', 1e-4, False, seed, taco)
    _result(tmp_path, f'a{seed}', 'adamw', 3.2e-5, False, seed, adamw)
  _result(tmp_path, 'other', 'taco', 2e-4, True, 0, 0.60)
  multiclass_runs.report()
  out = capsys.readouterr().out
  # AdamW 48, 55, 50: mean 51.0, sd sqrt(13), se 2.08.
  assert '| trec | adamw | 3.2e-05 (rule) | 40 | 48.0 | 55.0 | 50.0 | ' \
         '51.0 ± 2.1 | 20.0 |' in out
  # TACO - AdamW: -1, -9, 0: mean -3.33, se 2.85.
  assert '| trec | 0.0001 (rule) | 40 | 0,1,2 | -1.0 -9.0 +0.0 | -3.3 ± 2.8 |' \
         in out
  # One seed: no error, the difference paired on that seed only.
  assert '| trec | 0.0002 | 40 | 0 | +12.0 | +12.0 ± nan |' in out


def test_grid_is_the_product_of_the_flags():
  args = multiclass_runs.argparse.Namespace(
      tasks='trec,bbc', optimizers='taco', lrs='rule,2e-4', steps='40',
      seeds='0,1')
  points = multiclass_runs.grid(args)
  assert len(points) == 8
  assert points[0] == multiclass_runs.Point('trec', 'taco', None, 40, 0)
  assert points[0].directory.endswith('trec-taco-lrrule-steps40-seed0')
  assert points[1].lr == 2e-4
  tweets = multiclass_runs.Point('tweets', 'adamw', 3e-5, 160, 2)
  assert tweets.flags() == [
      '--eval-size', '200', '--no-checkpoint', '--no-progress',
      '--optimizer', 'adamw', '--steps', '160', '--seed', '2', '--lr',
      '3e-05']
