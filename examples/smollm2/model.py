"""A Llama-style decoder in Flax NNX: the architecture of SmolLM2.

Token embedding, ``num_layers`` pre-norm blocks (RMSNorm, rotary attention
with grouped key/value heads, SwiGLU MLP), a final RMSNorm and a head tied to
the embedding. Kernels are laid out as Flax lays them out, ``x @ W = y``
(``(in, out)``); :mod:`weights` transposes the checkpoint's ``(out, in)``.

Each block runs under ``nnx.remat``: its activations are recomputed in the
backward pass instead of stored, and the rematerialised blocks are what
``taco_optax.layerwise.train_step`` reads from a plain loss to run the
backward pass one block at a time.
"""

import dataclasses
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
  """The architecture.

  Attributes:
    vocab_size: rows of the token table.
    hidden_size: the residual stream's width.
    num_layers: decoder blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads; each serves ``num_heads // num_kv_heads``
      consecutive query heads.
    head_dim: features per head.
    ffn_size: the MLP's hidden width.
    rope_theta: the rotary base.
    norm_eps: RMSNorm's epsilon.
  """
  vocab_size: int = 49152
  hidden_size: int = 576
  num_layers: int = 30
  num_heads: int = 9
  num_kv_heads: int = 3
  head_dim: int = 64
  ffn_size: int = 1536
  rope_theta: float = 100000.0
  norm_eps: float = 1e-5


def tiny_config(vocab_size: int = 64) -> Config:
  """A config that compiles in seconds, for tests."""
  return Config(vocab_size=vocab_size, hidden_size=32, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=48)


def rotary_angles(positions: jax.Array, config: Config
                  ) -> tuple[jax.Array, jax.Array]:
  """``(cos, sin)``, each ``[B, T, head_dim // 2]`` float32."""
  exponents = np.arange(0, config.head_dim, 2, dtype=np.float64)
  frequencies = (1.0 / config.rope_theta ** (exponents / config.head_dim))
  angles = (positions.astype(jnp.float32)[..., None]
            * frequencies.astype(np.float32))
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates feature ``i`` of each head with feature ``i + head_dim // 2``.

  Args:
    x: ``[B, T, heads, head_dim]``.
    cos: ``[B, T, head_dim // 2]``.
    sin: ``[B, T, head_dim // 2]``.
  """
  cos, sin = cos[:, :, None], sin[:, :, None]
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin,
                          second * cos + first * sin], axis=-1)


def causal_mask(attention_mask: jax.Array) -> jax.Array:
  """``bool[B, T, T]`` (query, key): earlier or same position, not padding."""
  length = attention_mask.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))
  return causal[None] & attention_mask[:, None, :]


def _linear(fan_in: int, fan_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(fan_in, fan_out, use_bias=False, rngs=rngs)


class Attention(nnx.Module):
  """Causal self-attention with rotary positions and grouped K/V heads."""

  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.config = config
    query_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    self.query = _linear(config.hidden_size, query_width, rngs)
    self.key = _linear(config.hidden_size, kv_width, rngs)
    self.value = _linear(config.hidden_size, kv_width, rngs)
    self.out = _linear(query_width, config.hidden_size, rngs)

  def __call__(self, x, cos, sin, mask):
    config = self.config
    batch, length, _ = x.shape
    heads = lambda y, n: y.reshape(batch, length, n, config.head_dim)
    query = apply_rotary(heads(self.query(x), config.num_heads), cos, sin)
    key = apply_rotary(heads(self.key(x), config.num_kv_heads), cos, sin)
    value = heads(self.value(x), config.num_kv_heads)
    groups = config.num_heads // config.num_kv_heads
    query = query.reshape(batch, length, config.num_kv_heads, groups,
                          config.head_dim)
    logits = jnp.einsum('btkgh,bskh->bkgts', query, key)
    logits = logits / math.sqrt(config.head_dim)
    # A finite minimum, so that a fully masked (padded) query gives no NaN.
    logits = jnp.where(mask[:, None, None], logits,
                       jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    mixed = jnp.einsum('bkgts,bskh->btkgh', weights, value)
    return self.out(mixed.reshape(batch, length, -1))


class MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate x) * up x)``."""

  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.gate = _linear(config.hidden_size, config.ffn_size, rngs)
    self.up = _linear(config.hidden_size, config.ffn_size, rngs)
    self.down = _linear(config.ffn_size, config.hidden_size, rngs)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """A pre-norm decoder block: ``x + attention(norm x)``, then the MLP's."""

  def __init__(self, config: Config, rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(config.hidden_size,
                                      epsilon=config.norm_eps, rngs=rngs)
    self.attention = Attention(config, rngs)
    self.mlp_norm = nnx.RMSNorm(config.hidden_size, epsilon=config.norm_eps,
                                rngs=rngs)
    self.mlp = MLP(config, rngs)

  def __call__(self, x, cos, sin, mask):
    x = x + self.attention(self.attention_norm(x), cos, sin, mask)
    return x + self.mlp(self.mlp_norm(x))


def _run_block(block: Block, x, cos, sin, mask):
  return block(x, cos, sin, mask)


class Decoder(nnx.Module):
  """The language model.

  Args:
    config: the architecture.
    rngs: random initialisation (replaced when weights are loaded).
    remat: recompute each block in the backward pass.
  """

  def __init__(self, config: Config, rngs: nnx.Rngs, remat: bool = True):
    self.config = config
    self.remat = remat
    self.embed = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs)
                            for _ in range(config.num_layers)])
    self.final_norm = nnx.RMSNorm(config.hidden_size, epsilon=config.norm_eps,
                                  rngs=rngs)

  def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array
                    ) -> jax.Array:
    """``[B, T, hidden]`` final-normed states of right-padded ``input_ids``.
    """
    attention_mask = attention_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
    cos, sin = rotary_angles(positions, self.config)
    mask = causal_mask(attention_mask)
    run = nnx.remat(_run_block) if self.remat else _run_block
    x = self.embed(input_ids)
    for block in self.blocks:
      x = run(block, x, cos, sin, mask)
    return self.final_norm(x)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """``[..., vocab]`` logits of ``hidden`` through the tied token table."""
    return self.embed.attend(hidden)

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array
               ) -> jax.Array:
    """``[B, T, vocab]`` logits; position ``t`` predicts token ``t + 1``."""
    return self.logits(self.hidden_states(input_ids, attention_mask))
