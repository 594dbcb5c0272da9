"""A tunix decoder written as ``embed -> layers -> head`` for the layer-wise step.

tunix's language models (``Qwen3``, ``Llama3``, ``Gemma3``, ...) share one
shape: ``embedder.encode(tokens)``, a Python list of ``layers`` each called as
``layer(x, positions, cache, attention_mask) -> (cache, x)``, ``final_norm``,
then ``embedder.decode`` (tied) or an ``lm_head``. :func:`layered` splits a
live model into a :class:`~taco_optax.layerwise.LayeredLoss` built from the
model's own submodules, with tunix's default SFT loss (next-token negative
log-likelihood over ``input_mask``), so the loss equals
``peft_trainer._default_loss_fn`` (tested), and a :class:`Relayout` between
the model's parameter ``State`` and the step's ``(outer, layers)`` pair.
"""

from typing import Any, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp

from taco_optax._src import layerwise
from taco_optax._src.integrations import relayout as relayout_lib

TABLE = 'input_embedding'


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
  vision = getattr(getattr(model, 'config', None), 'vision_config', None)
  if vision is not None:
    return f'{type(model).__name__} has a vision encoder'
  return None


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
  relayout: relayout_lib.Relayout


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
  return -jnp.sum(picked * mask) / (jnp.sum(mask) + 1e-8)


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

  def layer(params, hidden, batch):
    graphdef, rest = layer_defs[params.index]
    module = _module(graphdef, rest, params.params)
    _, hidden = module(hidden, batch['positions'], None,
                       batch['attention_mask'])
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
  return Layered(loss, relayout_lib.Relayout.of(params, split))


def _split(module):
  graphdef, _, *rest = nnx.split(module, nnx.Param, ...)
  return graphdef, rest


def _pure(module):
  return nnx.as_pure(nnx.state(module, nnx.Param))
