"""Tiny random Hugging Face checkpoints, saved as safetensors, for parity tests.

The reference implementation is PyTorch ``transformers``: a test-only
dependency. Tests that need it are skipped, with the install line, when it is
absent.
"""

import json
import os

import numpy as np
import pytest

TORCH_INSTALL = 'pip install torch==2.13.0 transformers'

# Small but not degenerate: grouped K/V heads, head_dim != d / heads where the
# family allows it, two layers, right padding inside the sequence length.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)

HF_MODELS = {
    # name: (transformers config class, config kwargs)
    'llama': ('LlamaConfig', dict(
        num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500.0,
        rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0,
                          original_max_position_embeddings=16))),
    'llama_tied': ('LlamaConfig', dict(num_key_value_heads=1,
                                       tie_word_embeddings=True,
                                       attention_bias=True)),
    'mistral': ('MistralConfig', dict(num_key_value_heads=2, sliding_window=5,
                                      head_dim=8)),
    'qwen3': ('Qwen3Config', dict(num_key_value_heads=2, head_dim=24,
                                  tie_word_embeddings=True)),
    'opt': ('OPTConfig', dict(ffn_dim=96, word_embed_proj_dim=64,
                              pad_token_id=1)),
    'gpt_neox': ('GPTNeoXConfig', dict(partial_rotary_factor=0.25,
                                       use_parallel_residual=True)),
    'gpt_neox_sequential': ('GPTNeoXConfig', dict(
        partial_rotary_factor=0.5, use_parallel_residual=False)),
}
_ARCHITECTURE = {'LlamaConfig': 'LlamaForCausalLM',
                 'MistralConfig': 'MistralForCausalLM',
                 'Qwen3Config': 'Qwen3ForCausalLM',
                 'OPTConfig': 'OPTForCausalLM',
                 'GPTNeoXConfig': 'GPTNeoXForCausalLM'}


def torch_and_transformers():
  torch = pytest.importorskip(
      'torch', reason=f'parity tests need PyTorch: {TORCH_INSTALL}')
  transformers = pytest.importorskip(
      'transformers', reason=f'parity tests need transformers: {TORCH_INSTALL}')
  return torch, transformers


def write_word_tokenizer(directory: str, vocab_size: int):
  """A whitespace word-level tokenizer.json (the loader requires one)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  vocab = {'<unk>': 0, **{f'w{i}': i for i in range(1, vocab_size)}}
  tokenizer = tokenizers.Tokenizer(
      tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))


def save_hf_model(name: str, directory: str, seed: int = 0, **save_kwargs):
  """Builds a random ``transformers`` model, perturbs every weight, saves it.

  Perturbing (norm weights away from 1, biases away from 0) makes a swapped
  or dropped tensor visible in the logits.

  Returns:
    The PyTorch model (float32, eval mode).
  """
  torch, transformers = torch_and_transformers()
  config_class, kwargs = HF_MODELS[name]
  config = getattr(transformers, config_class)(**{**_COMMON, **kwargs})
  config.architectures = [_ARCHITECTURE[config_class]]
  torch.manual_seed(seed)
  model = getattr(transformers, _ARCHITECTURE[config_class])._from_config(
      config, attn_implementation='eager').float()
  with torch.no_grad():
    for parameter in model.parameters():
      parameter.add_(0.1 * torch.randn_like(parameter))
  model.eval()
  model.save_pretrained(directory, **save_kwargs)
  write_word_tokenizer(directory, config.vocab_size)
  return model


def reference_logits(torch_model, input_ids: np.ndarray,
                     attention_mask: np.ndarray) -> np.ndarray:
  torch, _ = torch_and_transformers()
  with torch.no_grad():
    output = torch_model(input_ids=torch.from_numpy(input_ids).long(),
                         attention_mask=torch.from_numpy(
                             attention_mask.astype(np.int64)))
  return output.logits.float().numpy()


def read_config(directory: str) -> dict:
  with open(os.path.join(directory, 'config.json'), encoding='utf-8') as f:
    return json.load(f)


def write_config(directory: str, values: dict):
  with open(os.path.join(directory, 'config.json'), 'w',
            encoding='utf-8') as f:
    json.dump(values, f)
