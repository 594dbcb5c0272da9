"""``python -m examples.finetune`` on a tiny random Hugging Face directory."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import flags
from examples.finetune import optimizers
from examples.finetune import results as run_results
from tests.support import tiny_llama


@pytest.mark.parametrize('optimizer', ['taco', 'adamw'])
def test_smoke_run_writes_results(workspace, optimizer, capsys):
  output_dir = workspace['root'] / f'run-{optimizer}'
  assert cli.main(tiny_llama.text_args(workspace, output_dir,
                                       '--optimizer', optimizer)) == 0
  with open(output_dir / 'results.json') as f:
    results = json.load(f)
  # The file reads back as RunResults, key for key.
  assert run_results.RunResults.read(str(output_dir)).to_json() == results
  assert results['optimizer'] == optimizer
  assert results['eval_split'] == 'test'
  assert len(results['losses']) == 3
  assert all(np.isfinite(results['losses']))
  assert 0.0 <= results['before']['accuracy'] <= 1.0
  assert [e['step'] for e in results['evals']] == [2, 3]
  assert results['tokens_per_second'] > 0
  assert results['peak_memory_bytes'] > results['parameter_bytes'] > 0
  # TACO's history: 5k+1 bytes per column of every matrix, far below AdamW's
  # two f32 moments (8 bytes per parameter).
  state = results['optimizer_state_bytes']
  if optimizer == 'adamw':
    assert state >= 2 * results['parameter_bytes']
  else:
    assert 0 < state < results['parameter_bytes']
  # No --lr: the budget rule's rate for 3 steps, said in the log.
  rate = optimizers.get(optimizer).default_rate(3)
  assert results['learning_rate'] == rate.lr
  assert results['learning_rate_source'] == rate.why
  table = capsys.readouterr().out
  assert f'lr {rate.lr:g} (budget rule: ' in table
  assert 'accuracy before' in table and 'optimizer state' in table


def test_generation_task_runs(workspace):
  squad = [{'title': 'T', 'context': f'The number is {i}.',
            'question': 'What is the number?',
            'answers': {'text': [str(i)], 'answer_start': [14]}}
           for i in range(6)]
  train = tiny_llama.write_jsonl(workspace['root'] / 'squad.jsonl', squad)
  output_dir = workspace['root'] / 'run-squad'
  assert cli.main([
      '--model', workspace['model'], '--task', 'squad', '--train-file', train,
      '--test-file', train, '--steps', '1', '--batch-size', '2',
      '--seq-len', '48', '--max-new-tokens', '3', '--eval-batch-size', '4',
      '--optimizer', 'adamw', '--output-dir', str(output_dir),
      '--no-progress']) == 0
  with open(output_dir / 'results.json') as f:
    results = json.load(f)
  assert set(results['after']) == {'f1', 'em'}


def _run_cli_expecting_error(args, output_dir):
  process = subprocess.run(
      [sys.executable, '-m', 'examples.finetune', *args],
      cwd=tiny_llama.REPO_ROOT, capture_output=True, text=True, timeout=120,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert process.returncode != 0
  lines = process.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), process.stderr
  assert not os.path.exists(output_dir), 'nothing may be written on error'
  return lines[0]


def test_missing_model_is_one_line_error(workspace):
  output_dir = workspace['root'] / 'never-missing-model'
  args = tiny_llama.text_args(workspace, output_dir)
  args[args.index('--model') + 1] = str(workspace['root'] / 'no-such-model')
  message = _run_cli_expecting_error(args, output_dir)
  assert 'no-such-model' in message


def _error_of(args, capsys) -> str:
  assert cli.main(args) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ')
  return lines[0]


def test_unsupported_architecture(workspace, capsys):
  model_dir = str(workspace['root'] / 'bert')
  tiny_llama.write_tiny_llama(model_dir, vocab_size=264,
                              architecture='BertModel')
  output_dir = workspace['root'] / 'never-bert'
  args = tiny_llama.text_args(workspace, output_dir)
  args[args.index('--model') + 1] = model_dir
  assert 'unsupported architecture' in _error_of(args, capsys)
  assert not output_dir.exists()


def test_unknown_label_and_missing_field(workspace, capsys):
  output_dir = workspace['root'] / 'never-data'
  bad = tiny_llama.write_jsonl(workspace['root'] / 'bad.jsonl',
                               [{'text': 'x', 'label': 'pos'},
                      {'text': 'y', 'label': 'meh'}])
  args = tiny_llama.text_args(workspace, output_dir)
  args[args.index('--train-file') + 1] = bad
  message = _error_of(args, capsys)
  assert 'record 2' in message and "unknown label 'meh'" in message
  missing = tiny_llama.write_jsonl(workspace['root'] / 'missing.jsonl',
                                   [{'label': 'pos'}])
  args[args.index('--train-file') + 1] = missing
  assert "'text'" in _error_of(args, capsys)
  assert not output_dir.exists()


def test_sequence_longer_than_positions(workspace, capsys):
  output_dir = workspace['root'] / 'never-long'
  args = tiny_llama.text_args(workspace, output_dir)
  args[args.index('--seq-len') + 1] = str(tiny_llama.MAX_POSITIONS + 1)
  assert 'positions' in _error_of(args, capsys)
  assert not output_dir.exists()


def test_foreseeable_out_of_memory_is_refused(workspace):
  output_dir = workspace['root'] / 'never-oom'
  message = tiny_llama.memory_error(workspace, output_dir, optimizer='adamw',
                                    batch_size=2, memory_limit_gb=1e-6)
  match = re.fullmatch(
      r'--optimizer adamw at --batch-size 2 x --seq-len 24 needs about '
      r'(\S+) GB \(predicted\), the device has 1e-06 GB; try '
      r'--optimizer taco', message)
  assert match, message
  # A limit that holds batch 2 but not batch 4: the advice names batch 2.
  needed_gb = float(match.group(1)) * 1.001
  message = tiny_llama.memory_error(workspace, output_dir, optimizer='adamw',
                                    batch_size=4, memory_limit_gb=needed_gb)
  assert 'try --batch-size 2 or --optimizer taco' in message, message
  message = tiny_llama.memory_error(workspace, output_dir, optimizer='taco',
                                    taco_step='optax', remat=False,
                                    batch_size=2, memory_limit_gb=1e-6)
  assert message.endswith('try --remat on or --taco-step auto'), message


def test_memory_limit_must_be_positive():
  with pytest.raises(flags.FinetuneError) as error:
    flags.RunConfig(memory_limit_gb=0.0)
  assert str(error.value) == ('--memory-limit-gb must be a finite number > 0, '
                              'got 0.0')
