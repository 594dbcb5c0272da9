"""The architecture of a decoder-only language model, read from a checkpoint.

One frozen :class:`ModelConfig` describes every supported family (Llama,
Mistral, Qwen3, OPT, GPT-NeoX); the family only picks defaults, and the
fields (norm type, MLP type, rotary fraction, ...) configure the shared
layers in :mod:`layers`.
"""

import dataclasses
from typing import Any, Mapping, Optional

FAMILIES = ('llama', 'mistral', 'qwen3', 'opt', 'gpt_neox')

# Hugging Face `architectures` entries we can load, by family.
_ARCHITECTURES = {
    'LlamaForCausalLM': 'llama',
    'MistralForCausalLM': 'mistral',
    'Qwen3ForCausalLM': 'qwen3',
    'OPTForCausalLM': 'opt',
    'GPTNeoXForCausalLM': 'gpt_neox',
}
_ROPE_TYPES = ('default', 'linear', 'llama3')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only LM.

  Attributes:
    family: one of ``FAMILIES``.
    vocab_size: rows of the token embedding.
    hidden_size: model width ``d``.
    num_layers: number of decoder blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads (``< num_heads`` is grouped-query
      attention).
    head_dim: width of one head.
    intermediate_size: MLP hidden width.
    max_position_embeddings: longest sequence the model supports.
    tie_word_embeddings: the output projection is the token embedding.
    rope_theta: rotary base; unused with learned positions.
    partial_rotary_factor: fraction of ``head_dim`` that is rotated.
    rope_type: ``'default'``, ``'linear'`` or ``'llama3'`` frequency scaling.
    rope_scaling: parameters of that scaling, as ``(name, value)`` pairs.
    norm_eps: epsilon of every norm.
    norm_type: ``'rms'`` or ``'layer'``.
    mlp_type: ``'gated'`` (down(act(gate x) * up x)) or ``'plain'``
      (fc2(act(fc1 x))).
    activation: ``'silu'``, ``'relu'``, ``'gelu'`` (exact) or ``'gelu_tanh'``.
    attention_bias: biases on the Q/K/V/O projections.
    mlp_bias: biases on the MLP projections.
    qk_norm: RMS norm over ``head_dim`` on queries and keys (Qwen3).
    parallel_residual: ``x + attn(ln1 x) + mlp(ln2 x)`` (GPT-NeoX).
    fused_qkv: one Q/K/V kernel of shape ``(d, 3, heads * head_dim)``.
    learned_positions: a learned position table instead of rotary (OPT).
    position_offset: rows of the position table before position 0 (OPT: 2).
    sliding_window: keys further back than this are masked (Mistral).
    bos_token_id: beginning-of-sequence token, if any.
    eos_token_id: end-of-sequence token, if any.
    pad_token_id: padding token, if any.
  """
  family: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  max_position_embeddings: int
  tie_word_embeddings: bool = False
  rope_theta: float = 10000.0
  partial_rotary_factor: float = 1.0
  rope_type: str = 'default'
  rope_scaling: tuple[tuple[str, float], ...] = ()
  norm_eps: float = 1e-6
  norm_type: str = 'rms'
  mlp_type: str = 'gated'
  activation: str = 'silu'
  attention_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  parallel_residual: bool = False
  fused_qkv: bool = False
  learned_positions: bool = False
  position_offset: int = 0
  sliding_window: Optional[int] = None
  bos_token_id: Optional[int] = None
  eos_token_id: Optional[int] = None
  pad_token_id: Optional[int] = None

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f'unsupported architecture family {self.family!r}; '
                       f'supported: {", ".join(FAMILIES)}.')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads={self.num_heads} is not a multiple of '
                       f'num_kv_heads={self.num_kv_heads}.')
    if self.rope_type not in _ROPE_TYPES:
      raise ValueError(f'unsupported architecture: rope type '
                       f'{self.rope_type!r} (supported: {_ROPE_TYPES}).')
    if self.rotary_dim % 2:
      raise ValueError(f'rotary dimension {self.rotary_dim} must be even.')

  @property
  def rotary_dim(self) -> int:
    """Leading dimensions of each head that are rotated."""
    return 0 if self.learned_positions else int(
        self.head_dim * self.partial_rotary_factor)

  @classmethod
  def from_hf_config(cls, hf_config: Mapping[str, Any]) -> 'ModelConfig':
    """Reads a Hugging Face ``config.json`` dictionary.

    Accepts the keys written by ``transformers`` 4.x (``rope_theta``,
    ``rope_scaling``, ``rotary_pct``) and 5.x (``rope_parameters``).

    Raises:
      ValueError: ``'unsupported architecture ...'`` for a model we do not
        implement, or a message naming a missing or invalid key.
    """
    family = _family(hf_config)
    try:
      return _BUILDERS[family](_HFConfig(hf_config))
    except KeyError as e:
      raise ValueError(f'config.json of a {family} model lacks the key '
                       f'{e.args[0]!r}.') from None
    except (TypeError, ValueError) as e:
      if 'unsupported architecture' in str(e):
        raise
      raise ValueError(f'config.json of a {family} model is invalid: {e}'
                       ) from None

  @classmethod
  def tiny(cls, family: str, **overrides) -> 'ModelConfig':
    """A few-thousand-parameter model of ``family`` for tests."""
    base = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, intermediate_size=48,
                max_position_embeddings=64, norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2)
    per_family = {
        'llama': dict(tie_word_embeddings=False),
        'mistral': dict(sliding_window=16),
        'qwen3': dict(qk_norm=True, tie_word_embeddings=True),
        'opt': dict(num_kv_heads=4, norm_type='layer', mlp_type='plain',
                    activation='relu', attention_bias=True, mlp_bias=True,
                    learned_positions=True, position_offset=2,
                    tie_word_embeddings=True),
        'gpt_neox': dict(num_kv_heads=4, norm_type='layer', mlp_type='plain',
                         activation='gelu', attention_bias=True,
                         mlp_bias=True, parallel_residual=True,
                         fused_qkv=True, partial_rotary_factor=0.25),
    }
    if family not in per_family:
      raise ValueError(f'unsupported architecture family {family!r}.')
    return cls(family=family, **{**base, **per_family[family], **overrides})


def _family(hf_config: Mapping[str, Any]) -> str:
  architectures = hf_config.get('architectures') or []
  for name in architectures:
    if name in _ARCHITECTURES:
      return _ARCHITECTURES[name]
  model_type = hf_config.get('model_type')
  if not architectures and model_type in FAMILIES:
    return model_type
  found = ', '.join(architectures) or f'model_type={model_type!r}'
  raise ValueError(
      f'unsupported architecture {found}; supported: '
      f'{", ".join(_ARCHITECTURES)}.')


class _HFConfig:
  """Dictionary access that names the missing key and tolerates nulls."""

  def __init__(self, values: Mapping[str, Any]):
    self.values = values

  def __getitem__(self, key: str) -> Any:
    value = self.values.get(key)
    if value is None:
      raise KeyError(key)
    return value

  def get(self, key: str, default: Any = None) -> Any:
    value = self.values.get(key)
    return default if value is None else value

  def rope(self) -> dict[str, Any]:
    """Merged rotary settings of both ``transformers`` major versions."""
    rope = dict(self.get('rope_scaling', {}))
    rope.update(self.get('rope_parameters', {}))
    if 'type' in rope and 'rope_type' not in rope:
      rope['rope_type'] = rope['type']
    return rope


def _token_ids(hf: _HFConfig) -> dict[str, Optional[int]]:
  def first(value):
    return value[0] if isinstance(value, (list, tuple)) and value else value
  return dict(bos_token_id=first(hf.get('bos_token_id')),
              eos_token_id=first(hf.get('eos_token_id')),
              pad_token_id=first(hf.get('pad_token_id')))


def _rope_fields(hf: _HFConfig, default_theta: float = 10000.0
                 ) -> dict[str, Any]:
  rope = hf.rope()
  rope_type = rope.get('rope_type', 'default')
  scaling = ()
  if rope_type == 'linear':
    scaling = (('factor', float(rope['factor'])),)
  elif rope_type == 'llama3':
    scaling = tuple((key, float(rope[key])) for key in (
        'factor', 'low_freq_factor', 'high_freq_factor',
        'original_max_position_embeddings'))
  elif rope_type != 'default':
    raise ValueError(f'unsupported architecture: rope type {rope_type!r}.')
  theta = rope.get('rope_theta', hf.get('rope_theta', default_theta))
  return dict(rope_type=rope_type, rope_scaling=scaling,
              rope_theta=float(theta))


def _llama_like(hf: _HFConfig, family: str, **fields) -> ModelConfig:
  num_heads = int(hf['num_attention_heads'])
  hidden = int(hf['hidden_size'])
  head_dim = int(hf.get('head_dim', hidden // num_heads))
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f'unsupported architecture: {family} with hidden_act '
                     f'{hf.get("hidden_act")!r}.')
  return ModelConfig(
      family=family,
      vocab_size=int(hf['vocab_size']),
      hidden_size=hidden,
      num_layers=int(hf['num_hidden_layers']),
      num_heads=num_heads,
      num_kv_heads=int(hf.get('num_key_value_heads', num_heads)),
      head_dim=head_dim,
      intermediate_size=int(hf['intermediate_size']),
      max_position_embeddings=int(hf['max_position_embeddings']),
      tie_word_embeddings=bool(hf.get('tie_word_embeddings', False)),
      norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      **_rope_fields(hf), **_token_ids(hf), **fields)


def _llama(hf: _HFConfig) -> ModelConfig:
  return _llama_like(hf, 'llama',
                     attention_bias=bool(hf.get('attention_bias', False)),
                     mlp_bias=bool(hf.get('mlp_bias', False)))


def _mistral(hf: _HFConfig) -> ModelConfig:
  window = hf.get('sliding_window')
  return _llama_like(hf, 'mistral',
                     sliding_window=int(window) if window else None)


def _qwen3(hf: _HFConfig) -> ModelConfig:
  # Layers from index max_window_layers on use the sliding window.
  window = hf.get('sliding_window') if hf.get('use_sliding_window') else None
  first_sliding = int(hf.get('max_window_layers', 0))
  if window and 0 < first_sliding < int(hf['num_hidden_layers']):
    raise ValueError('unsupported architecture: Qwen3 with sliding-window '
                     'attention on some layers only.')
  if first_sliding >= int(hf['num_hidden_layers']):
    window = None
  return _llama_like(hf, 'qwen3', qk_norm=True,
                     attention_bias=bool(hf.get('attention_bias', False)),
                     sliding_window=int(window) if window else None)


def _multi_head_layer_norm(hf: _HFConfig, *, ffn_key: str,
                           tied_by_default: bool) -> dict[str, Any]:
  """Fields shared by OPT and GPT-NeoX: one key/value head per query head,
  layer norms, a plain biased MLP."""
  num_heads = int(hf['num_attention_heads'])
  hidden = int(hf['hidden_size'])
  return dict(
      vocab_size=int(hf['vocab_size']),
      hidden_size=hidden,
      num_layers=int(hf['num_hidden_layers']),
      num_heads=num_heads,
      num_kv_heads=num_heads,
      head_dim=hidden // num_heads,
      intermediate_size=int(hf[ffn_key]),
      max_position_embeddings=int(hf['max_position_embeddings']),
      tie_word_embeddings=bool(hf.get('tie_word_embeddings',
                                      tied_by_default)),
      norm_type='layer',
      mlp_type='plain',
      mlp_bias=True)


def _opt(hf: _HFConfig) -> ModelConfig:
  hidden = int(hf['hidden_size'])
  unsupported = []
  if not hf.get('do_layer_norm_before', True):
    unsupported.append('post-norm blocks (do_layer_norm_before=false)')
  if int(hf.get('word_embed_proj_dim', hidden)) != hidden:
    unsupported.append('word_embed_proj_dim != hidden_size')
  if hf.get('_remove_final_layer_norm', False):
    unsupported.append('no final layer norm')
  if not hf.get('layer_norm_elementwise_affine', True):
    unsupported.append('layer norms without weights')
  if not hf.get('enable_bias', True):
    unsupported.append('enable_bias=false')
  activation = hf.get('activation_function', 'relu')
  if activation not in ('relu', 'gelu'):
    unsupported.append(f'activation {activation!r}')
  if unsupported:
    raise ValueError('unsupported architecture: OPT with '
                     + ', '.join(unsupported) + '.')
  return ModelConfig(
      family='opt',
      **_multi_head_layer_norm(hf, ffn_key='ffn_dim', tied_by_default=True),
      norm_eps=1e-5,
      activation=activation,
      attention_bias=True,
      learned_positions=True,
      position_offset=2,
      **_token_ids(hf))


def _gpt_neox(hf: _HFConfig) -> ModelConfig:
  activation = {'gelu': 'gelu', 'gelu_new': 'gelu_tanh',
                'gelu_pytorch_tanh': 'gelu_tanh', 'gelu_fast': 'gelu_tanh',
                'relu': 'relu', 'silu': 'silu'}.get(hf.get('hidden_act',
                                                            'gelu'))
  if activation is None:
    raise ValueError(f'unsupported architecture: GPT-NeoX with hidden_act '
                     f'{hf.get("hidden_act")!r}.')
  rope = hf.rope()
  partial = rope.get('partial_rotary_factor',
                     hf.get('partial_rotary_factor', hf.get('rotary_pct',
                                                            0.25)))
  fields = _rope_fields(hf, default_theta=hf.get('rotary_emb_base', 10000.0))
  return ModelConfig(
      family='gpt_neox',
      **_multi_head_layer_norm(hf, ffn_key='intermediate_size',
                               tied_by_default=False),
      partial_rotary_factor=float(partial),
      norm_eps=float(hf.get('layer_norm_eps', 1e-5)),
      activation=activation,
      attention_bias=bool(hf.get('attention_bias', True)),
      parallel_residual=bool(hf.get('use_parallel_residual', True)),
      fused_qkv=True,
      **fields, **_token_ids(hf))


_BUILDERS = {'llama': _llama, 'mistral': _mistral, 'qwen3': _qwen3,
             'opt': _opt, 'gpt_neox': _gpt_neox}


def num_parameters(config: ModelConfig) -> int:
  """Parameter count implied by ``config`` (embeddings included once)."""
  d, f = config.hidden_size, config.intermediate_size
  q = config.num_heads * config.head_dim
  kv = config.num_kv_heads * config.head_dim
  attention = d * (q + 2 * kv) + q * d
  if config.attention_bias:
    attention += q + 2 * kv + d
  mlp = (3 if config.mlp_type == 'gated' else 2) * d * f
  if config.mlp_bias:
    mlp += (2 * f if config.mlp_type == 'gated' else f) + d
  norm = d if config.norm_type == 'rms' else 2 * d
  qk_norm = 2 * config.head_dim if config.qk_norm else 0
  block = attention + mlp + 2 * norm + qk_norm
  embed = config.vocab_size * d
  positions = ((config.max_position_embeddings + config.position_offset) * d
               if config.learned_positions else 0)
  head = 0 if config.tie_word_embeddings else embed
  return config.num_layers * block + embed + positions + head + norm

