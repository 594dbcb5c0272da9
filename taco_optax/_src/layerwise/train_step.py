"""A TACO train step that consumes each layer's gradient as backprop makes it.

``jax.jit(grad -> tx.update -> apply_updates)`` keeps every dense matrix
gradient alive until the optimizer runs (always so when layers are stacked in a
``lax.scan``), and ``scale_by_taco`` returns a dense, mostly-zero update per
matrix. Here the backward pass is written by hand, one layer at a time: each
layer's weight gradient goes through the same history step as the optax path
and the ``<= r`` winners of every column are written into the weight by a
scatter (``weight_update``), so only one layer's gradients are alive at once
and no dense update exists. The result equals the plain optax path with
:func:`taco` (tested).

One batch reads forward -> head -> layers -> embedding -> Adam and pack: the
parameters outside the layers are updated in ``outer`` (after the head, and
after the embedding's backward pass), the layers in ``backward``, and
``finish`` checks every leaf's result and packs the state. Micro-batches run
the same pieces layer-major (``accumulated_step``).
"""

import functools
import typing
from typing import Any, Callable, Literal, Optional, Union

import jax
import optax

from taco_optax._src import transform
from taco_optax._src.layerwise import accumulated_step
from taco_optax._src.layerwise import backward
from taco_optax._src.layerwise import clipping
from taco_optax._src.layerwise import finish
from taco_optax._src.layerwise import layered_loss
from taco_optax._src.layerwise import leaves as leaves_lib
from taco_optax._src.layerwise import ordering
from taco_optax._src.layerwise import outer as outer_lib
from taco_optax._src.layerwise import relayout
from taco_optax._src.layerwise import winners
from taco_optax._src.layerwise.layered_loss import LayeredLoss

Params = Any
Batch = Any
# step(params, opt_state, batch) -> (params, opt_state, loss)
TrainStep = Callable[[tuple[Params, Params], Any, Batch],
                     tuple[tuple[Params, Params], Any, jax.Array]]
# The same, with_grad_norm=True: (params, opt_state, loss, grad_norm).
TrainStepWithNorm = Callable[
    [tuple[Params, Params], Any, Batch],
    tuple[tuple[Params, Params], Any, jax.Array, jax.Array]]


def train_step(loss: LayeredLoss,
               optimizer: optax.GradientTransformation, *,
               accumulation_steps: Optional[int] = None,
               clip_global_norm: Optional[float] = None,
               column_block_elements: int = (
                   winners.DEFAULT_COLUMN_BLOCK_ELEMENTS),
               with_grad_norm: bool = False) -> TrainStep:
  r"""A memory-lean train step for :func:`taco`: gradients die as they appear.

  The step runs the forward pass saving only each layer's input, then a
  hand-written backward pass over the layers in reverse (a ``lax.scan`` for
  stacked layers, a Python loop for unrolled ones). For each layer it takes
  ``jax.vjp`` of that layer alone (so layers are rematerialised, as with
  ``jax.checkpoint``), hands the dense weight gradient of every TACO matrix to
  the same per-column step as :func:`scale_by_taco`, and writes the ``r``
  winners of each column into the weight,

  .. math::
    W_{j, i^*_j} \leftarrow
    W_{j, i^*_j} - \eta\, s\, \mathrm{sign}(M_{t, j})_{i^*_j},

  inside the loop carry, so with donated ``params`` the weights are updated in
  place and the gradient of layer ``l`` is dead before layer ``l - 1`` starts.
  The parameters outside the layers (``outer``) and every non-TACO leaf (which
  are small) are updated at the end exactly as :func:`taco` does (AdamW).
  Peak memory is about the weights, the state, the saved layer inputs and one
  layer's (plus the outer parameters') gradients. A token table given through
  a :class:`TableLookup` embedding and a :class:`TableProjection` head never
  has a dense gradient: it is formed a block of columns at a time, and a tied
  table is selected in two phases (rows outside the batch's tokens at the
  head, the batch's rows after the layers), so nothing vocabulary-sized
  outlives the head.

  The new params and state equal the plain path ``jax.grad`` ->
  ``optimizer.update`` -> ``optax.apply_updates`` (bit for bit up to the
  floating-point order of the recomputed gradients), and ``optimizer.init``
  makes the state both take. One difference: when a gradient is not finite,
  the optax path sets the whole stacked leaf to NaN, this step only the
  offending layer slices (history is kept in both); neither is a step worth
  keeping.

  Stacked layers need ``weight_dimension_numbers`` that keep the leading layer
  axis a batch axis (e.g. ``TacoDimensionNumbers(1, 2)`` for ``(L, in, out)``
  kernels): by default :func:`taco` only treats rank-2 leaves as matrices.

  Args:
    loss: the model's loss as a :class:`LayeredLoss`.
    optimizer: the transformation :func:`taco` returned for the params pair
      ``(outer, layers)`` (its ``weight_dimension_numbers`` is a tree prefix
      of, or a callable of, that pair), not wrapped in another
      transformation: the step applies its pieces itself.
    accumulation_steps: ``None`` (default): ``batch`` is one batch. An int
      ``A >= 1``: every leaf of ``batch`` has a leading micro-batch axis of
      size ``A``, and the step is the step on the mean gradient of the ``A``
      micro-batches, the same as ``optax.MultiSteps(optimizer, A)`` fed them
      one at a time (bit for bit, except a leaf read by both the embedding
      and the head: there the mean is summed in another order), with no
      gradient-sized buffer: the pieces run layer-major, each layer's
      backward over the ``A`` micro-batches, folding its gradient into one
      float32 running mean before its column step. Peak memory is one
      micro-batch's plus the saved layer inputs of all ``A`` and a float32
      gradient of each outer leaf; a token table's is one more table, or,
      when smaller, every micro-batch's factors of it (a classification head
      scores one position per sequence). The returned loss is the
      micro-batches' mean.
    clip_global_norm: ``None`` (default), or ``c > 0``: the step of
      ``optax.chain(optax.clip_by_global_norm(c), optimizer)`` (the whole
      gradient scaled by ``c / ||G||`` when ``||G|| >= c``). The norm needs
      every gradient before the first column step, so a first backward pass
      computes it (keeping one layer's gradient at a time): the step costs
      one more forward and backward pass, and a tied token table takes the
      one-pass update (its head factors live through the layers). With
      ``accumulation_steps``, the norm is the mean gradient's, as
      ``MultiSteps(chain(clip_by_global_norm(c), optimizer), A)`` clips.
    column_block_elements: a matrix whose column step would hold more than
      twice this many float32 elements (a token table, a large head) is
      updated a block of about this many elements of columns at a time
      (the column step's transients are gradient-sized; the result is the
      same). Smaller blocks lower the peak and cost a longer loop.
    with_grad_norm: also return the global norm of the gradient (with
      ``accumulation_steps``, of the mean gradient), ``optax.global_norm`` of
      the float32 gradient to float order: each leaf's ``sum(g**2)`` is
      taken where its gradient exists (a layer's in its backward, a token
      table's a block of columns at a time), so no pass is added; with
      ``clip_global_norm``, the clipping pass's norm (before clipping).

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss)``, to be
    wrapped in ``jax.jit(step, donate_argnums=(0, 1))``; with
    ``with_grad_norm``, ``(params, opt_state, loss, grad_norm)``.

  Raises:
    ValueError: if ``optimizer`` is not a :func:`taco` transformation (the
      message names what wraps it and what to pass instead), or
      ``accumulation_steps`` is not an int >= 1 (or the batch's leading axis
      is not of that size), or ``column_block_elements`` not an int >= 1.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import taco_optax
    >>> from taco_optax import layerwise
    >>> loss = layerwise.LayeredLoss(
    ...     embed=lambda outer, x: x @ outer['w_in'],
    ...     layer=lambda p, h, x: jnp.tanh(h @ p['w']) + p['b'],
    ...     head=lambda outer, h, x: jnp.mean((h @ outer['w_out']) ** 2))
    >>> outer = {'w_in': jnp.ones((3, 8)), 'w_out': jnp.ones((8, 2))}
    >>> layers = {'w': jnp.ones((4, 8, 8)) / 8, 'b': jnp.zeros((4, 8))}
    >>> matrix = taco_optax.TacoDimensionNumbers()
    >>> dims = ({'w_in': matrix, 'w_out': matrix},
    ...         {'w': taco_optax.TacoDimensionNumbers(1, 2), 'b': None})
    >>> tx = taco_optax.taco(1e-3, weight_dimension_numbers=dims)
    >>> step = jax.jit(layerwise.train_step(loss, tx), donate_argnums=(0, 1))
    >>> params = (outer, layers)
    >>> opt_state = tx.init(params)
    >>> params, opt_state, value = step(params, opt_state, jnp.ones((5, 3)))
    >>> params[1]['w'].shape
    (4, 8, 8)

  References:
    TACO: Ternary Absolute-max Column-wise One-sparse Optimizer for LLM
    Fine-Tuning, 2026 (Section 5, immediate gradient processing).
  """
  parts = transform.parts_of(optimizer)
  options: dict[str, Any] = dict(
      accumulation_steps=accumulation_steps,
      clip_global_norm=clip_global_norm,
      column_block_elements=column_block_elements,
      with_grad_norm=with_grad_norm)
  if isinstance(loss, LayeredLoss):
    return step_from_parts(loss, parts, **options)
  if not callable(loss):
    raise TypeError('train_step takes the loss as a function loss_fn(params, '
                    'batch) -> scalar, or a LayeredLoss; got '
                    f'{type(loss).__name__}.')
  _check_options(**options)
  return relayout.traced_step(
      loss, parts, lambda layered, pair: step_from_parts(layered, pair,
                                                         **options),
      accumulation_steps)


def _is_int_at_least(value: Any, minimum: int) -> bool:
  return (isinstance(value, int) and not isinstance(value, bool)
          and value >= minimum)


@typing.overload
def step_from_parts(loss: LayeredLoss, parts: transform.TacoParts, *,
                    accumulation_steps: Optional[int] = ...,
                    clip_global_norm: Optional[float] = ...,
                    column_block_elements: int = ...,
                    with_grad_norm: Literal[False] = ...) -> TrainStep:
  ...


@typing.overload
def step_from_parts(loss: LayeredLoss, parts: transform.TacoParts, *,
                    accumulation_steps: Optional[int] = ...,
                    clip_global_norm: Optional[float] = ...,
                    column_block_elements: int = ...,
                    with_grad_norm: Literal[True]) -> TrainStepWithNorm:
  ...


def step_from_parts(loss: LayeredLoss, parts: transform.TacoParts, *,
                    accumulation_steps: Optional[int] = None,
                    clip_global_norm: Optional[float] = None,
                    column_block_elements: int = (
                        winners.DEFAULT_COLUMN_BLOCK_ELEMENTS),
                    with_grad_norm: bool = False
                    ) -> Union[TrainStep, TrainStepWithNorm]:
  """:func:`train_step` from a :func:`taco` optimizer's :class:`TacoParts`.

  For callers that lay the same parameters out differently from the tree the
  optimizer was built for (``taco_optax.tunix`` re-lays a model's state as
  ``(outer, layers)``): ``parts.dimension_numbers`` and ``parts.update_scale``
  must then describe the ``(outer, layers)`` pair. The other arguments are
  :func:`train_step`'s.
  """
  _check_options(accumulation_steps, clip_global_norm, column_block_elements,
                 with_grad_norm)
  one_batch = _one_batch_step(loss, parts, clip_global_norm,
                              column_block_elements, with_grad_norm)
  if accumulation_steps is None:
    return _checking_params(one_batch, loss)
  return _checking_params(accumulated_step.accumulated_step(
      loss, parts, accumulation_steps, clip_global_norm,
      column_block_elements, one_batch, with_grad_norm), loss)


def _check_options(accumulation_steps: Optional[int],
                   clip_global_norm: Optional[float],
                   column_block_elements: int, with_grad_norm: bool) -> None:
  """Raises, naming the argument, for options the step cannot take."""
  if clip_global_norm is not None:
    if isinstance(clip_global_norm, bool) or not clip_global_norm > 0:
      raise ValueError('clip_global_norm must be a number > 0; got '
                       f'{clip_global_norm!r}.')
  if not _is_int_at_least(column_block_elements, 1):
    raise ValueError('column_block_elements must be an int >= 1; got '
                     f'{column_block_elements!r}.')
  if not isinstance(with_grad_norm, bool):
    raise ValueError(f'with_grad_norm must be a bool; got {with_grad_norm!r}.')
  if accumulation_steps is not None and not _is_int_at_least(
      accumulation_steps, 1):
    raise ValueError('accumulation_steps must be an int >= 1 (or None for a '
                     f'batch without a micro-batch axis); got '
                     f'{accumulation_steps!r}.')


def _checking_params(step: TrainStep, loss: LayeredLoss) -> TrainStep:
  """``step`` that first refuses params it cannot take, by name."""

  @functools.wraps(step)
  def checked(params, opt_state, batch):
    layered_loss.check_params(params, loss.scan_layers)
    return step(params, opt_state, batch)

  return checked


def _layers_backward(loss: LayeredLoss, step: leaves_lib.StepLeaves,
                     layers: Any, layer_inputs: Any, d_hidden: Any,
                     batch: Batch):
  """The backward pass over the layers, each TACO weight updated in it."""
  run_layer = lambda p, h: loss.layer(p, h, batch)
  backward_pass = backward.scanned if loss.scan_layers else backward.unrolled
  return backward_pass(backward.vjp_backward(run_layer), layers, step,
                       layer_inputs, d_hidden)


def _one_batch_step(loss: LayeredLoss, parts: transform.TacoParts,
                    clip_global_norm: Optional[float],
                    column_block_elements: int,
                    with_grad_norm: bool = False) -> TrainStep:
  """The step on one batch (no micro-batch axis)."""

  def step_fn(params, opt_state, batch):
    outer, layers = params
    hidden = loss.embed(outer, batch)
    clip = norm = None
    if clip_global_norm is not None:
      norm = clipping.global_norm(
          params, clipping.squared_norms(loss, params, batch))
      clip = clipping.clipper(norm, clip_global_norm)
      # The step's forward after the norm's pass: one pass alive at a time.
      hidden = ordering.ordered_after(hidden, norm)
    step = leaves_lib.step_leaves(parts, params, opt_state, clip,
                                  column_block_elements,
                                  measure=with_grad_norm, norm=norm)
    # Forward, keeping each layer's input (the only saved activations).
    hidden, layer_inputs = backward.forward(
        lambda p, h: loss.layer(p, h, batch), hidden, layers,
        loss.scan_layers)
    head = outer_lib.after_head(loss, step, outer, batch, hidden,
                                two_phase_allowed=clip is None)
    d_hidden, layer_updates, layer_grads = _layers_backward(
        loss, step, layers, layer_inputs, head.d_hidden, batch)
    outer_updates, outer_grads = outer_lib.after_embedding(
        loss, step, outer, batch, head, d_hidden)
    return finish.finish(step, params, opt_state,
                         leaves_lib.merged(outer_updates, layer_updates),
                         leaves_lib.merged(outer_grads, layer_grads),
                         head.value)

  return step_fn
