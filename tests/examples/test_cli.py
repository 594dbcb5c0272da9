"""``python -m examples.finetune`` on a tiny random Hugging Face directory."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

safetensors_numpy = pytest.importorskip('safetensors.numpy')
tokenizers = pytest.importorskip('tokenizers')

from examples.finetune import __main__ as cli  # pylint: disable=g-import-not-at-top
from examples.finetune import flags  # pylint: disable=g-import-not-at-top
from examples.finetune import loop  # pylint: disable=g-import-not-at-top
from examples.finetune import optimizers  # pylint: disable=g-import-not-at-top

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_HIDDEN, _LAYERS, _HEADS, _KV_HEADS, _FFN = 32, 2, 4, 2, 48
_MAX_POSITIONS = 128


def _byte_level_tokenizer() -> 'tokenizers.Tokenizer':
  """Bytes as tokens (256) plus <s> and </s>: no training, any text works."""
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  vocab = {symbol: i for i, symbol in enumerate(alphabet)}
  vocab.update({'<s>': 256, '</s>': 257})
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  tokenizer.add_special_tokens(['<s>', '</s>'])
  return tokenizer


def _write_tiny_llama(directory: str, vocab_size: int, *,
                      architecture: str = 'LlamaForCausalLM',
                      tied: bool = False) -> None:
  """config.json, model.safetensors (HF names, (out, in)) and tokenizer.json;
  ``tied``: the output projection is the token embedding (no lm_head).
  """
  os.makedirs(directory, exist_ok=True)
  head_dim = _HIDDEN // _HEADS
  config = {
      'architectures': [architecture], 'model_type': 'llama',
      'vocab_size': vocab_size, 'hidden_size': _HIDDEN,
      'intermediate_size': _FFN, 'num_hidden_layers': _LAYERS,
      'num_attention_heads': _HEADS, 'num_key_value_heads': _KV_HEADS,
      'head_dim': head_dim, 'max_position_embeddings': _MAX_POSITIONS,
      'rms_norm_eps': 1e-5, 'rope_theta': 10000.0, 'hidden_act': 'silu',
      'tie_word_embeddings': tied, 'bos_token_id': 256, 'eos_token_id': 257,
      'torch_dtype': 'float32',
  }
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(config, f)
  rng = np.random.default_rng(0)
  normal = lambda *shape: (0.05 * rng.standard_normal(shape)).astype(
      np.float32)
  weights = {'model.embed_tokens.weight': normal(vocab_size, _HIDDEN),
             'model.norm.weight': np.ones(_HIDDEN, np.float32)}
  if not tied:
    weights['lm_head.weight'] = normal(vocab_size, _HIDDEN)
  for layer in range(_LAYERS):
    prefix = f'model.layers.{layer}.'
    weights.update({
        prefix + 'input_layernorm.weight': np.ones(_HIDDEN, np.float32),
        prefix + 'post_attention_layernorm.weight': np.ones(_HIDDEN,
                                                            np.float32),
        prefix + 'self_attn.q_proj.weight': normal(_HEADS * head_dim, _HIDDEN),
        prefix + 'self_attn.k_proj.weight': normal(_KV_HEADS * head_dim,
                                                   _HIDDEN),
        prefix + 'self_attn.v_proj.weight': normal(_KV_HEADS * head_dim,
                                                   _HIDDEN),
        prefix + 'self_attn.o_proj.weight': normal(_HIDDEN, _HEADS * head_dim),
        prefix + 'mlp.gate_proj.weight': normal(_FFN, _HIDDEN),
        prefix + 'mlp.up_proj.weight': normal(_FFN, _HIDDEN),
        prefix + 'mlp.down_proj.weight': normal(_HIDDEN, _FFN),
    })
  safetensors_numpy.save_file(weights,
                              os.path.join(directory, 'model.safetensors'))
  _byte_level_tokenizer().save(os.path.join(directory, 'tokenizer.json'))


def _write_jsonl(path, records) -> str:
  with open(path, 'w') as f:
    for record in records:
      f.write(json.dumps(record) + '\n')
  return str(path)


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
  root = tmp_path_factory.mktemp('finetune')
  model_dir = str(root / 'tiny-llama')
  _write_tiny_llama(model_dir, vocab_size=264)
  words = ['good', 'bad', 'fine', 'awful', 'great', 'poor']
  records = [{'text': f'{w} day {i}', 'label': 'pos' if i % 2 else 'neg'}
             for i, w in enumerate(words * 4)]
  return {
      'root': root,
      'model': model_dir,
      'train': _write_jsonl(root / 'train.jsonl', records),
      'test': _write_jsonl(root / 'test.jsonl', records[:6]),
  }


def _text_args(workspace, output_dir, *extra):
  return ['--model', workspace['model'], '--task', 'text',
          '--train-file', workspace['train'], '--test-file', workspace['test'],
          '--label-words', 'neg=bad,pos=good', '--template', '{text}. It was',
          '--steps', '3', '--batch-size', '2', '--seq-len', '24',
          '--eval-size', '6', '--eval-batch-size', '4', '--eval-every', '2',
          '--output-dir', str(output_dir), '--no-progress', *extra]


@pytest.mark.parametrize('optimizer', ['taco', 'adamw'])
def test_smoke_run_writes_results(workspace, optimizer, capsys):
  output_dir = workspace['root'] / f'run-{optimizer}'
  assert cli.main(_text_args(workspace, output_dir,
                             '--optimizer', optimizer)) == 0
  with open(output_dir / 'results.json') as f:
    results = json.load(f)
  assert results['optimizer'] == optimizer
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
  train = _write_jsonl(workspace['root'] / 'squad.jsonl', squad)
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
      cwd=_REPO_ROOT, capture_output=True, text=True, timeout=120,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert process.returncode != 0
  lines = process.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), process.stderr
  assert not os.path.exists(output_dir), 'nothing may be written on error'
  return lines[0]


def test_missing_model_is_one_line_error(workspace):
  output_dir = workspace['root'] / 'never-missing-model'
  args = _text_args(workspace, output_dir)
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
  _write_tiny_llama(model_dir, vocab_size=264, architecture='BertModel')
  output_dir = workspace['root'] / 'never-bert'
  args = _text_args(workspace, output_dir)
  args[args.index('--model') + 1] = model_dir
  assert 'unsupported architecture' in _error_of(args, capsys)
  assert not output_dir.exists()


def test_unknown_label_and_missing_field(workspace, capsys):
  output_dir = workspace['root'] / 'never-data'
  bad = _write_jsonl(workspace['root'] / 'bad.jsonl',
                     [{'text': 'x', 'label': 'pos'},
                      {'text': 'y', 'label': 'meh'}])
  args = _text_args(workspace, output_dir)
  args[args.index('--train-file') + 1] = bad
  message = _error_of(args, capsys)
  assert 'record 2' in message and "unknown label 'meh'" in message
  missing = _write_jsonl(workspace['root'] / 'missing.jsonl',
                         [{'label': 'pos'}])
  args[args.index('--train-file') + 1] = missing
  assert "'text'" in _error_of(args, capsys)
  assert not output_dir.exists()


def test_sequence_longer_than_positions(workspace, capsys):
  output_dir = workspace['root'] / 'never-long'
  args = _text_args(workspace, output_dir)
  args[args.index('--seq-len') + 1] = str(_MAX_POSITIONS + 1)
  assert 'positions' in _error_of(args, capsys)
  assert not output_dir.exists()


def _memory_error(workspace, output_dir, **overrides) -> str:
  config = flags.RunConfig(
      model=workspace['model'], task='text', train_file=workspace['train'],
      test_file=workspace['test'], label_words='neg=bad,pos=good',
      template='{text}. It was', steps=3, seq_len=24, eval_size=6,
      eval_batch_size=4, output_dir=str(output_dir), progress=False,
      **overrides)
  with pytest.raises(flags.FinetuneError) as error:
    loop.run(config, log=lambda _: None)
  assert not output_dir.exists(), 'nothing may be written on error'
  message = str(error.value)
  assert '\n' not in message
  return message


def test_foreseeable_out_of_memory_is_refused(workspace):
  output_dir = workspace['root'] / 'never-oom'
  message = _memory_error(workspace, output_dir, optimizer='adamw',
                          batch_size=2, memory_limit_gb=1e-6)
  match = re.fullmatch(
      r'--optimizer adamw at --batch-size 2 x --seq-len 24 needs about '
      r'(\S+) GB \(predicted\), the device has 1e-06 GB; try '
      r'--optimizer taco', message)
  assert match, message
  # A limit that holds batch 2 but not batch 4: the advice names batch 2.
  needed_gb = float(match.group(1)) * 1.001
  message = _memory_error(workspace, output_dir, optimizer='adamw',
                          batch_size=4, memory_limit_gb=needed_gb)
  assert 'try --batch-size 2 or --optimizer taco' in message, message
  message = _memory_error(workspace, output_dir, optimizer='taco',
                          taco_step='optax', remat=False, batch_size=2,
                          memory_limit_gb=1e-6)
  assert message.endswith('try --remat on or --taco-step auto'), message


def test_memory_limit_must_be_positive():
  with pytest.raises(flags.FinetuneError) as error:
    flags.RunConfig(memory_limit_gb=0.0)
  assert str(error.value) == ('--memory-limit-gb must be a finite number > 0, '
                              'got 0.0')
