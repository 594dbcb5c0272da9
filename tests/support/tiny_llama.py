"""A tiny Hugging Face Llama directory and a text task, for the example's tests.

``python -m examples.finetune`` reads a model directory as the Hub ships it
(config.json, model.safetensors, tokenizer.json); :func:`write_tiny_llama`
writes one of two layers with random weights and a byte-level tokenizer, and
:func:`write_workspace` adds a sentiment task's train and test files, which
:func:`text_args` turns into the CLI's flags. ``tests/examples/conftest.py``
gives the workspace to every test as the ``workspace`` fixture.
"""

import json
import os

import ml_dtypes
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip('safetensors.numpy')
tokenizers = pytest.importorskip('tokenizers')

# After the skips: the example's modules need both packages.
from examples.finetune import flags  # noqa: E402
from examples.finetune import loop  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_HIDDEN, _LAYERS, _HEADS, _KV_HEADS, _FFN = 32, 2, 4, 2, 48
MAX_POSITIONS = 128

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


def write_tiny_llama(directory: str, vocab_size: int, *,
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
      'head_dim': head_dim, 'max_position_embeddings': MAX_POSITIONS,
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


def write_jsonl(path, records) -> str:
  with open(path, 'w') as f:
    for record in records:
      f.write(json.dumps(record) + '\n')
  return str(path)

def write_workspace(root) -> dict:
  """A tiny Llama and a text task's files under ``root`` (a ``pathlib.Path``).
  """
  model_dir = str(root / 'tiny-llama')
  write_tiny_llama(model_dir, vocab_size=264)
  words = ['good', 'bad', 'fine', 'awful', 'great', 'poor']
  records = [{'text': f'{w} day {i}', 'label': 'pos' if i % 2 else 'neg'}
             for i, w in enumerate(words * 4)]
  return {
      'root': root,
      'model': model_dir,
      'train': write_jsonl(root / 'train.jsonl', records),
      'test': write_jsonl(root / 'test.jsonl', records[:6]),
  }


def text_args(workspace, output_dir, *extra):
  """The CLI's flags for 3 steps of the workspace's task, then ``extra``."""
  return ['--model', workspace['model'], '--task', 'text',
          '--train-file', workspace['train'], '--test-file', workspace['test'],
          '--label-words', 'neg=bad,pos=good', '--template', '{text}. It was',
          '--steps', '3', '--batch-size', '2', '--seq-len', '24',
          '--eval-size', '6', '--eval-batch-size', '4', '--eval-every', '2',
          '--output-dir', str(output_dir), '--no-progress', *extra]


def memory_error(workspace, output_dir, **overrides) -> str:
  """The one-line refusal of a run of the workspace's task (``overrides``:
  its other settings); nothing may be written."""
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


def assert_state_equal_up_to_sum_order(got_state, expected_state):
  """The trained parameters and the whole optimizer state, leaf by leaf: the
  same TACO winners and history rows (exact), values and moments equal up
  to the summation order of the sharded gradients."""
  assert got_state.keys() == expected_state.keys()
  for name, want in expected_state.items():
    have = got_state[name]
    assert (have.dtype, have.shape) == (want.dtype, want.shape), name
    if not np.issubdtype(want.dtype, np.floating):  # indices, exponents
      np.testing.assert_array_equal(have, want, err_msg=name)
    elif want.dtype == ml_dtypes.float8_e4m3fn:  # history values
      np.testing.assert_array_equal(have.view(np.uint8), want.view(np.uint8),
                                    err_msg=name)
    else:
      np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-7,
                                 err_msg=name)
