"""Pieces shared by every model family: norms, rotary, attention, MLPs.

Each piece is configured by :class:`config.ModelConfig` rather than
subclassed per family. Kernels are laid out as in Flax, ``x @ W = y``
(``(in, out)``); the loader transposes PyTorch's ``(out, in)`` weights.
"""

import functools
import math
from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from examples.finetune.model import config as config_lib
from examples.finetune.model import vocab_parallel

# Added to masked attention logits; finite so that a query with no visible
# key (a left-padded row) gives a uniform average instead of NaN.
_MASK_VALUE = float(jnp.finfo(jnp.float32).min)

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    'silu': jax.nn.silu,
    'relu': jax.nn.relu,
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),
    'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
}


def norm(config: config_lib.ModelConfig, dim: int, *, dtype: Any,
         param_dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
  """The family's normalisation layer over the last axis (``dim`` wide)."""
  if config.norm_type == 'rms':
    return nnx.RMSNorm(dim, epsilon=config.norm_eps, dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs)
  if config.norm_type == 'layer':
    return nnx.LayerNorm(dim, epsilon=config.norm_eps, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)
  raise ValueError(f'unknown norm_type {config.norm_type!r}.')


def rotary_inverse_frequencies(config: config_lib.ModelConfig) -> np.ndarray:
  """Angular frequency of each rotated pair, ``(rotary_dim // 2,)`` float32.

  Applies the checkpoint's frequency scaling: ``'linear'`` divides every
  frequency by ``factor``; ``'llama3'`` divides the low frequencies by
  ``factor``, keeps the high ones and interpolates in between (Llama 3.1).
  """
  dim = config.rotary_dim
  inverse = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64)
                                        / dim)
  scaling = dict(config.rope_scaling)
  if config.rope_type == 'linear':
    inverse = inverse / scaling['factor']
  elif config.rope_type == 'llama3':
    factor = scaling['factor']
    low, high = scaling['low_freq_factor'], scaling['high_freq_factor']
    context = scaling['original_max_position_embeddings']
    wavelength = 2 * math.pi / inverse
    smooth = (context / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inverse / factor + smooth * inverse
    inverse = np.where(wavelength > context / low, inverse / factor,
                       np.where(wavelength < context / high, inverse,
                                interpolated))
  return inverse.astype(np.float32)


def rotary_angles(positions: jax.Array, inverse_frequencies: np.ndarray
                  ) -> tuple[jax.Array, jax.Array]:
  """``(cos, sin)`` of shape ``positions.shape + (rotary_dim // 2,)``, f32."""
  angles = positions.astype(jnp.float32)[..., None] * inverse_frequencies
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates the leading ``2 * cos.shape[-1]`` features of each head.

  Uses the "rotate half" pairing of Hugging Face checkpoints: feature ``i`` is
  paired with feature ``i + rotary_dim // 2``. Features past ``rotary_dim``
  pass through (partial rotary, GPT-NeoX).

  Args:
    x: ``[B, T, heads, head_dim]``.
    cos: ``[B, T, rotary_dim // 2]``.
    sin: ``[B, T, rotary_dim // 2]``.

  Returns:
    An array like ``x``.
  """
  half = cos.shape[-1]
  if half == 0:
    return x
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  first = x[..., :half].astype(jnp.float32)
  second = x[..., half:2 * half].astype(jnp.float32)
  rotated = jnp.concatenate(
      [first * cos - second * sin, second * cos + first * sin], axis=-1)
  return jnp.concatenate([rotated.astype(x.dtype), x[..., 2 * half:]],
                         axis=-1)


def attention_mask(attention_mask_bt: jax.Array, sliding_window: int | None
                   ) -> jax.Array:
  """Causal mask ``[B, T, T]`` (query, key) hiding padded keys.

  Args:
    attention_mask_bt: ``bool[B, T]``, true for real tokens.
    sliding_window: if set, a query sees at most this many keys back.
  """
  length = attention_mask_bt.shape[1]
  query = jnp.arange(length)[:, None]
  key = jnp.arange(length)[None, :]
  visible = key <= query
  if sliding_window is not None:
    visible &= key > query - sliding_window
  return visible[None] & attention_mask_bt[:, None, :]


def explicit_mesh() -> bool:
  """A mesh with ``Explicit`` axes is set (``--mesh``)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and bool(mesh.explicit_axes)


def by_xla(fn: Callable, x: jax.Array, *args):
  """``fn(x, *args)``, with the mesh's axes ``Auto`` when they are Explicit.

  On a mesh with ``Explicit`` axes (``--mesh``) every op needs a sharding rule,
  and matmuls against FSDP/tensor-parallel kernels or a vocab-split table
  have none; inside this wrapper XLA partitions ``fn`` instead. The output is
  split like ``x`` along its batch axis and whole elsewhere, and the
  arguments keep their explicit shardings, which TACO reads.
  """
  if not explicit_mesh():
    return fn(x, *args)
  batch = jax.typeof(x).sharding.spec[:1]
  return jax.sharding.auto_axes(fn, out_sharding=P(*batch))(x, *args)


def partitioned_by_xla(call: Callable) -> Callable:
  """A module's ``__call__(x, ...)`` run through :func:`by_xla`."""
  @functools.wraps(call)
  def wrapped(self, x, *args):
    if not explicit_mesh():
      return call(self, x, *args)
    graphdef, state = nnx.split(self)
    pure = lambda x, state, *args: call(nnx.merge(graphdef, state), x, *args)
    return by_xla(pure, x, state, *args)
  return wrapped


class Embed(nnx.Embed):
  """:class:`nnx.Embed` that also runs on an explicit mesh.

  A table split over the vocabulary (``sharding.param_spec``) is looked up
  where its rows live (``vocab_parallel.lookup``), never gathered; any other
  (a learned position table, split over both axes) is gathered whole. The
  looked-up rows come out split like the token ids.
  """

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    if out_sharding is not None or not explicit_mesh():
      return super().__call__(inputs, out_sharding)
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype,
                                  inexact=False)
    if vocab_parallel.is_split_over_rows_only(table):
      return vocab_parallel.lookup(table, inputs)
    spec = tuple(jax.typeof(inputs).sharding.spec)
    spec += (None,) * (inputs.ndim + 1 - len(spec))
    return jax.sharding.reshard(table, P()).at[inputs].get(
        out_sharding=P(*spec))


class Attention(nnx.Module):
  """Multi-head attention with grouped K/V heads and optional Q/K norm.

  Projections are separate ``q``, ``k``, ``v`` kernels, or one fused ``qkv``
  kernel of shape ``(d, 3, heads * head_dim)`` (GPT-NeoX) whose axis 1
  selects Q, K or V, so that an optimizer can treat them as three matrices;
  its einsum puts that axis first in the output (``q, k, v = out``), which is
  how :func:`taco_optax.nnx.dimension_numbers` reads it as a batch axis.
  """

  def __init__(self, config: config_lib.ModelConfig, *, dtype: Any,
               param_dtype: Any, rngs: nnx.Rngs):
    self.num_heads = config.num_heads
    self.num_kv_heads = config.num_kv_heads
    self.head_dim = config.head_dim
    d = config.hidden_size
    query_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    linear = lambda i, o: nnx.Linear(
        i, o, use_bias=config.attention_bias, dtype=dtype,
        param_dtype=param_dtype, rngs=rngs)
    if config.fused_qkv:
      if kv_width != query_width:
        raise ValueError('a fused QKV kernel needs num_kv_heads == num_heads.')
      self.qkv = nnx.Einsum(
          'btd,dse->sbte', (d, 3, query_width),
          (3, query_width) if config.attention_bias else None,
          dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    else:
      self.q = linear(d, query_width)
      self.k = linear(d, kv_width)
      self.v = linear(d, kv_width)
    self.o = linear(query_width, d)
    if config.qk_norm:
      head_norm = lambda: nnx.RMSNorm(
          config.head_dim, epsilon=config.norm_eps, dtype=dtype,
          param_dtype=param_dtype, rngs=rngs)
      self.q_norm = head_norm()
      self.k_norm = head_norm()
    else:
      self.q_norm = self.k_norm = None

  def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``[B,T,H,hd]`` and keys, values ``[B,T,K,hd]``."""
    batch, length = x.shape[:2]
    heads = lambda y, n: y.reshape(batch, length, n, self.head_dim)
    if hasattr(self, 'qkv'):
      fused = self.qkv(x)
      return tuple(heads(fused[i], self.num_heads) for i in range(3))
    return (heads(self.q(x), self.num_heads),
            heads(self.k(x), self.num_kv_heads),
            heads(self.v(x), self.num_kv_heads))

  def __call__(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array],
               mask: jax.Array) -> jax.Array:
    """Attends ``x`` ``[B, T, d]`` under ``mask`` ``[B, T, T]``."""
    query, key, value = self.project(x)
    if self.q_norm is not None:
      query, key = self.q_norm(query), self.k_norm(key)
    query = apply_rotary(query, *rotary)
    key = apply_rotary(key, *rotary)
    batch, length = x.shape[:2]
    groups = self.num_heads // self.num_kv_heads
    query = query.reshape(batch, length, self.num_kv_heads, groups,
                          self.head_dim)
    logits = jnp.einsum('btkgh,bskh->bkgts', query, key,
                        preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(self.head_dim)
    logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    mixed = jnp.einsum('bkgts,bskh->btkgh', weights, value)
    return self.o(mixed.reshape(batch, length, -1))


class MLP(nnx.Module):
  """Gated (``down(act(gate x) * up x)``) or plain (``fc2(act(fc1 x))``)."""

  def __init__(self, config: config_lib.ModelConfig, *, dtype: Any,
               param_dtype: Any, rngs: nnx.Rngs):
    self.activation = _ACTIVATIONS[config.activation]
    linear = lambda i, o: nnx.Linear(
        i, o, use_bias=config.mlp_bias, dtype=dtype, param_dtype=param_dtype,
        rngs=rngs)
    d, f = config.hidden_size, config.intermediate_size
    self.gated = config.mlp_type == 'gated'
    if self.gated:
      self.gate, self.up, self.down = linear(d, f), linear(d, f), linear(f, d)
    else:
      self.fc1, self.fc2 = linear(d, f), linear(f, d)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.gated:
      return self.down(self.activation(self.gate(x)) * self.up(x))
    return self.fc2(self.activation(self.fc1(x)))
