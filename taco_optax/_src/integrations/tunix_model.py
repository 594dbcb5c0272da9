"""A tunix decoder as ``embed -> layers -> head``, for the layer-wise step.

tunix's language models (``Qwen3``, ``Llama3``, ``Gemma3``, ...) share one
shape: ``embedder.encode(tokens)``, a Python list of ``layers`` each called as
``layer(x, positions, cache, attention_mask) -> (cache, x)``, ``final_norm``,
then ``embedder.decode`` (tied) or an ``lm_head``. :func:`layered` splits a
live model into a :class:`~taco_optax.layerwise.LayeredLoss` built from the
model's own submodules, with tunix's default SFT loss (next-token negative
log-likelihood over ``input_mask``), so the loss equals the default
``loss_fn`` of tunix's ``PeftTrainer`` (tested), and a :class:`Relayout` between
the model's parameter ``State`` and the step's ``(outer, layers)`` pair.
"""

import inspect
from typing import Any, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp

from taco_optax._src import layerwise

TABLE = 'input_embedding'
# A batch key the layer-wise trainer adds: the denominator of each
# micro-batch's summed loss (token-weighted accumulation).
DENOMINATOR = 'taco_loss_denominator'
# How tunix's decoders call a layer (tunix 0.1.7 and 0.1.8).
LAYER_PARAMETERS = ('x', 'segment_pos', 'cache', 'attn_mask')


def unsupported(model: Any) -> Optional[str]:
  """Why ``model`` is not of the shape :func:`layered` splits, or ``None``."""
  for name in ('embedder', 'layers', 'final_norm'):
    if not hasattr(model, name):
      return f'{type(model).__name__} has no `{name}`'
  embedder = model.embedder
  if not (hasattr(embedder, 'encode') and hasattr(embedder, TABLE)):
    return (f'{type(model).__name__}.embedder has no `encode` and '
            f'`{TABLE}`')
  if not hasattr(model.layers, '__len__'):
    return f'{type(model).__name__}.layers is not a list of layers'
  for layer in model.layers:
    reason = _unfamiliar_call(layer)
    if reason is not None:
      return reason
  vision = getattr(getattr(model, 'config', None), 'vision_config', None)
  if vision is not None:
    return f'{type(model).__name__} has a vision encoder'
  return None


def _unfamiliar_call(layer: Any) -> Optional[str]:
  """Why ``layer`` is not called as tunix's decoders call theirs, or None."""
  try:
    parameters = list(inspect.signature(layer).parameters.values())
  except (TypeError, ValueError):
    return f'{type(layer).__name__} has no inspectable call'
  positional = [p.name for p in parameters
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  required = [p.name for p in parameters[len(LAYER_PARAMETERS):]
              if p.default is p.empty
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
  if len(positional) < len(LAYER_PARAMETERS) or required:
    return (f'{type(layer).__name__} is called as ({", ".join(positional)}), '
            f'not as tunix\'s decoder layers ({", ".join(LAYER_PARAMETERS)})')
  return None


def _takes_segment_ids(layer: Any) -> bool:
  return 'segment_ids' in inspect.signature(layer).parameters


@jax.tree_util.register_pytree_node_class
class Layer:
  """One layer's parameters, tagged with its position (static)."""

  def __init__(self, index: int, params: Any):
    self.index = index
    self.params = params

  def tree_flatten(self):
    return (self.params,), self.index

  @classmethod
  def tree_unflatten(cls, index, children):
    return cls(index, *children)


class Layered(NamedTuple):
  """A model as the layer-wise step sees it.

  Attributes:
    loss: the model's SFT loss as a ``LayeredLoss``.
    relayout: model ``State`` -> ``(outer, [Layer, ...])`` and back.
  """
  loss: layerwise.LayeredLoss
  relayout: layerwise.Relayout


def split(params: Any) -> tuple[dict[str, Any], list[Layer]]:
  """The model's parameter ``State`` as ``(outer, layers)``."""
  outer = {name: params[name] for name in params if name != 'layers'}
  layers = params['layers']
  return outer, [Layer(i, layers[i]) for i in sorted(layers)]


def _module(graphdef, rest, params):
  return nnx.merge(graphdef, params, *rest)


def _with_leaf(params, name, value):
  """``params`` (a module's pure ``State``) with its leaf ``name`` replaced."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = [str(getattr(path[0], 'key', path[0])) for path, _ in leaves]
  values = [value if n == name else x for n, (_, x) in zip(names, leaves)]
  return jax.tree.unflatten(treedef, values)


def next_token_loss(logits: jax.Array, batch: dict[str, Any]) -> jax.Array:
  """tunix's default SFT loss from the ``[B * (T - 1), vocab]`` logits."""
  targets = batch['input_tokens'][:, 1:].reshape(-1)
  mask = batch['input_mask'][:, 1:].reshape(-1).astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  picked = jnp.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
  denominator = batch.get(DENOMINATOR)
  if denominator is None:
    denominator = jnp.sum(mask) + 1e-8
  return -jnp.sum(picked * mask) / denominator


def layered(model: Any) -> Layered:
  """Splits a tunix decoder (see :func:`unsupported`) for the layer-wise step.

  The embedding is a ``TableLookup`` and the head a ``TableProjection`` on
  the tied table or the ``lm_head`` weight, so neither table gets a dense
  gradient. Each layer runs as its own module (its own graph: layers may
  differ, e.g. Gemma's local and global attention), remat as the model's
  ``remat_config`` makes its ``__call__``.
  """
  reason = unsupported(model)
  if reason is not None:
    raise ValueError(f'The layer-wise step cannot split this model: {reason}.')
  tied = not hasattr(model, 'lm_head')
  outer_names = [name for name in nnx.state(model, nnx.Param)
                 if name != 'layers']
  outer_defs = {name: _split(getattr(model, name)) for name in outer_names}
  layer_defs = [_split(layer) for layer in model.layers]

  def outer_module(name, outer, params=None):
    graphdef, rest = outer_defs[name]
    return _module(graphdef, rest, outer[name] if params is None else params)

  def embed_apply(outer, rows, batch):
    # The embedder's own encode on the looked-up rows: an identity lookup of
    # ``rows`` as a table, so its scaling, cast and sharding apply as in the
    # model and the table itself is read only by the row lookup.
    flat = rows.reshape(-1, rows.shape[-1])
    embedder = outer_module('embedder', outer,
                            _with_leaf(outer['embedder'], TABLE, flat))
    ids = jnp.arange(flat.shape[0]).reshape(rows.shape[:-1])
    return embedder.encode(ids)

  def features(outer, hidden, batch):
    hidden = outer_module('final_norm', outer)(hidden)
    return hidden[:, :-1].reshape(-1, hidden.shape[-1])

  def project(states, table):
    if tied:
      embedder = outer_module('embedder', None,
                              _with_leaf(_pure(model.embedder), TABLE, table))
      logits = embedder.decode(states)
    else:
      head = outer_module('lm_head', None,
                          _with_leaf(_pure(model.lm_head), 'w', table))
      logits = head(states[None])[0]
    return logits.astype(jnp.float32)

  segment_ids = [_takes_segment_ids(layer) for layer in model.layers]

  def layer(params, hidden, batch):
    graphdef, rest = layer_defs[params.index]
    module = _module(graphdef, rest, params.params)
    # As the model's own call: segment ids (tunix 0.1.8) when there are any.
    extra = ({'segment_ids': batch['segment_ids']}
             if segment_ids[params.index] and 'segment_ids' in batch else {})
    _, hidden = module(hidden, batch['positions'], None,
                       batch['attention_mask'], **extra)
    return hidden

  head = layerwise.TableProjection(
      table=('embedder', TABLE) if tied else ('lm_head', 'w'),
      features=features, loss=next_token_loss, project=project,
      table_axis=1 if tied else 0)
  embed = layerwise.TableLookup(table=('embedder', TABLE),
                                   ids=lambda batch: batch['input_tokens'],
                                   apply=embed_apply)
  loss = layerwise.LayeredLoss(embed=embed, layer=layer, head=head,
                                   scan_layers=False)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  return Layered(loss, layerwise.Relayout.of(params, split))


def _split(module):
  graphdef, _, *rest = nnx.split(module, nnx.Param, ...)
  return graphdef, rest


def _pure(module):
  return nnx.as_pure(nnx.state(module, nnx.Param))
