"""Hugging Face ``config.json`` values of the models the benchmarks size.

Only the keys that
:meth:`examples.finetune.model.config.ModelConfig.from_hf_config` reads,
copied from each model's public ``config.json``.
"""


def _opt(hidden_size: int, num_layers: int, num_heads: int) -> dict:
  """An OPT decoder: pre-norm, ReLU, tied embeddings, a 2048-token window."""
  return {
      'architectures': ['OPTForCausalLM'], 'model_type': 'opt',
      'hidden_size': hidden_size, 'num_hidden_layers': num_layers,
      'num_attention_heads': num_heads, 'ffn_dim': 4 * hidden_size,
      'vocab_size': 50272, 'max_position_embeddings': 2048,
      'word_embed_proj_dim': hidden_size, 'do_layer_norm_before': True,
      'activation_function': 'relu', 'enable_bias': True,
      'layer_norm_elementwise_affine': True, 'tie_word_embeddings': True,
      'bos_token_id': 2, 'eos_token_id': 2, 'pad_token_id': 1,
  }


PRESETS = {
    'opt-13b': _opt(hidden_size=5120, num_layers=40, num_heads=40),
    'opt-30b': _opt(hidden_size=7168, num_layers=48, num_heads=56),
    'qwen3-32b': {
        'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3',
        'hidden_size': 5120, 'num_hidden_layers': 64,
        'num_attention_heads': 64, 'num_key_value_heads': 8, 'head_dim': 128,
        'intermediate_size': 25600, 'vocab_size': 151936,
        'max_position_embeddings': 40960, 'rms_norm_eps': 1e-6,
        'rope_theta': 1000000.0, 'tie_word_embeddings': False,
        'hidden_act': 'silu', 'attention_bias': False,
        'bos_token_id': 151643, 'eos_token_id': 151645,
    },
    'llama-3-70b': {
        'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
        'vocab_size': 128256, 'hidden_size': 8192,
        'intermediate_size': 28672, 'num_hidden_layers': 80,
        'num_attention_heads': 64, 'num_key_value_heads': 8,
        'head_dim': 128, 'max_position_embeddings': 8192,
        'rms_norm_eps': 1e-5, 'rope_theta': 500000.0,
        'tie_word_embeddings': False, 'hidden_act': 'silu',
        'bos_token_id': 128000, 'eos_token_id': 128001,
    },
    'smollm2-135m': {
        'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
        'vocab_size': 49152, 'hidden_size': 576, 'intermediate_size': 1536,
        'num_hidden_layers': 30, 'num_attention_heads': 9,
        'num_key_value_heads': 3, 'head_dim': 64,
        'max_position_embeddings': 8192, 'rms_norm_eps': 1e-5,
        'rope_theta': 100000.0, 'tie_word_embeddings': True,
        'hidden_act': 'silu', 'bos_token_id': 0, 'eos_token_id': 0,
    },
}
