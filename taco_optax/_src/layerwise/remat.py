"""Layers recomputed in the backward pass, their FSDP gathers issued when used.

The plain ``jax.value_and_grad`` step of a model whose layers run under
``jax.checkpoint`` gathers each layer's weights split over a mesh axis twice,
for the forward and for the backward's recomputation. Both gathers read only
the parameters (and the saved layer input), so XLA issues them all at the
step's start and keeps every layer's whole weights alive twice: on XLA:CPU a
2-layer OPT-13B at ``fsdp=8`` held 5.5 GB of gathered weights out of a 7.1 GB
peak, and each further layer added two layers' weights. :func:`remat_layers`
runs the same layers with the layer-wise step's order instead: one block in
use and one prefetched, in both passes.
"""

from typing import Any, Callable

import jax

from taco_optax._src import sharding
from taco_optax._src.layerwise import backward
from taco_optax._src.layerwise import ordering


def _splits_over_a_mesh(layers: Any) -> bool:
  return any(sharding.explicit_sharding(x) is not None
             for x in jax.tree.leaves(layers))


def _checkpointed(layer: Callable[[Any, Any], Any], layers: Any, hidden: Any,
                  scan_layers: bool) -> Any:
  """The layers under ``jax.checkpoint``, as a plain loss would run them."""
  layer = jax.checkpoint(layer)
  if scan_layers:
    return jax.lax.scan(lambda h, p: (layer(p, h), None), hidden, layers)[0]
  for layer_params in layers:
    hidden = layer(layer_params, hidden)
  return hidden


def _unrolled_backward(layer_backward: backward.LayerBackward,
                       layers: list[Any], layer_inputs: list[Any],
                       d_hidden: Any) -> tuple[list[Any], Any]:
  """Each layer's gradients and the first layer's input cotangent, in the
  layer-wise step's order (``backward.unrolled``).

  Layer ``l``'s split weights (so their gathers, and the recomputation that
  reads them) are read after the cotangent entering layer ``l + 1``: they
  run while that layer runs its backward pass, never earlier, and XLA
  cannot merge them with the forward's. What reads no split weight (a norm
  of the layer's input) XLA may still take from the forward, as it does
  under ``jax.checkpoint``: ordering the input too would recompute it, with
  other fusions and so other last bits than ``jax.checkpoint``'s gradients
  (a norm scale's, seen on the example's decoder), for one activation less
  per layer. Layer ``l``'s input cotangent waits for its reduced gradients:
  XLA otherwise combines every layer's gradient reduction into one at the
  end, keeping each layer's whole gradient alive.
  """
  grads = [None] * len(layers)
  previous_d_hidden = d_hidden
  for l in reversed(range(len(layers))):
    layer_params = ordering.ordered_after_if_sharded(layers[l],
                                                     previous_d_hidden)
    previous_d_hidden = d_hidden
    grads[l], d_hidden = layer_backward(layer_params, layer_inputs[l],
                                        d_hidden)
    d_hidden = ordering.ordered_after_all(d_hidden, jax.tree.leaves(grads[l]))
  return grads, d_hidden


def remat_layers(layer: Callable[[Any, Any], Any], layers: Any, hidden: Any,
                 *, scan_layers: bool) -> Any:
  """``layer`` applied over ``layers``, each recomputed in the backward pass.

  Differentiates like ``jax.checkpoint(layer)`` applied layer after layer
  (only each layer's input is kept for the backward pass), and is exactly
  that where no leaf of ``layers`` is split over an explicit mesh axis (one
  device, or an ``Auto`` mesh) and for stacked layers, whose ``lax.scan``
  already gathers each layer's slice inside its own iteration. Where the
  weights of a list of layers are split (FSDP), each use gathers them
  whole, and XLA would issue every layer's gathers, the forward's and the
  recomputation's, at the step's start and keep them to their last use: two
  whole copies of every layer's weights at once. Here instead layer ``l``'s
  split weights are read after layer ``l - 1``'s input in the forward pass,
  and after the cotangent entering layer ``l + 1`` in the backward pass,
  with true data edges (``values + 0``: an ``optimization_barrier`` does not
  survive on CPU), so at most two layers' gathered weights are alive, the
  one in use and the next one; and layer ``l - 1``'s backward waits for
  layer ``l``'s reduced gradients, which XLA would otherwise reduce all
  together at the end, each whole till then. The gradients are the same
  arithmetic as ``jax.checkpoint``'s (bit for bit, ``tests/
  test_mesh_memory.py``). Leaves not split over a mesh axis are read as
  they are (no copy).

  Args:
    layer: ``layer(layer_params, hidden) -> hidden``, a pure function;
      ``hidden`` is an array or a pytree of float arrays. Anything else it
      reads (the batch, a mask) it closes over, undifferentiated.
    layers: a list of per-layer parameter trees, or with ``scan_layers`` one
      tree whose leaves have a leading layer axis.
    hidden: the first layer's input.
    scan_layers: run ``layers`` stacked, with ``jax.lax.scan``.

  Returns:
    The last layer's output.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from taco_optax import layerwise
    >>> layer = lambda w, h: jnp.tanh(h @ w)
    >>> ws = [jnp.eye(3) * 0.5, jnp.eye(3) * 2.0]
    >>> loss = lambda ws, h: layerwise.remat_layers(
    ...     layer, ws, h, scan_layers=False).sum()
    >>> [g.shape for g in jax.grad(loss)(ws, jnp.ones((2, 3)))]
    [(3, 3), (3, 3)]
  """
  if scan_layers or not _splits_over_a_mesh(layers):
    return _checkpointed(layer, layers, hidden, scan_layers)

  @jax.custom_vjp
  def run(layers, hidden):
    return backward.forward(layer, hidden, layers, scan_layers=False)[0]

  def run_forward(layers, hidden):
    output, layer_inputs = backward.forward(layer, hidden, layers,
                                            scan_layers=False)
    return output, (layers, layer_inputs)

  def run_backward(saved, d_output):
    layers, layer_inputs = saved
    return _unrolled_backward(backward.vjp_backward(layer), layers,
                              layer_inputs, d_output)

  run.defvjp(run_forward, run_backward)
  return run(layers, hidden)
