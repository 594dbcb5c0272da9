"""A :class:`decoder.DecoderLM` written as ``embed -> blocks -> head``.

The memory-lean TACO step (``taco_optax``'s layer-wise train step) runs the
backward pass one block at a time and writes each column's winners into the
weights as soon as that block's gradient exists. It needs the loss as three
pure functions over ``(outer, layers)`` parameters; this module builds them
from a live model, using the model's own submodules, so the loss equals
``losses.completion_loss`` (tested).
"""

from typing import Any, Callable, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from examples.finetune import losses as losses_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import layers as layers_lib
import taco_optax


class LayeredModel(NamedTuple):
  """A model as a ``LayeredLoss`` plus its parameters.

  Attributes:
    loss: the model's loss as a ``taco_optax.layerwise.LayeredLoss``.
    params: ``(outer, layers)`` pure parameter trees; ``layers`` is a list of
      per-block trees, or one tree with a leading layer axis when the model
      scans its layers.
    write_back: ``write_back(params)`` puts parameters into the live model.
  """
  loss: taco_optax.layerwise.LayeredLoss
  params: tuple[Any, Any]
  write_back: Callable[[tuple[Any, Any]], None]

  def named(self, params: tuple[Any, Any]) -> dict[str, Any]:
    """``params`` keyed by module path, as ``nnx.state(model, nnx.Param)``:
    ``{'embed': ..., 'layers': {0: block, ...} or stacked, ...}``."""
    outer, layers = params
    if isinstance(layers, (list, tuple)):
      layers = dict(enumerate(layers))
    return {**outer, 'layers': layers}

  def named_state(self, opt_state: Any) -> Any:
    """``opt_state`` with each ``(outer, layers)`` pair in it :meth:`named`
    (the layer-wise step's optimizer state mirrors its parameters)."""
    return jax.tree.map(lambda x: self.named(x) if _is_pair(x) else x,
                        opt_state, is_leaf=_is_pair)

  def state_from_named(self, named_state: Any, like: Any) -> Any:
    """:meth:`named_state` undone, laid out as the optimizer state ``like``.
    """
    return jax.tree.map(
        lambda x, named: self.from_named(named) if _is_pair(x) else named,
        like, named_state, is_leaf=_is_pair)

  def from_named(self, named: dict[str, Any]) -> tuple[Any, Any]:
    """:meth:`named` undone (its ``layers`` a list again when unscanned)."""
    outer = {key: value for key, value in named.items() if key != 'layers'}
    layers = named['layers']
    if isinstance(self.params[1], (list, tuple)):
      layers = [layers[i] for i in range(len(self.params[1]))]
    return outer, layers


def _is_pair(x: Any) -> bool:
  """An ``(outer, layers)`` pair: a plain tuple (not an optax state)."""
  return (type(x) is tuple and len(x) == 2  # pylint: disable=unidiomatic-typecheck
          and isinstance(x[0], dict) and isinstance(x[1], (list, dict)))


def _outer_modules(model) -> dict[str, nnx.Module]:
  modules = {'embed': model.embed, 'final_norm': model.final_norm}
  if model.config.learned_positions:
    modules['positions'] = model.positions
  if not model.config.tie_word_embeddings:
    modules['lm_head'] = model.lm_head
  return modules


def _positions(attention_mask):
  return jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)


def layered_model(model) -> LayeredModel:
  """Splits ``model`` into ``embed``/``layer``/``head`` pure functions.

  The embedding is a ``taco_optax.layerwise.TableLookup`` and the head a
  ``taco_optax.layerwise.TableProjection`` (final norm, the scored positions,
  the projection onto the tied table or the LM head's kernel, then
  ``losses.logits_loss``), so the layer-wise step never forms the token
  table's dense gradient.

  Args:
    model: a :class:`decoder.DecoderLM`.

  Returns:
    A :class:`LayeredModel`.
  """
  config = model.config
  outer_modules = _outer_modules(model)
  outer_defs = {name: nnx.split(module)[0]
                for name, module in outer_modules.items()}
  outer = {name: nnx.as_pure(nnx.state(module))
           for name, module in outer_modules.items()}
  if model.scan_layers:
    block_def, stacked = nnx.split(model.layers)
    layers = nnx.as_pure(stacked)
  else:
    block_def = nnx.split(model.layers[0])[0]
    layers = [nnx.as_pure(nnx.state(block)) for block in model.layers]
  inverse_frequencies = layers_lib.rotary_inverse_frequencies(config)

  def module(name, outer_params):
    return nnx.merge(outer_defs[name], outer_params[name])

  def gather(table, ids):  # the model's own lookup (dtype, mesh)
    return module('embed', {'embed': {'embedding': table}})(ids)

  def embed_rows(outer_params, rows, batch):
    if config.learned_positions:
      mask = batch.attention_mask.astype(bool)
      rows = rows + module('positions', outer_params)(
          _positions(mask) + config.position_offset)
    return rows

  def features(outer_params, hidden, batch):
    hidden = module('final_norm', outer_params)(hidden)
    return losses_lib.scored_states(hidden, batch)

  tied = config.tie_word_embeddings
  head = taco_optax.layerwise.TableProjection(
      table=('embed', 'embedding') if tied else ('lm_head', 'kernel'),
      features=features, loss=losses_lib.logits_loss,
      project=lambda states, table: decoder_lib.project(
          states, table if tied else table.T, model.dtype, vocab_split=True),
      table_axis=1 if tied else 0)
  embed = taco_optax.layerwise.TableLookup(table=('embed', 'embedding'),
                                 ids=lambda batch: batch.input_ids,
                                 apply=embed_rows, gather=gather)

  def layer(block_params, hidden, batch):
    mask = batch.attention_mask.astype(bool)
    rotary = layers_lib.rotary_angles(_positions(mask), inverse_frequencies)
    attention = layers_lib.attention_mask(mask, config.sliding_window)
    return nnx.merge(block_def, block_params)(hidden, rotary, attention)

  def write_back(params):
    outer_params, layer_params = params
    for name, submodule in outer_modules.items():
      nnx.update(submodule, outer_params[name])
    if model.scan_layers:
      nnx.update(model.layers, layer_params)
    else:
      for block, block_params in zip(model.layers, layer_params):
        nnx.update(block, block_params)

  loss = taco_optax.layerwise.LayeredLoss(embed=embed, layer=layer, head=head,
                                scan_layers=model.scan_layers,
                                remat=model.remat is not None)
  return LayeredModel(loss, (outer, layers), write_back)
