"""The multi-class tasks' files and the table over seeds (issue 33's runs)."""

import json
import os

import pytest

from benchmarks import lr_sweep
from benchmarks import multiclass_fit
from benchmarks import multiclass_runs
from benchmarks import multiclass_tables
from examples.finetune import corpora
from examples.finetune import flags
from examples.finetune import preparation
from examples.finetune import tasks
from tests.support.run_results import run_results


@pytest.mark.parametrize('raw, clean', [
    ('What is the capital of France ?', 'What is the capital of France?'),
    ("Who wrote `` Hamlet '' ?", 'Who wrote "Hamlet"?'),
    ("What 's the name of the dog , and who is n't here ?",
     "What's the name of the dog, and who isn't here?"),
    ('  How   far  ?  ', 'How far?'),
])
def test_detokenize_undoes_the_files_spacing(raw, clean):
  assert corpora.detokenize(raw) == clean


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
  assert corpora.trec_records(root) == [
      {'text': 'When was it built?', 'label': 5},
      {'text': 'Who built it?', 'label': 3},
      {'text': 'What does NASA stand for?', 'label': 0}]


def test_a_question_with_two_labels_is_refused(tmp_path):
  root = _trec_package(tmp_path, ['NUM:date When ?', 'LOC:city When ?'])
  with pytest.raises(ValueError, match='two labels'):
    corpora.trec_records(root)


def test_a_task_with_its_own_records_splits_them_once_balanced(monkeypatch):
  records = [{'text': f'q{i}', 'label': i % 3} for i in range(150)]
  toy = tasks.text_classification({'0': ' a', '1': ' b', '2': ' c'},
                                  '{text}\nX:', 'toy', lambda: records, 40)
  train, test = toy.split()
  assert sorted(r['label'] for r in test) == [0] * 40 + [1] * 40 + [2] * 40
  assert len(train) == 30
  assert not {r['text'] for r in test} & {r['text'] for r in train}
  assert toy.split() == (train, test), 'a fixed split'
  # The CLI's --task reads the registry: the same split, scored examples.
  monkeypatch.setitem(tasks.TASKS, 'trec', toy)
  task, train_examples, held_out = preparation.load_task(
      flags.RunConfig(task='trec', eval_size=6))
  assert task is toy
  assert train_examples == [toy.example(r) for r in train]
  assert sorted(e.label for e in held_out) == [0, 0, 1, 1, 2, 2]
  with pytest.raises(flags.FinetuneError, match='its own records'):
    preparation.load_task(flags.RunConfig(task='trec', train_file='x.jsonl'))


def test_the_benchmarks_tasks_are_the_registrys():
  for name in ('tweets', 'bbc', 'trec'):
    assert lr_sweep.task_flags(name) == ['--task', name]
    assert name in tasks.TASK_NAMES and tasks.TASKS[name].records is not None
  assert len(tasks.TASKS['bbc'].labels) == 5
  assert len(tasks.TASKS['trec'].labels) == 6
  trec = tasks.TASKS['trec'].example({'text': 'Who?', 'label': 3})
  assert (trec.prompt, trec.target) == ('Who?\nAnswer type:', ' human')
  bbc = tasks.TASKS['bbc'].example({'text': 'A. B.', 'label': 'sport'})
  assert (bbc.prompt, bbc.target) == ('A. B.\nTopic:', ' sport')


@pytest.mark.parametrize('config, task', [
    ({'task': 'trec'}, 'trec'),
    ({'task': 'tweets'}, 'tweets'),
    # An earlier benchmark run: --task text over the files it wrote.
    ({'task': 'text', 'train_file': 'runs/x/data/trec-train.jsonl'}, 'trec'),
    ({'task': 'text', 'train_file': 'data/bbc-train.jsonl'}, 'bbc'),
])
def test_a_runs_task_is_read_from_its_config(config, task):
  assert lr_sweep.run_task(
      run_results(task=config['task'], config=config)) == task


def _result(root, name, optimizer, lr, given, seed, after, task='trec',
            steps=40, **config):
  directory = os.path.join(root, name)
  os.makedirs(directory)
  with open(os.path.join(directory, 'results.json'), 'w') as f:
    json.dump(run_results(
        optimizer=optimizer, learning_rate=lr, task='text',
        after={'accuracy': after}, before={'accuracy': 0.2},
        config={'task': 'text', 'lr': lr if given else None,
                'steps': steps, 'seed': seed,
                'train_file': f'data/{task}-train.jsonl',
                'taco_k': 16, 'taco_mu': 0.95,
                'warmup_steps': None, **config}).to_json(), f)


def test_table_gives_means_errors_and_paired_differences(tmp_path,
                                                         monkeypatch, capsys):
  monkeypatch.setattr(multiclass_runs, 'ROOT', str(tmp_path))
  monkeypatch.setattr(multiclass_runs, 'DATA', str(tmp_path / 'none.json'))
  monkeypatch.setattr(
      multiclass_tables, 'rule_rate',
      lambda optimizer, steps: {'taco': 1e-4 if steps == 40 else 5e-5,
                                'adamw': 3.2e-5}[optimizer])
  for seed, (taco, adamw) in enumerate(((0.47, 0.48), (0.46, 0.55),
                                        (0.50, 0.50))):
    _result(tmp_path, f't{seed}', 'taco', 1e-4, False, seed, taco)
    _result(tmp_path, f'a{seed}', 'adamw', 3.2e-5, False, seed, adamw)
  _result(tmp_path, 'other', 'taco', 2e-4, True, 0, 0.60)
  # A longer budget: the rule's rates there, a rate given with --lr apart.
  for seed, (taco, adamw) in enumerate(((0.70, 0.76), (0.64, 0.74))):
    _result(tmp_path, f'l{seed}', 'taco', 5e-5, False, seed, taco, steps=160)
    _result(tmp_path, f'm{seed}', 'adamw', 3.2e-5, False, seed, adamw,
            steps=160)
  _result(tmp_path, 'n0', 'taco', 1e-4, True, 0, 0.99, steps=160)
  _result(tmp_path, 'v1', 'taco', 5e-5, False, 1, 0.85, steps=160,
          taco_mu=0.9)
  multiclass_tables.report(multiclass_runs.rows())
  out = capsys.readouterr().out
  # AdamW 48, 55, 50: mean 51.0, sd sqrt(13), se 2.08.
  assert '| trec | adamw | 3.2e-05 (rule) | 40 | – | 48.0 | 55.0 | 50.0 | ' \
         '51.0 ± 2.1 | 20.0 |' in out
  # TACO - AdamW: -1, -9, 0: mean -3.33, se 2.85.
  assert ('| trec | 0.0001 (rule) | 40 | – | 0,1,2 | -1.0 -9.0 +0.0 | '
          '-3.3 ± 2.8 |') in out
  # The summary: each optimizer at its rule's rate, over the common seeds.
  # TACO 47, 46, 50: mean 47.67, sd 2.08, se 1.20.
  assert '| trec | 6 | 3 | 47.7 ± 1.2 | 51.0 ± 2.1 | -3.3 ± 2.8 |' in out
  # One seed: no error, the difference paired on that seed only.
  assert '| trec | 0.0002 | 40 | – | 0 | +12.0 | +12.0 |' in out
  # The summary at 160 steps comes after the one at 40 and its own heading:
  # TACO 70, 64 (67.0 ± 3.0), AdamW 76, 74 (75.0 ± 1.0), -6, -10 (-8.0 ± 2.0).
  longer = out.split('The same at 160 steps (TACO 5e-05, AdamW 3.2e-05 by '
                     'the rule; the warm-up is 16 steps)')[1]
  assert longer.split('\n\n')[1].splitlines()[2] == (
      '| trec | 6 | 2 | 67.0 ± 3.0 | 75.0 ± 1.0 | -8.0 ± 2.0 |')
  assert '| trec | 0.0001 | 160 | – | 0 | +23.0 | +23.0 |' in out
  # A run that changed a setting is a row of its own, paired with AdamW at
  # the CLI's settings, and no part of the summary.
  assert '| trec | 5e-05 (rule) | 160 | mu=0.9 | 1 | +11.0 | +11.0 |' in out
  assert '| trec | taco | 5e-05 (rule) | 160 | mu=0.9 | – | 85.0 | – | ' in out


def test_grid_is_the_product_of_the_flags():
  args = multiclass_runs.argparse.Namespace(
      tasks='trec,bbc', optimizers='taco', lrs='rule,2e-4', steps='40',
      seeds='0,1', settings='default', with_default=False, eval_split='test',
      eval_every=0)
  points = multiclass_runs.grid(args)
  assert len(points) == 8
  assert points[0] == multiclass_runs.Point('trec', 'taco', None, 40, 0)
  # A rule point is named with the rule's rate now.
  rate = multiclass_runs.rule_rate('taco', 40)
  assert points[0].directory.endswith(
      f'trec-taco-lrrule{rate:g}-steps40-seed0')
  assert points[1].lr == 2e-4
  tweets = multiclass_runs.Point('tweets', 'adamw', 3e-5, 160, 2)
  assert tweets.flags() == [
      '--task', 'tweets', '--eval-size', '200', '--no-checkpoint',
      '--no-progress', '--optimizer', 'adamw', '--steps', '160', '--seed',
      '2', '--lr', '3e-05']
  # A validation point: its own folder, scored with --eval-split validation.
  args.eval_split = 'validation'
  point = multiclass_runs.grid(args)[0]
  assert point.split == 'validation'
  assert point.directory.endswith(
      f'trec-taco-lrrule{rate:g}-steps40-seed0-validation')
  assert point.flags()[-2:] == ['--eval-split', 'validation']
  # A curve (a long run scored as it goes) changes no training: same folder.
  args.eval_every = 100
  curve = multiclass_runs.grid(args)[0]
  assert curve.directory == point.directory
  assert curve.flags()[-4:] == ['--eval-split', 'validation', '--eval-every',
                                '100']


def test_settings_name_the_point_and_its_flags_and_are_read_back(tmp_path):
  args = multiclass_runs.argparse.Namespace(
      tasks='tweets', optimizers='taco', lrs='1e-4', steps='160', seeds='0',
      settings='mu=0.9,k=32 warmup=0', with_default=True, eval_split='test',
      eval_every=0)
  points = multiclass_runs.grid(args)
  assert [p.settings for p in points] == ['', 'mu=0.9', 'k=32 warmup=0']
  assert points[2].directory.endswith(
      'tweets-taco-lr0.0001-steps160-seed0-k=32-warmup=0')
  assert points[2].flags()[-6:] == ['--taco-k', '32', '--warmup-steps', '0',
                                    '--lr', '0.0001']
  args.with_default = False
  assert [p.settings for p in multiclass_runs.grid(args)] == [
      'mu=0.9', 'k=32 warmup=0']
  for bad in ('beta=0.9', 'mu'):
    args.settings = bad
    with pytest.raises(SystemExit, match='NAME=VALUE'):
      multiclass_runs.grid(args)
  # What a run changed is read back from its config, in SETTINGS' order.
  _result(tmp_path, 'r', 'taco', 1e-4, True, 0, 0.5, warmup_steps=0,
          taco_k=32)
  row, = multiclass_runs.finished_runs(str(tmp_path))
  assert row['settings'] == 'k=32 warmup=0'
  assert multiclass_runs.settings_of({'taco_k': 16, 'taco_mu': 0.95,
                                      'warmup_steps': None}) == ''


def test_a_validation_run_is_read_back_as_one_and_kept_apart(tmp_path,
                                                             monkeypatch):
  monkeypatch.setattr(multiclass_runs, 'ROOT', str(tmp_path))
  monkeypatch.setattr(multiclass_runs, 'DATA', str(tmp_path / 'none.json'))
  _result(tmp_path, 'held-out', 'taco', 1e-4, True, 0, 0.5)
  directory = tmp_path / 'validation'
  directory.mkdir()
  results = run_results(
      optimizer='taco', learning_rate=1e-4, task='trec',
      after={'accuracy': 0.7}, before={'accuracy': 0.2},
      config={'task': 'trec', 'lr': 1e-4, 'steps': 40, 'seed': 0,
              'eval_split': 'validation'}, eval_split='validation')
  (directory / 'results.json').write_text(json.dumps(results.to_json()))
  rows = sorted(multiclass_runs.finished_runs(), key=lambda r: r['split'])
  assert [(r['split'], r['accuracy_after']) for r in rows] == [
      ('test', 0.5), ('validation', 0.7)]
  table = multiclass_tables.finished(rows)
  assert table[('trec', 'taco', 1e-4, 40, '')] == {0: (50.0, 20.0)}
  assert table[('trec', 'taco', 1e-4, 40, 'eval=validation')] == {
      0: (70.0, 20.0)}


def test_runs_recorded_before_the_split_are_in_no_summary(tmp_path,
                                                           monkeypatch,
                                                           capsys):
  # Rows recorded before validation sets existed name no split: their runs
  # trained on sets that still held the validation records. The summary
  # compares runs trained on today's split only, and the paired table pairs
  # each run with AdamW's run on the same set and split.
  monkeypatch.setattr(multiclass_runs, 'ROOT', str(tmp_path / 'runs'))
  monkeypatch.setattr(multiclass_runs, 'DATA', str(tmp_path / 'data.json'))
  monkeypatch.setattr(multiclass_tables, 'rule_rate',
                      lambda optimizer, steps: {'taco': 1e-4,
                                                'adamw': 3e-5}[optimizer])
  # (A new run of a recorded point replaces it: these are seeds 2 and 3.)
  pre = [_row('trec', opt, lr, seed, after, given=False)
         for opt, lr, afters in (('taco', 1e-4, (0.90, 0.92)),
                                 ('adamw', 3e-5, (0.10, 0.12)))
         for seed, after in enumerate(afters, start=2)]
  validation = [dict(_row('trec', opt, lr, seed, after, given=False),
                     split=multiclass_runs.VALIDATION)
                for opt, lr, afters in (('taco', 1e-4, (0.60, 0.61)),
                                        ('adamw', 3e-5, (0.50, 0.52)))
                for seed, after in enumerate(afters)]
  # The same point as today's run t0 below, before the split: both are kept.
  pre.append(_row('trec', 'taco', 1e-4, 0, 0.99, given=False))
  longer = [dict(row, steps=160) for row in pre[:4]]
  (tmp_path / 'data.json').write_text(json.dumps(
      {'source': 'earlier', 'runs': pre + validation + longer}))
  for seed, (taco, adamw) in enumerate(((0.47, 0.48), (0.46, 0.55))):
    _result(tmp_path / 'runs', f't{seed}', 'taco', 1e-4, False, seed, taco)
    _result(tmp_path / 'runs', f'a{seed}', 'adamw', 3e-5, False, seed, adamw)
  table = multiclass_tables.finished(multiclass_runs.rows())
  assert table[('trec', 'taco', 1e-4, 40, 'pre-split')] == {
      0: (99.0, 20.0), 2: (90.0, 20.0), 3: (92.0, 20.0)}
  assert table[('trec', 'taco', 1e-4, 40, '')] == {
      0: (47.0, 20.0), 1: (46.0, 20.0)}
  multiclass_tables.report(multiclass_runs.rows())
  out = capsys.readouterr().out
  # The summary: today's held-out runs only (47, 46 against 48, 55).
  assert '| trec | 6 | 2 | 46.5 ± 0.5 | 51.5 ± 3.5 | -5.0 ± 4.0 |' in out
  assert '| trec | 0.0001 (rule) | 40 | – | 0,1 | -1.0 -9.0 | ' in out
  assert '| trec | 0.0001 (rule) | 40 | pre-split | 2,3 | +80.0 +80.0 | ' in out
  assert ('| trec | 0.0001 (rule) | 40 | eval=validation | 0,1 | +10.0 +9.0 '
          '| ') in out
  # Pre-split runs alone at 160 steps: no summary there, not even a heading.
  assert 'The same at 160 steps' not in out
  assert ('| trec | taco | 0.0001 (rule) | 160 | pre-split | – | – | 90.0 |'
          in out)
  # Recording keeps the file's earlier source and adds the new note.
  multiclass_runs.record(multiclass_runs.DATA, 'two runs')
  data = json.loads((tmp_path / 'data.json').read_text())
  assert data['source'] == 'earlier; two runs'
  assert len(data['runs']) == 17
  assert sum(multiclass_fit.predates_split(r) for r in data['runs']) == 9


def _row(task, optimizer, lr, seed, after, given=True):
  return {'task': task, 'optimizer': optimizer, 'learning_rate': lr,
          'lr_given': given, 'steps': 40, 'seed': seed,
          'accuracy_after': after, 'accuracy_before': 0.2}


def test_recorded_rows_are_merged_with_runs_that_replace_them(tmp_path,
                                                              monkeypatch):
  monkeypatch.setattr(multiclass_runs, 'ROOT', str(tmp_path / 'runs'))
  monkeypatch.setattr(multiclass_runs, 'DATA', str(tmp_path / 'data.json'))
  assert multiclass_runs.rows() == []
  _result(tmp_path / 'runs', 'a', 'taco', 1e-4, False, 0, 0.47)
  _result(tmp_path / 'runs', 'b', 'taco', 1e-4, False, 1, 0.50)
  multiclass_runs.record(multiclass_runs.DATA, 'test')
  recorded = multiclass_runs.recorded()
  assert [r['accuracy_after'] for r in recorded] == [0.47, 0.50]
  assert recorded[0] == dict(_row('trec', 'taco', 1e-4, 0, 0.47, given=False),
                             split='test')
  # A new run of a recorded point replaces it; the others stay.
  (tmp_path / 'runs' / 'a' / 'results.json').unlink()
  (tmp_path / 'runs' / 'a').rmdir()
  _result(tmp_path / 'runs', 'c', 'taco', 1e-4, False, 1, 0.44)
  _result(tmp_path / 'runs', 'd', 'adamw', 3e-5, False, 1, 0.52)
  assert sorted((r['optimizer'], r['seed'], r['accuracy_after'])
                for r in multiclass_runs.rows()) == [
                    ('adamw', 1, 0.52), ('taco', 0, 0.47), ('taco', 1, 0.44)]


def test_fitted_rate_is_the_least_mean_shortfall_over_seed_means():
  rows = []
  # bbc: 1e-4 -> 0.86, 3e-4 -> 0.90, 1e-3 -> 0.92 (means of three seeds);
  # trec: 0.48, 0.47, 0.44. Shortfalls: 1e-4 (0.06 + 0) / 2, 3e-4
  # (0.02 + 0.01) / 2, 1e-3 (0 + 0.04) / 2: 3e-4.
  for task, means in (('bbc', (0.86, 0.90, 0.92)),
                      ('trec', (0.48, 0.47, 0.44))):
    for lr, mean in zip((1e-4, 3e-4, 1e-3), means):
      for seed, offset in enumerate((-0.01, 0.0, 0.01)):
        rows.append(_row(task, 'taco', lr, seed, mean + offset,
                         given=lr != 1e-4))
  # A rate with two seeds only does not count, however good.
  rows += [_row('bbc', 'taco', 2e-3, s, 0.99) for s in (0, 1)]
  rows += [_row('trec', 'taco', 2e-3, s, 0.99) for s in (0, 1)]
  # These rows were scored on the held-out set: only the legacy fit takes
  # them; the fit a rate is chosen by refuses to run without validation runs.
  legacy = {'split': multiclass_runs.TEST}
  with pytest.raises(multiclass_fit.NoValidationRuns, match='no validation'):
    multiclass_fit.fitted_rate(rows, 'taco')
  assert multiclass_fit.seed_means(rows, 'taco') == {}
  means = multiclass_fit.seed_means(rows, 'taco', **legacy)
  assert means['bbc'][3e-4][0] == pytest.approx(0.90)
  # More seeds at one rate: the rates are compared on the seeds all ran.
  extra = [_row('trec', 'taco', 1e-4, seed, 0.10) for seed in (3, 4, 5)]
  assert multiclass_fit.seed_means(rows + extra, 'taco', **legacy)['trec'][
      1e-4][0] == pytest.approx(0.48)
  assert set(means['trec']) == {1e-4, 3e-4, 1e-3}
  assert multiclass_fit.fitted_rate(rows, 'taco', **legacy) == 3e-4
  assert multiclass_fit.fitted_rate(rows, 'adamw', **legacy) is None
  # Held-out runs on today's split are reported, never fitted on.
  assert multiclass_fit.seed_means([dict(r, split=multiclass_runs.TEST)
                                     for r in rows], 'taco', **legacy) == {}
  # Runs that changed a setting are not the CLI's: the fit leaves them out.
  varied = [dict(_row('trec', 'taco', 1e-3, s, 0.99), settings='mu=0.9')
            for s in (0, 1, 2)]
  assert multiclass_fit.seed_means(rows + varied, 'taco', **legacy) == means
  # On one task alone, its best rate.
  assert multiclass_fit.fitted_rate(
      [r for r in rows if r['task'] == 'trec'], 'taco', **legacy) == 1e-4
  # The same runs scored on validation sets: the validation fit takes them
  # and nothing else (held-out runs that favour 1e-3 do not move it).
  validation = [dict(r, split=multiclass_runs.VALIDATION) for r in rows]
  favour = [_row(task, 'taco', 1e-3, s, 0.99) for task in ('bbc', 'trec')
            for s in (0, 1, 2)]
  assert multiclass_fit.seed_means(validation + favour, 'taco') == means
  assert multiclass_fit.fitted_rate(validation + favour, 'taco') == 3e-4
  assert multiclass_fit.fitted_rate(rows + favour, 'taco', **legacy) == 1e-3


def test_sensitivity_is_the_change_at_half_and_twice_the_fitted_rate(
    capsys):
  # A grid that doubles (to within 5%): 1.5e-4, 3e-4, 6.1e-4.
  means = {'bbc': (0.80, 0.90, 0.95), 'trec': (0.48, 0.47, 0.30)}
  rows = [dict(_row(task, 'taco', lr, seed, mean + offset),
               split=multiclass_runs.VALIDATION)
          for task, task_means in means.items()
          for lr, mean in zip((1.5e-4, 3e-4, 6.1e-4), task_means)
          for seed, offset in enumerate((-0.01, 0.0, 0.01))]
  # Shortfalls: 1.5e-4 (0.15 + 0) / 2, 3e-4 (0.05 + 0.01) / 2, 6.1e-4
  # (0 + 0.18) / 2.
  assert multiclass_fit.fitted_rate(rows, 'taco') == 3e-4
  changes = multiclass_fit.sensitivity(rows, 'taco')
  assert changes == {'bbc': pytest.approx((-0.10, 0.05)),
                     'trec': pytest.approx((0.01, -0.17))}
  # Twice the rate not run on trec over three seeds: no figure there.
  fewer = [r for r in rows if not (r['task'] == 'trec'
                                   and r['learning_rate'] == 6.1e-4
                                   and r['seed'] == 2)]
  assert multiclass_fit.sensitivity(fewer, 'taco')['trec'] == (
      pytest.approx(0.01), None)
  with pytest.raises(multiclass_fit.NoValidationRuns):
    multiclass_fit.sensitivity(rows, 'adamw')
  multiclass_fit.fit_report(rows)
  out = capsys.readouterr().out
  assert '| taco | 0.0003 | bbc | -10.0 | +5.0 |' in out
  assert '| taco | 0.0003 | trec | +1.0 | -17.0 |' in out


def test_long_budget_rows_take_the_rate_validation_runs_there_favour(
    tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(multiclass_runs, 'ROOT', str(tmp_path / 'runs'))
  monkeypatch.setattr(multiclass_runs, 'DATA', str(tmp_path / 'data.json'))
  monkeypatch.setattr(
      multiclass_tables, 'rule_rate',
      lambda optimizer, steps: {'taco': 1e-4 if steps == 40 else 5e-5,
                                'adamw': 3e-5}[optimizer])

  def row(task, optimizer, lr, seed, after, steps, split):
    return dict(_row(task, optimizer, lr, seed, after), steps=steps,
                split=split)

  test, validation = multiclass_runs.TEST, multiclass_runs.VALIDATION
  rows = [row('trec', 'taco', 1e-4, 0, 0.50, 40, test),
          row('trec', 'taco', 1e-4, 1, 0.52, 40, test),
          row('trec', 'adamw', 3e-5, 0, 0.55, 40, test),
          row('trec', 'adamw', 3e-5, 1, 0.53, 40, test)]
  # At 500 steps, one seed of two rates on two tasks' validation sets.
  # Shortfalls from each task's best: 5e-5 (0.18 + 0) / 2, 2e-4 (0 + 0.02) / 2.
  validated = [row('trec', 'taco', 5e-5, 0, 0.70, 500, validation),
               row('trec', 'taco', 2e-4, 0, 0.88, 500, validation),
               row('tweets', 'taco', 5e-5, 0, 0.80, 500, validation),
               row('tweets', 'taco', 2e-4, 0, 0.78, 500, validation),
               # Run on one task only: no choice between tasks.
               row('trec', 'taco', 8e-4, 0, 0.99, 500, validation)]
  rows += validated
  rows += [row('trec', 'taco', 2e-4, 0, 0.80, 500, test),
           row('trec', 'taco', 2e-4, 1, 0.84, 500, test),
           row('trec', 'taco', 5e-5, 0, 0.70, 500, test),
           row('trec', 'adamw', 3e-5, 0, 0.86, 500, test),
           row('trec', 'adamw', 3e-5, 1, 0.85, 500, test)]
  assert multiclass_fit.long_budget_rate(rows, 'taco', 500) == (
      2e-4, ['trec', 'tweets'], 1)
  # One rate on the validation sets is no choice; nor are held-out runs.
  assert multiclass_fit.long_budget_rate(
      [r for r in rows if r['learning_rate'] != 2e-4], 'taco', 500) is None
  assert multiclass_fit.long_budget_rate(rows, 'adamw', 500) is None
  # The rule's fit still wants three seeds a rate.
  assert multiclass_fit.seed_means(rows, 'taco', 500) == {}
  (tmp_path / 'data.json').write_text(json.dumps({'runs': rows}))
  multiclass_tables.report(multiclass_runs.rows())
  out = capsys.readouterr().out
  heading, table = out.split('The same beside the longer budgets')[1].split(
      '\n\n')[:2]
  assert ('TACO 0.0002 (chosen on the validation sets of trec, tweets at '
          'this budget, 1 seed a rate; the rule gives 5e-05)') in heading
  assert "AdamW 3e-05 (its rule's rate" in heading
  # 40 steps at the rule's rates; 500 at the chosen one: TACO 80, 84 (82.0
  # ± 2.0), AdamW 86, 85 (85.5 ± 0.5), differences -6, -1 (-3.5 ± 2.5).
  assert table.splitlines()[2:] == [
      '| trec | 6 | 40 | 0.0001 | 3e-05 | 2 | 51.0 ± 1.0 | 54.0 ± 1.0 | '
      '-3.0 ± 2.0 |',
      '| trec | 6 | 500 | 0.0002 | 3e-05 | 2 | 82.0 ± 2.0 | 85.5 ± 0.5 | '
      '-3.5 ± 2.5 |']
  # One seed of a pair is a row too, with no error.
  (tmp_path / 'data.json').write_text(json.dumps({'runs': [
      r for r in rows if not (r['steps'] == 500 and r['seed'] == 1)]}))
  multiclass_tables.report(multiclass_runs.rows())
  assert ('| trec | 6 | 500 | 0.0002 | 3e-05 | 1 | 80.0 | 86.0 | -6.0 |'
          in capsys.readouterr().out)
