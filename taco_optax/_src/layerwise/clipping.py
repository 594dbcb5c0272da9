"""Global-norm clipping for the layer-wise step: the norm in a first pass.

``optax.chain(optax.clip_by_global_norm(c), taco(...))`` scales the whole
gradient by ``c / ||G||`` when ``||G|| >= c`` before TACO sees it. The
layer-wise step consumes each layer's gradient as backprop makes it, so the
norm must be known before the backward pass starts: :func:`squared_norms`
runs one backward pass that keeps only each leaf's ``sum(g**2)`` (one layer's
gradient alive at a time, as in the step), and the step then runs with every
gradient clipped as ``clip_by_global_norm`` clips it. The cost is one more
forward and backward pass.
"""

from typing import Any, Callable, Mapping, Optional, Union

import jax
import jax.numpy as jnp

from taco_optax._src.layerwise import accumulation
from taco_optax._src.layerwise import backward
from taco_optax._src.layerwise import leaves as leaves_lib
from taco_optax._src.layerwise import micro_batch_table

Key = leaves_lib.Key


def _square_sum(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.square(x))


def squared_norms(loss, params, batch) -> dict[Key, jax.Array]:
  """``sum(g**2)`` of each leaf of ``params`` (the pair), by key, ``g`` the
  loss's gradient: the head's and the embedding's shares summed first, as
  ``jax.grad`` sums them; a stacked leaf's layers summed in layer order."""
  outer, layers = params
  run_layer = lambda p, h: loss.layer(p, h, batch)
  hidden, layer_inputs = backward.forward(
      run_layer, loss.embed(outer, batch), layers, loss.scan_layers)
  value, head_vjp = jax.vjp(lambda o, h: loss.head(o, h, batch), outer,
                            hidden)
  head_grads, d_hidden = head_vjp(jnp.ones_like(value))
  d_hidden, layer_sums = layer_squares(
      backward.vjp_backward(run_layer), layers, layer_inputs, d_hidden,
      loss.scan_layers)
  _, embed_vjp = jax.vjp(lambda o: loss.embed(o, batch), outer)
  (embed_grads,) = embed_vjp(d_hidden)
  summed = jax.tree.map(lambda h, e: _square_sum(h + e), head_grads,
                        embed_grads)
  return {**dict(leaves_lib.keyed(summed, leaves_lib.OUTER)), **layer_sums}


def layer_squares(layer_backward, layers, layer_inputs, d_hidden,
                  scan_layers: bool) -> tuple[Any, dict[Key, jax.Array]]:
  """``(d_hidden, sums)``: the backward pass over the layers (no update),
  keeping each leaf's ``sum(g**2)`` of ``layer_backward``'s gradient, by
  key."""
  if scan_layers:
    def body(d_hidden, xs):
      layer_params, layer_input = xs
      grads, d_hidden = layer_backward(layer_params, layer_input, d_hidden)
      return d_hidden, jax.tree.map(_square_sum, grads)
    d_hidden, per_layer = jax.lax.scan(body, d_hidden, (layers, layer_inputs),
                                       reverse=True)
    summed = jax.tree.map(lambda s: _ordered_sum(list(s)), per_layer)
    return d_hidden, dict(leaves_lib.keyed(summed, leaves_lib.LAYERS))
  sums: dict[Key, Any] = {}
  for l in reversed(range(len(layers))):
    grads, d_hidden = layer_backward(layers[l], layer_inputs[l], d_hidden)
    sums.update(leaves_lib.keyed(
        jax.tree.map(_square_sum, grads),
        leaves_lib.LAYERS + (jax.tree_util.SequenceKey(l),)))
  return d_hidden, sums


def square_sum(x: Optional[jax.Array]) -> Union[jax.Array, float]:
  """``sum(x**2)``; ``0.0`` for a leaf nothing reads (``None``)."""
  return 0.0 if x is None else _square_sum(x)


def _ordered_sum(values) -> jax.Array:
  total = values[0]
  for v in values[1:]:
    total = total + v
  return total


def global_norm(params: Any,
                squares: Mapping[Key, Union[float, jax.Array]]) -> jax.Array:
  """``optax.tree.norm``'s norm from each leaf's ``sum(g**2)``, summed in
  the pair's leaf order, as optax sums them (``0 + s_0 + s_1 + ...``)."""
  total: Union[float, jax.Array] = 0
  for key, _ in leaves_lib.keyed(params, ()):
    total = total + squares[key]
  return jnp.sqrt(jnp.asarray(total))


def clipper(norm: jax.Array, max_norm: float) -> Callable[[Any], Any]:
  """``clip_by_global_norm``'s ``g -> g`` below ``max_norm``, else
  ``(g / norm) * max_norm``."""
  trigger = norm < max_norm

  def clip(g):
    return jax.lax.select(trigger, g, (g / norm.astype(g.dtype)) * max_norm)
  return clip


def accumulated_norm(loss, params, layer_inputs, d_hidden, batches,
                     embed_reads, head_means, block_elements,
                     factors=frozenset()) -> jax.Array:
  """The global norm of the mean gradient (cast as ``MultiSteps`` casts it),
  from a backward pass over the layers that updates nothing (``factors``:
  the tables whose mean is kept as factors, formed whole here)."""
  outer, layers = params
  d_first, layer_sums = layer_squares(
      accumulation.layer_backward(loss.layer, batches), layers,
      layer_inputs, d_hidden, loss.scan_layers)
  means = accumulation.embed_means(loss.embed, outer, d_first, batches,
                                   embed_reads, dict(head_means),
                                   block_elements, factors)
  dense = lambda mean, x: (mean.dense() if isinstance(
      mean, micro_batch_table.MeanGradient) else mean.astype(x.dtype))
  outer_sums = {key: square_sum(None if key not in means
                                else dense(means[key], x))
                for key, x in leaves_lib.keyed(outer, leaves_lib.OUTER)}
  return global_norm(params, {**outer_sums, **layer_sums})
