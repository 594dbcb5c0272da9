"""A model written as a GGUF file for llama.cpp (the Llama family).

The tensors are named by :func:`gguf.gguf_table` (the table the GGUF loader
reads them with) and converted to PyTorch's layout by
:func:`weights.named_tensors`; the Q and K projections get llama.cpp's rotary
row order back (:func:`gguf.permute_rotary_rows`). The metadata is what
:mod:`gguf` reads (``llama.*``), and the tokenizer goes in as GGUF's ``gpt2``
byte-level BPE with the ``smollm`` pre-tokenizer (the one the loader
rebuilds), so only such tokenizers are written. Matrices are stored in
float32, float16 or bfloat16, norms in float32 (as llama.cpp's converter
does). The file is written as ``FILE.partial`` and renamed when complete.
"""

import json
import os
from typing import Any, Optional

import numpy as np
import tokenizers

from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import saving
from examples.finetune.model import weights as weights_lib

GGUF_TYPES = ('f32', 'f16', 'bf16')
_CONTROL, _NORMAL = 3, 1  # gguf.TokenType


def _tokenizer_fields(tokenizer: tokenizers.Tokenizer) -> dict[str, Any]:
  """Tokens, their types and merges of a byte-level BPE with single digits
  split first (what :func:`gguf.gguf_tokenizer` builds)."""
  described = json.loads(tokenizer.to_str())
  model, pre = described.get('model') or {}, described.get('pre_tokenizer')
  kinds = ([p.get('type') for p in pre.get('pretokenizers', [])]
           if isinstance(pre, dict) else [])
  if model.get('type') != 'BPE' or kinds != ['Digits', 'ByteLevel']:
    raise saving.ExportError(
        'GGUF export writes byte-level BPE tokenizers with single digits split '
        "(GGUF's gpt2 model, smollm pre-tokenizer); this model's is "
        f'{model.get("type")} with {kinds or pre}')
  vocab = tokenizer.get_vocab(with_added_tokens=True)
  tokens = [None] * len(vocab)
  for token, index in vocab.items():
    tokens[index] = token
  special = {t['content'] for t in described.get('added_tokens', [])
             if t.get('special')}
  merges = [m if isinstance(m, str) else ' '.join(m)
            for m in model.get('merges', [])]
  return {'tokens': tokens, 'merges': merges,
          'types': [_CONTROL if t in special else _NORMAL for t in tokens]}


def _metadata(writer: Any, config, tokenizer: tokenizers.Tokenizer,
              file_type: int) -> None:
  fields = _tokenizer_fields(tokenizer)
  writer.add_name('fine-tuned with taco_optax')
  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_block_count(config.num_layers)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_heads)
  writer.add_head_count_kv(config.num_kv_heads)
  writer.add_rope_dimension_count(config.head_dim)
  writer.add_rope_freq_base(config.rope_theta)
  writer.add_layer_norm_rms_eps(config.norm_eps)
  writer.add_vocab_size(config.vocab_size)
  writer.add_file_type(file_type)
  writer.add_tokenizer_model('gpt2')
  writer.add_tokenizer_pre('smollm')
  writer.add_token_list(fields['tokens'])
  writer.add_token_types(fields['types'])
  writer.add_token_merges(fields['merges'])
  for add, token_id in ((writer.add_bos_token_id, config.bos_token_id),
                        (writer.add_eos_token_id, config.eos_token_id),
                        (writer.add_pad_token_id, config.pad_token_id)):
    if token_id is not None:
      add(token_id)


def check_exportable(config) -> None:
  """Refuses a family GGUF export does not write (one line)."""
  unsupported = []
  if config.family != 'llama':
    unsupported.append(f'the {config.family} family')
  if config.rope_type != 'default':
    unsupported.append(f'{config.rope_type} rope scaling')
  if config.attention_bias or config.mlp_bias:
    unsupported.append('biases')
  if unsupported:
    raise saving.ExportError(
        'GGUF export writes the Llama architecture without rope scaling or '
        'biases (what the GGUF loader reads); this model has '
        + ', '.join(unsupported) + '; export a Hugging Face directory (--to)')


def save_gguf(model: decoder_lib.DecoderLM, tokenizer: tokenizers.Tokenizer,
              path: str, *, tensor_type: str = 'f32',
              chat_template: Optional[str] = None,
              write: bool = True) -> str:
  """Writes ``model`` as the GGUF file ``path``; returns its path.

  Args:
    model: a Llama-family model (list or scanned layers, any dtype).
    tokenizer: its tokenizer (byte-level BPE, single digits split).
    path: the file; it must not exist.
    tensor_type: ``'f32'``, ``'f16'`` or ``'bf16'`` for the matrices.
    chat_template: written as ``tokenizer.chat_template`` if given (e.g.
      :func:`gguf.chat_template` of the source file).
    write: whether this process writes (every process must call).

  Raises:
    saving.ExportError: an unsupported family or tokenizer, an existing
      file, an unknown ``tensor_type``.
  """
  import gguf  # pylint: disable=g-import-not-at-top
  config = model.config
  if tensor_type not in GGUF_TYPES:
    raise saving.ExportError(f'GGUF tensor type {tensor_type!r}; choose one '
                             f'of {", ".join(GGUF_TYPES)}')
  check_exportable(config)
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise saving.ExportError(f'{path} exists; choose another file name')
  qtype, file_type = {
      'f32': (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
      'f16': (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
      'bf16': (gguf.GGMLQuantizationType.BF16,
               gguf.LlamaFileType.MOSTLY_BF16)}[tensor_type]
  tensors = weights_lib.named_tensors(model, gguf_lib.gguf_table())
  if not write:
    for _ in tensors:  # the gathers every process takes part in
      pass
    return path
  partial = path + saving.PARTIAL
  writer = gguf.GGUFWriter(partial, 'llama')
  _metadata(writer, config, tokenizer, int(file_type))
  if chat_template:
    writer.add_chat_template(chat_template)
  for name, tensor in tensors:
    heads = gguf_lib.rotary_heads(name, config)
    tensor = tensor.astype(np.float32)
    if heads is not None:
      tensor = gguf_lib.permute_rotary_rows(tensor, heads)
    if tensor.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
      writer.add_tensor(name, gguf.quants.quantize(tensor, qtype),
                        raw_dtype=qtype)
    else:
      writer.add_tensor(name, np.ascontiguousarray(tensor))
  try:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, path)
  except BaseException:
    if os.path.exists(partial):
      os.remove(partial)
    raise
  return path
