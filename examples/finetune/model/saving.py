"""A model written as a Hugging Face directory that ``transformers`` loads.

:func:`save_pretrained` writes ``config.json``, ``model.safetensors`` (or
shards and ``model.safetensors.index.json`` above ``max_shard_bytes``), the
tokenizer files and ``generation_config.json``. The tensors are named by the
family's table in :mod:`loading` (the table loading reads them with) and
converted back to PyTorch's layout by :func:`weights.named_tensors`. The
folder is written as ``DIR.partial`` and renamed to ``DIR`` when complete, so
an interrupted export leaves no ``DIR``.

``config.json`` is the source's, carried through (its dtype set to the
exported one), when the model came from a Hugging Face directory; otherwise
(a GGUF file) it is built from the :class:`config.ModelConfig` by
:func:`hf_config`, which ``ModelConfig.from_hf_config`` reads back to the
same config (tested).
"""

import json
import os
import shutil
from typing import Any, Callable, Optional

from flax import nnx
import jax
import numpy as np
import tokenizers

from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import loading
from examples.finetune.model import weights as weights_lib

# transformers' own default shard size.
MAX_SHARD_BYTES = 5_000_000_000
PARTIAL = '.partial'
# Files of a Hugging Face tokenizer, copied as they are from a source folder.
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json',
                   'special_tokens_map.json', 'added_tokens.json',
                   'vocab.json', 'merges.txt', 'tokenizer.model',
                   'chat_template.jinja')
_ARCHITECTURES = {'llama': ('LlamaForCausalLM', 'llama'),
                  'mistral': ('MistralForCausalLM', 'mistral'),
                  'qwen3': ('Qwen3ForCausalLM', 'qwen3'),
                  'opt': ('OPTForCausalLM', 'opt'),
                  'gpt_neox': ('GPTNeoXForCausalLM', 'gpt_neox')}
_GPT_NEOX_ACTIVATIONS = {'gelu': 'gelu', 'gelu_tanh': 'gelu_new',
                         'relu': 'relu', 'silu': 'silu'}


class ExportError(ValueError):
  """An export that cannot be written; the message is one readable line."""


def _rope(config: config_lib.ModelConfig) -> dict[str, Any]:
  scaling = None
  if config.rope_type != 'default':
    scaling = {'rope_type': config.rope_type, **{
        key: (int(value) if key == 'original_max_position_embeddings'
              else value) for key, value in config.rope_scaling}}
  return {'rope_theta': config.rope_theta, 'rope_scaling': scaling}


def hf_config(config: config_lib.ModelConfig, dtype: str) -> dict[str, Any]:
  """A ``config.json`` dictionary that describes ``config``."""
  architecture, model_type = _ARCHITECTURES[config.family]
  common = dict(
      architectures=[architecture], model_type=model_type,
      vocab_size=config.vocab_size, hidden_size=config.hidden_size,
      num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads,
      max_position_embeddings=config.max_position_embeddings,
      tie_word_embeddings=config.tie_word_embeddings,
      bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
      pad_token_id=config.pad_token_id, torch_dtype=dtype)
  if config.family == 'opt':
    return dict(common, ffn_dim=config.intermediate_size,
                word_embed_proj_dim=config.hidden_size,
                activation_function=config.activation,
                do_layer_norm_before=True, enable_bias=True,
                layer_norm_elementwise_affine=True)
  if config.family == 'gpt_neox':
    return dict(common, **_rope(config),
                intermediate_size=config.intermediate_size,
                hidden_act=_GPT_NEOX_ACTIVATIONS[config.activation],
                partial_rotary_factor=config.partial_rotary_factor,
                rotary_pct=config.partial_rotary_factor,
                rotary_emb_base=config.rope_theta,
                layer_norm_eps=config.norm_eps,
                use_parallel_residual=config.parallel_residual,
                attention_bias=config.attention_bias)
  fields = dict(common, **_rope(config),
                intermediate_size=config.intermediate_size,
                num_key_value_heads=config.num_kv_heads,
                head_dim=config.head_dim, hidden_act='silu',
                rms_norm_eps=config.norm_eps,
                attention_bias=config.attention_bias)
  if config.family == 'llama':
    fields['mlp_bias'] = config.mlp_bias
  elif config.family == 'mistral':
    fields['sliding_window'] = config.sliding_window
  else:  # qwen3
    fields.update(use_sliding_window=config.sliding_window is not None,
                  sliding_window=config.sliding_window, max_window_layers=0)
  return fields


def _carried_config(source_dir: str, dtype: str) -> dict[str, Any]:
  values = weights_lib.read_json(os.path.join(source_dir, 'config.json'))
  values = dict(values)
  values['torch_dtype'] = dtype
  if 'dtype' in values:
    values['dtype'] = dtype
  return values


def _write_json(path: str, value: Any) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write('\n')


def _shard_name(index: int, count: int) -> str:
  return f'model-{index:05d}-of-{count:05d}.safetensors'


def _write_tensors(folder: str, tensors, max_shard_bytes: int,
                   write: bool) -> None:
  """The tensors as one ``model.safetensors`` or shards with an index."""
  from safetensors import numpy as safetensors_numpy  # pylint: disable=g-import-not-at-top
  shards, current, size = [], {}, 0
  for name, tensor in tensors:
    if current and size + tensor.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = tensor
    size += tensor.nbytes
  shards.append(current)
  if not write:
    return
  metadata = {'format': 'pt'}
  if len(shards) == 1:
    safetensors_numpy.save_file(shards[0], os.path.join(
        folder, 'model.safetensors'), metadata=metadata)
    return
  weight_map, total = {}, 0
  for index, shard in enumerate(shards, 1):
    file_name = _shard_name(index, len(shards))
    safetensors_numpy.save_file(shard, os.path.join(folder, file_name),
                                metadata=metadata)
    for name, tensor in shard.items():
      weight_map[name] = file_name
      total += tensor.nbytes
  _write_json(os.path.join(folder, 'model.safetensors.index.json'),
              {'metadata': {'total_size': total}, 'weight_map': weight_map})


def _token(tokenizer: tokenizers.Tokenizer, token_id: Optional[int]):
  return None if token_id is None else tokenizer.id_to_token(token_id)


def _write_tokenizer(folder: str, tokenizer: tokenizers.Tokenizer,
                     config: config_lib.ModelConfig,
                     source: Optional[str]) -> None:
  source_dir = source if source is not None and os.path.isdir(source) \
      else None
  copied = []
  if source_dir is not None:
    for name in TOKENIZER_FILES:
      path = os.path.join(source_dir, name)
      if os.path.isfile(path):
        shutil.copyfile(path, os.path.join(folder, name))
        copied.append(name)
  if 'tokenizer.json' not in copied:
    tokenizer.save(os.path.join(folder, 'tokenizer.json'))
  if 'tokenizer_config.json' not in copied:
    values = {'tokenizer_class': 'PreTrainedTokenizerFast',
              'model_max_length': config.max_position_embeddings,
              'clean_up_tokenization_spaces': False}
    for key, token_id in (('bos_token', config.bos_token_id),
                          ('eos_token', config.eos_token_id),
                          ('pad_token', config.pad_token_id)):
      if _token(tokenizer, token_id) is not None:
        values[key] = _token(tokenizer, token_id)
    if source is not None and source.endswith('.gguf'):
      template = gguf_lib.chat_template(source)
      if template:
        values['chat_template'] = template
    _write_json(os.path.join(folder, 'tokenizer_config.json'), values)


def _generation_config(config: config_lib.ModelConfig,
                       source_dir: Optional[str]) -> dict[str, Any]:
  if source_dir is not None:
    path = os.path.join(source_dir, 'generation_config.json')
    if os.path.isfile(path):
      return weights_lib.read_json(path)
  return {key: value for key, value in (
      ('bos_token_id', config.bos_token_id),
      ('eos_token_id', config.eos_token_id),
      ('pad_token_id', config.pad_token_id)) if value is not None}


def check_target(directory: str) -> None:
  """Refuses an existing, non-empty ``directory`` (nothing is overwritten).
  """
  if os.path.isfile(directory) or (os.path.isdir(directory)
                                   and os.listdir(directory)):
    raise ExportError(f'{directory} exists and is not empty; choose another '
                      'folder or remove it')


def exported_dtype(model: decoder_lib.DecoderLM) -> str:
  """The parameters' dtype name (``'float32'``, ``'bfloat16'``)."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return np.dtype(leaves[0].dtype).name


def write_folder(directory: str, fill: Callable[[str], None], *,
                 write: bool = True, replace: bool = False) -> str:
  """Runs ``fill(partial_folder)`` and renames the folder into place.

  Every process calls ``fill`` (its collectives); only the ``write`` one
  creates, fills and renames the folder. With ``replace`` an existing
  ``directory`` is swapped out once the new one is complete; without, it is
  refused unless empty.
  """
  directory = os.path.abspath(directory)
  if not replace:
    check_target(directory)
  partial = directory + PARTIAL
  if write:
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
  try:
    fill(partial)
  except BaseException:
    if write:
      shutil.rmtree(partial, ignore_errors=True)
    raise
  if write:
    if os.path.isdir(directory):
      replaced = directory + '.replaced'
      shutil.rmtree(replaced, ignore_errors=True)
      os.replace(directory, replaced)
      os.replace(partial, directory)
      shutil.rmtree(replaced)
    else:
      os.replace(partial, directory)
  return directory


def save_pretrained(model: decoder_lib.DecoderLM,
                    tokenizer: tokenizers.Tokenizer, directory: str, *,
                    source: Optional[str] = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES,
                    write: bool = True, replace: bool = False) -> str:
  """Writes ``model`` as a Hugging Face model directory; returns its path.

  Args:
    model: the model (list or scanned layers, any parameter dtype, on a mesh
      or not: its arrays are gathered).
    tokenizer: its tokenizer (written when the source has no tokenizer
      files).
    directory: where the folder goes; it must not exist or be empty.
    source: the directory or ``.gguf`` file the model was loaded from: a
      directory's ``config.json``, tokenizer files and
      ``generation_config.json`` are carried through.
    max_shard_bytes: above this many bytes the tensors are split into
      shards listed in ``model.safetensors.index.json``.
    write: whether this process writes (process 0 of several); every
      process must call, for the gathers.
    replace: replace an existing ``directory`` (once the new one is
      complete) instead of refusing one that is not empty.

  Raises:
    ExportError: ``directory`` exists and is not empty (without
      ``replace``).
  """
  config = model.config
  source_dir = source if source is not None and os.path.isdir(source) \
      else None
  dtype = exported_dtype(model)

  def fill(folder):
    tensors = weights_lib.named_tensors(model, loading.hf_table(config.family))
    _write_tensors(folder, tensors, max_shard_bytes, write)
    if not write:
      return
    _write_json(os.path.join(folder, 'config.json'),
                _carried_config(source_dir, dtype) if source_dir
                else hf_config(config, dtype))
    _write_json(os.path.join(folder, 'generation_config.json'),
                _generation_config(config, source_dir))
    _write_tokenizer(folder, tokenizer, config, source)

  return write_folder(directory, fill, write=write, replace=replace)
