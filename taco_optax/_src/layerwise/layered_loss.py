"""A loss written as ``embed -> layer x L -> head``, for the layer-wise step."""

import dataclasses
from typing import Any, Callable

import jax

from taco_optax._src.layerwise import remat as remat_lib

Params = Any
Batch = Any
Hidden = Any


@dataclasses.dataclass(frozen=True)
class LayeredLoss:
  """A loss written as ``embed -> layer x L -> head``.

  The parameters are a pair ``(outer, layers)``: ``outer`` holds everything
  outside the repeated block (embeddings, final norm, LM head); ``layers`` is
  either one tree whose leaves have a leading layer axis (layers stacked for
  ``lax.scan`` / ``nnx.scan``) or a list of per-layer trees (unrolled).

  A language model's token tables are best given as a
  :class:`TableLookup` ``embed`` and a :class:`TableProjection` ``head``: the
  layer-wise step then never forms their dense gradient (it keeps each use's
  small factors and forms the gradient a block of columns at a time).

  Attributes:
    embed: ``embed(outer, batch) -> hidden``.
    layer: ``layer(layer_params, hidden, batch) -> hidden``; ``hidden`` is an
      array or a pytree of float arrays.
    head: ``head(outer, hidden, batch) -> loss`` (a scalar).
    scan_layers: ``True`` if ``layers`` is stacked along a leading axis.
    remat: recompute each layer in the backward pass (as ``jax.checkpoint``
      would, with weights split over a mesh gathered when used:
      :func:`remat_layers`) in :meth:`__call__`; the layerwise step always
      does.
  """
  embed: Callable[[Params, Batch], Hidden]
  layer: Callable[[Params, Hidden, Batch], Hidden]
  head: Callable[[Params, Hidden, Batch], jax.Array]
  scan_layers: bool = True
  remat: bool = True

  def __call__(self, params: tuple[Params, Params], batch: Batch) -> jax.Array:
    """The loss, for the plain ``jax.grad`` + optax path."""
    outer, layers = params
    layer = lambda p, h: self.layer(p, h, batch)
    hidden = self.embed(outer, batch)
    if self.remat:
      hidden = remat_lib.remat_layers(layer, layers, hidden,
                                      scan_layers=self.scan_layers)
    elif self.scan_layers:
      hidden, _ = jax.lax.scan(lambda h, p: (layer(p, h), None), hidden,
                               layers)
    else:
      for layer_params in layers:
        hidden = layer(layer_params, hidden)
    return self.head(outer, hidden, batch)


def _is_framework_variable(x: Any) -> bool:
  """A Flax NNX ``Variable`` (an ``nnx.State``'s leaves), without importing
  flax."""
  return any(cls.__name__ == 'Variable' and cls.__module__.startswith('flax.')
             for cls in type(x).__mro__)


def check_params(params: Any, scan_layers: bool) -> None:
  """Raises, naming the argument, for params the layer-wise step cannot take.

  Args:
    params: what the step was called with.
    scan_layers: the loss's :attr:`LayeredLoss.scan_layers`.

  Raises:
    ValueError: ``params`` is not an ``(outer, layers)`` pair, unrolled
      ``layers`` is not a list, or a leaf is a Flax NNX ``Variable``.
  """
  if not isinstance(params, (tuple, list)) or len(params) != 2:
    raise ValueError(
        'The layer-wise step takes params as the pair (outer, layers) its '
        f'LayeredLoss reads; got a {type(params).__name__}. Split the model '
        '(e.g. outer = its embedding, final norm and head; layers = one tree '
        'per block, or one stacked tree) and pass (outer, layers).')
  if not scan_layers and not isinstance(params[1], (list, tuple)):
    raise ValueError(
        'LayeredLoss(scan_layers=False) reads layers as a list of per-layer '
        f'trees; params[1] is a {type(params[1]).__name__}. Pass a list, or '
        'scan_layers=True for one tree with a leading layer axis.')
  leaves, _ = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=_is_framework_variable)
  held = [jax.tree_util.keystr(path) for path, leaf in leaves
          if _is_framework_variable(leaf)]
  if held:
    raise ValueError(
        f'params hold Flax NNX Variables (at {", ".join(held[:3])}'
        f'{", ..." if len(held) > 3 else ""}): the layer-wise step writes '
        'winners into plain arrays. Pass nnx.as_pure(nnx.state(module)) (or '
        'nnx.split(module)[1] made pure) for each part, and nnx.update the '
        'module with the result.')
