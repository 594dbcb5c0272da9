"""Load pretrained weights and tokenizers from Hugging Face or GGUF files.

:func:`load_pretrained` takes a Hugging Face model directory (read here) or a
``.gguf`` file (:mod:`gguf`); both build the model with
:func:`weights.build` (abstract model, then each parameter by name through a
per-family table, PyTorch ``(out, in)`` -> Flax ``(in, out)``). Nothing is
unpickled: Hugging Face weights are read from ``.safetensors`` files only.
"""

import os
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np
import tokenizers

from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import weights as weights_lib

_LLAMA_BLOCK = {
    'attn_norm': 'input_layernorm', 'attn.q': 'self_attn.q_proj',
    'attn.k': 'self_attn.k_proj', 'attn.v': 'self_attn.v_proj',
    'attn.o': 'self_attn.o_proj', 'attn.q_norm': 'self_attn.q_norm',
    'attn.k_norm': 'self_attn.k_norm', 'mlp_norm': 'post_attention_layernorm',
    'mlp.gate': 'mlp.gate_proj', 'mlp.up': 'mlp.up_proj',
    'mlp.down': 'mlp.down_proj'}
_LLAMA = weights_lib.NameTable(
    top={'embed': 'model.embed_tokens', 'final_norm': 'model.norm',
         'lm_head': 'lm_head'},
    block=_LLAMA_BLOCK, layer='model.layers.{}.', leaf=weights_lib.TORCH_LEAVES)
_HF_TABLES = {
    'llama': _LLAMA,
    'mistral': _LLAMA,
    'qwen3': _LLAMA,
    'opt': weights_lib.NameTable(
        top={'embed': 'model.decoder.embed_tokens',
             'positions': 'model.decoder.embed_positions',
             'final_norm': 'model.decoder.final_layer_norm',
             'lm_head': 'lm_head'},
        block={'attn_norm': 'self_attn_layer_norm',
               'attn.q': 'self_attn.q_proj', 'attn.k': 'self_attn.k_proj',
               'attn.v': 'self_attn.v_proj', 'attn.o': 'self_attn.out_proj',
               'mlp_norm': 'final_layer_norm', 'mlp.fc1': 'fc1',
               'mlp.fc2': 'fc2'},
        layer='model.decoder.layers.{}.', leaf=weights_lib.TORCH_LEAVES),
    'gpt_neox': weights_lib.NameTable(
        top={'embed': 'gpt_neox.embed_in',
             'final_norm': 'gpt_neox.final_layer_norm',
             'lm_head': 'embed_out'},
        block={'attn_norm': 'input_layernorm',
               'attn.qkv': 'attention.query_key_value',
               'attn.o': 'attention.dense',
               'mlp_norm': 'post_attention_layernorm',
               'mlp.fc1': 'mlp.dense_h_to_4h', 'mlp.fc2': 'mlp.dense_4h_to_h'},
        layer='gpt_neox.layers.{}.', leaf=weights_lib.TORCH_LEAVES),
}


def hf_table(family: str) -> weights_lib.NameTable:
  """The Hugging Face name table of ``family``: loading and export use it."""
  return _HF_TABLES[family]


class _SafetensorsSource:
  """One ``model.safetensors`` or shards listed in the index file."""

  def __init__(self, directory: str):
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    index_path = os.path.join(directory, 'model.safetensors.index.json')
    single_path = os.path.join(directory, 'model.safetensors')
    if os.path.exists(index_path):
      weight_map = weights_lib.read_json(index_path).get('weight_map')
      if not isinstance(weight_map, dict):
        raise weights_lib.ModelLoadError(
            f'{index_path} has no "weight_map" object.')
      shards = sorted(set(weight_map.values()))
    elif os.path.exists(single_path):
      shards = ['model.safetensors']
    else:
      raise weights_lib.ModelLoadError(
          f'{directory} has no model.safetensors or '
          'model.safetensors.index.json (PyTorch .bin files are not read: '
          'they would need unpickling; save the model with safetensors).')
    self._files = {}
    self._where = {}
    for shard in shards:
      shard_path = os.path.join(directory, shard)
      if not os.path.exists(shard_path):
        raise weights_lib.ModelLoadError(
            f'checkpoint shard {shard_path} is missing.')
      try:
        handle = safe_open(shard_path, framework='numpy')
      except Exception as e:  # pylint: disable=broad-except
        raise weights_lib.ModelLoadError(
            f'cannot read {shard_path}: {e}') from None
      self._files[shard] = handle
      for name in handle.keys():
        self._where[name] = shard

  def names(self) -> set[str]:
    return set(self._where)

  def read(self, name: str) -> np.ndarray:
    return self._files[self._where[name]].get_tensor(name)


def load_pretrained(path: str, *, dtype: Any = jnp.bfloat16,
                    param_dtype: Any = None,
                    remat: Optional[str] = 'block',
                    remat_policy: str = 'nothing_saveable',
                    scan_layers: bool = False
                    ) -> tuple[decoder_lib.DecoderLM, tokenizers.Tokenizer,
                               config_lib.ModelConfig]:
  """Loads a model, its tokenizer and its config.

  Args:
    path: a Hugging Face model directory (``config.json``,
      ``model.safetensors`` or shards with ``model.safetensors.index.json``,
      ``tokenizer.json``) or a ``.gguf`` file (Llama architecture).
    dtype: computation dtype.
    param_dtype: stored parameters' dtype; ``None``: ``dtype``.
    remat: see :class:`decoder.DecoderLM`.
    remat_policy: see :class:`decoder.DecoderLM`.
    scan_layers: see :class:`decoder.DecoderLM`.

  Returns:
    ``(model, tokenizer, config)``; the config holds ``bos_token_id`` and
    ``eos_token_id``.

  Raises:
    weights.ModelLoadError: with a one-line message for a missing path, a
      missing or malformed ``config.json``, an unsupported architecture,
      missing, unexpected or mis-shaped tensors, or a missing tokenizer.
  """
  path = os.fspath(path)
  build = dict(dtype=dtype, param_dtype=param_dtype, remat=remat,
               remat_policy=remat_policy, scan_layers=scan_layers)
  if not os.path.exists(path):
    raise weights_lib.ModelLoadError(f'model path {path} does not exist.')
  if os.path.isfile(path):
    if not path.endswith('.gguf'):
      raise weights_lib.ModelLoadError(
          f'{path} is a file but not a .gguf; pass a Hugging Face model '
          'directory or a GGUF file.')
    return gguf_lib.load_gguf(path, **build)
  return _load_hf_directory(path, **build)


def _load_hf_directory(directory: str, **build
                       ) -> tuple[decoder_lib.DecoderLM, tokenizers.Tokenizer,
                                  config_lib.ModelConfig]:
  config_path = os.path.join(directory, 'config.json')
  if not os.path.exists(config_path):
    raise weights_lib.ModelLoadError(
        f'{directory} has no config.json; is it a Hugging Face model '
        'directory?')
  hf_config = weights_lib.read_json(config_path)
  if not isinstance(hf_config, dict):
    raise weights_lib.ModelLoadError(f'{config_path} is not a JSON object.')
  try:
    config = config_lib.ModelConfig.from_hf_config(hf_config)
  except ValueError as e:
    raise weights_lib.ModelLoadError(f'{config_path}: {e}') from None
  tokenizer_path = os.path.join(directory, 'tokenizer.json')
  if not os.path.exists(tokenizer_path):
    raise weights_lib.ModelLoadError(f'{directory} has no tokenizer.json.')
  try:
    tokenizer = tokenizers.Tokenizer.from_file(tokenizer_path)
  except Exception as e:  # pylint: disable=broad-except
    raise weights_lib.ModelLoadError(
        f'cannot read {tokenizer_path}: {e}') from None
  source = _SafetensorsSource(directory)
  model = weights_lib.build(config, source, _HF_TABLES[config.family],
                            **build)
  return model, tokenizer, config


