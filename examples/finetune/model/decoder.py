"""A decoder-only language model for every supported family (Flax NNX).

:class:`DecoderLM` covers Llama/SmolLM2, Mistral, Qwen3, OPT and GPT-NeoX
through :class:`config.ModelConfig`. Blocks can be rematerialised
(``jax.checkpoint`` with a selectable policy) and stacked into one scanned
block whose parameters carry a leading layer axis.

:func:`taco_dimension_numbers` and :func:`taco_update_scale` tell
:func:`taco_optax.taco` which parameters are matrices and how to scale them.
"""

from typing import Any, Optional

from flax import nnx
import jax
import jax.numpy as jnp

from examples.finetune.model import config as config_lib
from examples.finetune.model import layers
from examples.finetune.model import vocab_parallel
import taco_optax

REMAT_POLICIES = ('nothing_saveable', 'dots_saveable',
                  'dots_with_no_batch_dims_saveable', 'everything_saveable')


class Block(nnx.Module):
  """One pre-norm decoder block, sequential or parallel residual."""

  def __init__(self, config: config_lib.ModelConfig, *, dtype: Any,
               param_dtype: Any, rngs: nnx.Rngs):
    kwargs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.parallel_residual = config.parallel_residual
    self.attn_norm = layers.norm(config, config.hidden_size, **kwargs)
    self.attn = layers.Attention(config, **kwargs)
    self.mlp_norm = layers.norm(config, config.hidden_size, **kwargs)
    self.mlp = layers.MLP(config, **kwargs)

  @layers.partitioned_by_xla
  def __call__(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array],
               mask: jax.Array) -> jax.Array:
    attended = self.attn(self.attn_norm(x), rotary, mask)
    if self.parallel_residual:
      return x + attended + self.mlp(self.mlp_norm(x))
    x = x + attended
    return x + self.mlp(self.mlp_norm(x))


def _block_step(graphdef: nnx.GraphDef, block_state: nnx.State, x: jax.Array,
                rotary: tuple[jax.Array, jax.Array], mask: jax.Array
                ) -> jax.Array:
  """A block as a pure function of its state, for ``jax.checkpoint``/scan."""
  return nnx.merge(graphdef, block_state)(x, rotary, mask)


class DecoderLM(nnx.Module):
  """A causal language model: embeddings, blocks, final norm, output head.

  Args:
    config: the architecture.
    dtype: computation dtype of activations and matmuls.
    param_dtype: dtype of the parameters.
    remat: ``'block'`` recomputes each block's activations in the backward
      pass (gradient checkpointing); ``None`` stores them.
    remat_policy: name of a ``jax.checkpoint_policies`` entry saying what a
      rematerialised block may keep (``REMAT_POLICIES``). With the default,
      ``'nothing_saveable'``, the blocks run through
      ``taco_optax.layerwise.remat_layers``: on a mesh each block's split
      weights are gathered for its use, at most two blocks' at once; with
      another policy ``jax.checkpoint`` runs them and XLA may gather every
      block's weights at the step's start.
    scan_layers: stack the blocks' parameters along a leading layer axis and
      run them with ``jax.lax.scan`` (one compiled block).
    rngs: random initialisation (replaced when loading a checkpoint).
  """

  def __init__(self, config: config_lib.ModelConfig, *,
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.bfloat16,
               remat: Optional[str] = 'block',
               remat_policy: str = 'nothing_saveable',
               scan_layers: bool = False, rngs: nnx.Rngs = None):
    if remat not in ('block', None):
      raise ValueError(f"remat must be 'block' or None, got {remat!r}.")
    if remat_policy not in REMAT_POLICIES:
      raise ValueError(f'remat_policy must be one of {REMAT_POLICIES}, got '
                       f'{remat_policy!r}.')
    rngs = nnx.Rngs(0) if rngs is None else rngs
    self.config = config
    self.dtype = dtype
    self.remat = remat
    self.remat_policy = remat_policy
    self.scan_layers = scan_layers
    kwargs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.embed = layers.Embed(config.vocab_size, config.hidden_size, **kwargs)
    if config.learned_positions:
      self.positions = layers.Embed(
          config.max_position_embeddings + config.position_offset,
          config.hidden_size, **kwargs)
    if scan_layers:
      self.layers = _stacked_blocks(config, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
    else:
      self.layers = nnx.List([Block(config, **kwargs)
                              for _ in range(config.num_layers)])
    self.final_norm = layers.norm(config, config.hidden_size, **kwargs)
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size,
                                use_bias=False, **kwargs)

  def __call__(self, input_ids: jax.Array,
               attention_mask: Optional[jax.Array] = None) -> jax.Array:
    """Next-token logits.

    Args:
      input_ids: ``int32[B, T]``.
      attention_mask: ``bool[B, T]``, true for real tokens (right or left
        padding); ``None`` means no padding. Positions count real tokens
        only, so a padded row gives the logits of the unpadded sequence.

    Returns:
      ``float32[B, T, vocab_size]`` logits; position ``t`` predicts token
      ``t + 1``.
    """
    return self.project(self.hidden_states(input_ids, attention_mask))

  def hidden_states(self, input_ids: jax.Array,
                    attention_mask: Optional[jax.Array] = None) -> jax.Array:
    """``[B, T, hidden]`` final-normed states that :meth:`project` scores.

    A loss or an evaluation that needs a few positions (the prompt's last)
    or a few tokens (the label words) projects only those, instead of the
    ``[B, T, vocab]`` logits of :meth:`__call__`.
    """
    config = self.config
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids.shape, bool)
    attention_mask = attention_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
    x = self.embed(input_ids)
    if config.learned_positions:
      x = x + self.positions(positions + config.position_offset)
    rotary = layers.rotary_angles(positions,
                                  layers.rotary_inverse_frequencies(config))
    mask = layers.attention_mask(attention_mask, config.sliding_window)
    x = self._run_blocks(x, rotary, mask)
    return self.final_norm(x)

  def project(self, hidden: jax.Array,
              token_ids: Optional[jax.Array] = None,
              vocab_split: bool = False) -> jax.Array:
    """float32 logits of ``hidden`` (``[..., hidden]``) over the vocabulary,
    or over ``token_ids`` only (``[..., C]``, same leading shape: ``C``
    tokens per row); ``vocab_split``: see :func:`project`."""
    return project(hidden, self._output_matrix(), self.dtype, token_ids,
                   vocab_split)

  def _output_matrix(self) -> jax.Array:
    """``[vocab, hidden]``: the tied embedding or the head's kernel."""
    if self.config.tie_word_embeddings:
      return self.embed.embedding[...]
    return self.lm_head.kernel[...].T


  def _run_blocks(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array],
                  mask: jax.Array) -> jax.Array:
    if self.scan_layers:
      graphdef, block_states = nnx.split(self.layers)
    else:
      graphdef = nnx.split(self.layers[0])[0]
      block_states = [nnx.split(block)[1] for block in self.layers]
    step = lambda block_state, x: _block_step(graphdef, block_state, x,
                                              rotary, mask)
    if self.remat == 'block' and self.remat_policy == 'nothing_saveable':
      # Recomputed like jax.checkpoint; on a mesh each block's split weights
      # are gathered when used, not all at the step's start.
      return taco_optax.layerwise.remat_layers(step, block_states, x,
                                               scan_layers=self.scan_layers)
    if self.remat == 'block':
      step = jax.checkpoint(
          step, policy=getattr(jax.checkpoint_policies, self.remat_policy))
    if self.scan_layers:
      return jax.lax.scan(lambda h, state: (step(state, h), None), x,
                          block_states)[0]
    for block_state in block_states:
      x = step(block_state, x)
    return x


def _stacked_blocks(config: config_lib.ModelConfig, *, dtype: Any,
                    param_dtype: Any, rngs: nnx.Rngs) -> Block:
  """``num_layers`` blocks as one :class:`Block` with a leading layer axis."""
  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make_block(block_rngs: nnx.Rngs) -> Block:
    return Block(config, dtype=dtype, param_dtype=param_dtype,
                 rngs=block_rngs)
  return make_block(rngs)


def path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
  """Dictionary keys and list indices of a state path, as strings.

  Attribute entries (a variable's ``.value``) are skipped so that pure and
  variable-holding states give the same names.
  """
  names = []
  for entry in path:
    if isinstance(entry, jax.tree_util.DictKey):
      names.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.SequenceKey):
      names.append(str(entry.idx))
  return tuple(names)


def is_matrix(leaf) -> bool:
  """A rank-2 parameter: what Muon and GaLore treat as a matrix, and what the
  memory planner counts as a matrix gradient outside the layers."""
  return len(leaf.shape) == 2


def _leaf_dimension_numbers(names: tuple[str, ...], ndim: int
                            ) -> Optional[taco_optax.TacoDimensionNumbers]:
  """TACO axes of one parameter, from its path and rank, or None."""
  if names[-1] == 'embedding':
    # A (vocab, d) table: rows are tokens (the paper's m), columns features.
    return taco_optax.TacoDimensionNumbers(reduction_axis=ndim - 1,
                                           output_axis=ndim - 2)
  if names[-1] == 'kernel':
    matrix_rank = 3 if 'qkv' in names else 2
    # Leading axes beyond the matrix (the scanned layer axis) and the Q/K/V
    # axis of a fused kernel are batch axes: independent matrices.
    return taco_optax.TacoDimensionNumbers(reduction_axis=ndim - matrix_rank,
                                           output_axis=ndim - 1)
  return None


def taco_dimension_numbers(params_state: Any) -> Any:
  """TACO dimension numbers for a :class:`DecoderLM` parameter tree.

  Every matrix is a TACO matrix: projection kernels (``(in, out)``, with a
  leading layer axis when scanned), the fused QKV kernel ``(d, 3, d)`` as
  three matrices, the token (and learned position) embedding with the
  vocabulary as rows. Norm scales and biases get ``None`` (AdamW).

  Args:
    params_state: ``nnx.state(model, nnx.Param)``, pure or with variables;
      ``optax.MaskedNode`` leaves are kept.

  Returns:
    A tree of the same structure holding
    :class:`taco_optax.TacoDimensionNumbers` or ``None``; usable as
    ``taco(..., weight_dimension_numbers=taco_dimension_numbers)``.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _leaf_dimension_numbers(path_names(path),
                                                 jnp.ndim(leaf)),
      params_state)


def taco_update_scale(params_state: Any) -> Any:
  """TACO update scales: ``1.0`` for the token embedding, else ``None``.

  ``None`` means the default ``m / n``; the paper uses 1 for the token
  embedding, whose ``m / n = vocab / d`` would be far too large.
  """
  def scale(path, leaf):
    del leaf
    names = path_names(path)
    return 1.0 if names[-2:] == ('embed', 'embedding') else None
  return jax.tree_util.tree_map_with_path(scale, params_state)


def project(hidden: jax.Array, table: jax.Array, dtype,
            token_ids: Optional[jax.Array] = None,
            vocab_split: bool = False) -> jax.Array:
  """float32 logits ``hidden . table[v]`` for every ``v`` of the vocabulary,
  or for ``token_ids`` (``[..., C]``) only.

  On a mesh with ``Explicit`` axes (``--mesh``) XLA partitions the projection
  (:func:`layers.by_xla`): the logits come out split like ``hidden`` along
  the batch axis, whole elsewhere. With ``vocab_split`` and a table split
  over the vocabulary they come out split over it instead, and the table is
  not gathered (``vocab_parallel.project``; the training losses read such
  logits).

  Args:
    hidden: ``[..., hidden]`` states.
    table: ``[vocab, hidden]`` output embedding.
    dtype: computation dtype of the model.
    token_ids: optional ``int32[..., C]`` tokens to score per row.
    vocab_split: logits split over the vocabulary where the table is.
  """
  if (vocab_split and token_ids is None and layers.explicit_mesh()
      and vocab_parallel.vocab_split_axes(table)):
    return vocab_parallel.project(hidden, table, dtype)
  def logits(hidden, table, token_ids):
    table = table.astype(dtype)
    if token_ids is None:
      return jnp.einsum('...d,vd->...v', hidden, table,
                        preferred_element_type=jnp.float32)
    return jnp.einsum('...d,...cd->...c', hidden, table[token_ids],
                      preferred_element_type=jnp.float32)

  return layers.by_xla(logits, hidden, table, token_ids)
