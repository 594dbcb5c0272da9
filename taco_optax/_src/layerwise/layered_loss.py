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
