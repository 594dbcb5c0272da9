"""The example's ``DecoderLM`` written as a ``taco_optax.LayeredLoss``.

:func:`layered_decoder` splits an NNX :class:`examples.finetune.model.DecoderLM`
into ``(outer, layers)`` parameter states and the three pure functions that
:func:`taco_optax.layerwise_train_step` needs; :func:`merge_params` puts the
trained states back into the model. The loss is the mean next-token negative
log-likelihood over the real tokens of ``(input_ids, attention_mask)``.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from taco_optax import _train_step  # taco_optax.LayeredLoss once exported
from examples.finetune import layers as layers_lib
from examples.finetune import model as model_lib


class LayeredDecoder(NamedTuple):
  loss: _train_step.LayeredLoss
  params: tuple[Any, Any]      # (outer state, layers state or list)
  graphdef: Any


def _context(config, batch):
  """Rotary angles and attention mask of a batch (recomputed per layer)."""
  input_ids, attention_mask = batch
  attention_mask = attention_mask.astype(bool)
  positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)
  rotary = layers_lib.rotary_angles(
      positions, layers_lib.rotary_inverse_frequencies(config))
  mask = layers_lib.attention_mask(attention_mask, config.sliding_window)
  return positions, rotary, mask


def layered_decoder(model: model_lib.DecoderLM) -> LayeredDecoder:
  """Splits ``model`` for :func:`taco_optax.layerwise_train_step`."""
  config, dtype = model.config, model.dtype
  graphdef, state = nnx.split(model)
  outer = nnx.State({k: v for k, v in state.items() if k != 'layers'})
  if model.scan_layers:
    block_def, _ = nnx.split(model.layers)
    layers = state['layers']
  else:
    block_def, _ = nnx.split(model.layers[0])
    layers = [state['layers'][i] for i in range(config.num_layers)]
  module_defs = {k: nnx.split(getattr(model, k))[0] for k in outer.keys()}
  module = lambda outer, name: nnx.merge(module_defs[name], outer[name])

  def embed(outer, batch):
    input_ids, _ = batch
    x = module(outer, 'embed')(input_ids)
    if config.learned_positions:
      positions, _, _ = _context(config, batch)
      x = x + module(outer, 'positions')(positions + config.position_offset)
    return x

  def layer(block_state, x, batch):
    _, rotary, mask = _context(config, batch)
    return model_lib._block_step(block_def, block_state, x, rotary, mask)  # pylint: disable=protected-access

  def head(outer, x, batch):
    input_ids, attention_mask = batch
    x = module(outer, 'final_norm')(x)
    if config.tie_word_embeddings:
      logits = jnp.einsum('btd,vd->btv', x,
                          outer['embed']['embedding'][...].astype(dtype),
                          preferred_element_type=jnp.float32)
    else:
      logits = module(outer, 'lm_head')(x)
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), input_ids[:, 1:])
    weights = attention_mask[:, 1:].astype(jnp.float32)
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)

  loss = _train_step.LayeredLoss(embed, layer, head,
                                scan_layers=model.scan_layers,
                                remat=model.remat == 'block')
  return LayeredDecoder(loss, (outer, layers), graphdef)


def merge_params(decoder: LayeredDecoder, params: tuple[Any, Any]
                 ) -> model_lib.DecoderLM:
  """The model holding ``params`` (as returned by the train step)."""
  outer, layers = params
  state = dict(outer.items())
  if isinstance(layers, list):
    layers = nnx.State({i: s for i, s in enumerate(layers)})
  state['layers'] = layers
  return nnx.merge(decoder.graphdef, nnx.State(state))


def taco_hints(params):
  """Dimension numbers and update scales of the (outer, layers) pair."""
  return (model_lib.taco_dimension_numbers(params),
          model_lib.taco_update_scale(params))
