"""tunix models, batches and optimizers shared by the tunix tests and benchmark.

tunix's model modules set ``flax_always_shard_variable`` to ``False`` when
imported, and their Variables' sharding annotations need it so when a model
is built or merged. :func:`tunix_flags` sets it for a block and puts it back,
so the rest of a process (the other tests) is unaffected.
"""

import contextlib
import importlib
from typing import Any

import numpy as np

import taco_optax


@contextlib.contextmanager
def tunix_flags():
  """Flax's flags as tunix sets them, for the block; then as they were."""
  import flax  # pylint: disable=import-outside-toplevel
  kept = flax.config.flax_always_shard_variable
  flax.config.update('flax_always_shard_variable', False)
  try:
    yield
  finally:
    flax.config.update('flax_always_shard_variable', kept)


def tunix_module(name: str) -> Any:
  """``tunix.models.<name>.model``, imported with Flax's flags kept."""
  with tunix_flags():
    return importlib.import_module(f'tunix.models.{name}.model')


def qwen3(*, layers=2, vocab=256, dim=64, hidden=128, heads=4, head_dim=16,
          kv_heads=2, tied=False, remat=None, seed=0):
  """A tunix ``Qwen3`` (float32) with random weights."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  module = tunix_module('qwen3')
  config = module.ModelConfig(
      num_layers=layers, vocab_size=vocab, embed_dim=dim, hidden_dim=hidden,
      num_heads=heads, head_dim=head_dim, num_kv_heads=kv_heads,
      rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=tied,
      remat_config=(module.RematConfig[remat] if remat
                    else module.RematConfig.NONE))
  return module.Qwen3(config, rngs=nnx.Rngs(seed))


def llama3(*, layers=2, vocab=256, dim=64, tied=False, seed=0):
  """A tunix ``Llama3`` (float32) with random weights."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  module = tunix_module('llama3')
  config = module.ModelConfig(
      num_layers=layers, vocab_size=vocab, embed_dim=dim, hidden_dim=2 * dim,
      num_heads=4, head_dim=dim // 4, num_kv_heads=2, rope_theta=10_000,
      norm_eps=1e-6, weight_tying=tied)
  return module.Llama3(config, rngs=nnx.Rngs(seed))


def gemma3(*, layers=2, vocab=256, dim=64, seed=0):
  """A tunix ``Gemma3`` (float32) with random weights, local and global."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  module = tunix_module('gemma3')
  config = module.ModelConfig(
      num_layers=layers, num_embed=vocab, embed_dim=dim, hidden_dim=2 * dim,
      num_heads=4, head_dim=dim // 4, num_kv_heads=2, sliding_window_size=4,
      param_dtype=jnp.float32)
  return module.Gemma3(config, rngs=nnx.Rngs(seed))


def model_input(batch: dict[str, Any]) -> dict[str, Any]:
  """tunix's model input from ``{'input_tokens', 'input_mask'}``."""
  from tunix.sft import utils  # pylint: disable=import-outside-toplevel
  mask = batch['input_mask']
  return dict(input_tokens=batch['input_tokens'], input_mask=mask,
              positions=utils.build_positions_from_mask(mask),
              attention_mask=utils.make_causal_attn_mask(mask))


def batches(steps: int, *, batch=4, seq=16, vocab=256, seed=0,
            padded=True) -> list[dict[str, np.ndarray]]:
  """Random token batches; with ``padded`` each row ends with padding."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), bool)
    if padded:
      lengths = rng.integers(seq // 2, seq + 1, batch)
      mask = np.arange(seq)[None] < lengths[:, None]
    out.append(dict(input_tokens=tokens, input_mask=mask))
  return out


def taco(model, learning_rate=1e-2, **kwargs):
  """``taco_optax.taco`` routed for ``model`` by its modules (einsums too)."""
  return taco_optax.taco(
      learning_rate,
      weight_dimension_numbers=taco_optax.nnx.dimension_numbers(model),
      update_scale=taco_optax.nnx.update_scales(model), **kwargs)
