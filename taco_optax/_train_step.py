"""A TACO train step that consumes each layer's gradient as backprop makes it.

``jax.jit(grad -> tx.update -> apply_updates)`` keeps every dense matrix
gradient alive until the optimizer runs (always so when layers are stacked in a
``lax.scan``), and ``scale_by_taco`` returns a dense, mostly-zero update per
matrix. Here the backward pass is written by hand, one layer at a time: each
layer's weight gradient goes through the same history step as the optax path
and the ``<= r`` winners of every column are written into the weight by a
scatter (``_leaf_update``), so only one layer's gradients are alive at once and
no dense update exists. The result equals the plain optax path with
:func:`taco` (tested).

The parameters outside the layers are updated in ``_outer_step`` (after the
head, and after the embedding's backward pass).
"""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from taco_optax import _accumulation
from taco_optax import _alias
from taco_optax import _backward
from taco_optax import _clipping
from taco_optax import _leaf_update
from taco_optax import _outer_step
from taco_optax import _step_context
from taco_optax._layered_loss import LayeredLoss

Params = Any
Batch = Any
# step(params, opt_state, batch) -> (params, opt_state, loss)
TrainStep = Callable[[tuple[Params, Params], Any, Batch],
                     tuple[tuple[Params, Params], Any, jax.Array]]


def train_step(loss: LayeredLoss,
               optimizer: optax.GradientTransformation, *,
               accumulation_steps: Optional[int] = None,
               clip_global_norm: Optional[float] = None) -> TrainStep:
  r"""A memory-lean train step for :func:`taco`: gradients die as they appear.

  The step runs the forward pass saving only each layer's input, then a
  hand-written backward pass over the layers in reverse (a ``lax.scan`` for
  stacked layers, a Python loop for unrolled ones). For each layer it takes
  ``jax.vjp`` of that layer alone (so layers are rematerialised, as with
  ``jax.checkpoint``), hands the dense weight gradient of every TACO matrix to
  the same per-column step as :func:`scale_by_taco`, and writes the ``r``
  winners of each column into the weight,

  .. math::
    W_{j, i^*_j} \leftarrow W_{j, i^*_j} - \eta\, s\, \mathrm{sign}(M_{t, j})_{i^*_j},

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
      micro-batch's plus the saved layer inputs of all ``A`` (and a float32
      gradient of each outer leaf, e.g. the token table). The returned loss is
      the micro-batches' mean.
    clip_global_norm: ``None`` (default), or ``c > 0``: the step of
      ``optax.chain(optax.clip_by_global_norm(c), optimizer)`` (the whole
      gradient scaled by ``c / ||G||`` when ``||G|| >= c``). The norm needs
      every gradient before the first column step, so a first backward pass
      computes it (keeping one layer's gradient at a time): the step costs
      one more forward and backward pass, and a tied token table takes the
      one-pass update (its head factors live through the layers). With
      ``accumulation_steps``, the norm is the mean gradient's, as
      ``MultiSteps(chain(clip_by_global_norm(c), optimizer), A)`` clips.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss)``, to be
    wrapped in ``jax.jit(step, donate_argnums=(0, 1))``.

  Raises:
    ValueError: if ``optimizer`` is not a :func:`taco` transformation, or
      ``accumulation_steps`` is not an int >= 1 (or the batch's leading axis
      is not of that size).

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
  try:
    parts = _alias.parts_of(optimizer)
  except ValueError as error:
    raise ValueError(f'{error} {_NO_CLIPPING}') from None
  return step_from_parts(loss, parts, accumulation_steps=accumulation_steps,
                         clip_global_norm=clip_global_norm)


# Why a chain such as optax.chain(optax.clip_by_global_norm(c), taco(...))
# is refused (docs/layerwise.md, "Clipping").
_NO_CLIPPING = (
    'A chain is opaque to the layer-wise step; for '
    'optax.chain(optax.clip_by_global_norm(c), taco(...)) pass taco(...) and '
    'clip_global_norm=c. TACO\'s own step moves each column by exactly '
    'lr * s (bounded by construction).')


def step_from_parts(loss: LayeredLoss, parts: _alias.TacoParts, *,
                    accumulation_steps: Optional[int] = None,
                    clip_global_norm: Optional[float] = None) -> TrainStep:
  """:func:`train_step` from a :func:`taco` optimizer's :class:`TacoParts`.

  For callers that lay the same parameters out differently from the tree the
  optimizer was built for (``taco_optax.tunix`` re-lays a model's state as
  ``(outer, layers)``): ``parts.dimension_numbers`` and ``parts.update_scale``
  must then describe the ``(outer, layers)`` pair. ``accumulation_steps`` and
  ``clip_global_norm`` are :func:`train_step`'s.
  """
  if clip_global_norm is not None:
    if isinstance(clip_global_norm, bool) or not clip_global_norm > 0:
      raise ValueError('clip_global_norm must be a number > 0; got '
                       f'{clip_global_norm!r}.')
  if accumulation_steps is None:
    return _one_batch_step(loss, parts, clip_global_norm)
  if (isinstance(accumulation_steps, bool)
      or not isinstance(accumulation_steps, int) or accumulation_steps < 1):
    raise ValueError('accumulation_steps must be an int >= 1 (or None for a '
                     f'batch without a micro-batch axis); got '
                     f'{accumulation_steps!r}.')
  return _accumulated_step(loss, parts, accumulation_steps, clip_global_norm)


def _layers_backward(loss, layer_backward, layers, ctx: _step_context.Leaves,
                     layer_inputs, d_hidden):
  """The backward pass over the layers, each TACO weight updated in it."""
  backward = _backward.scanned if loss.scan_layers else _backward.unrolled
  n = ctx.num_outer
  return backward(layer_backward, layers, ctx.plans[n:], layer_inputs,
                  d_hidden, ctx.leaf_states[n:],
                  lambda i, *args, **kwargs: ctx.update(n + i, *args,
                                                        **kwargs))


def _one_batch_step(loss: LayeredLoss, parts: _alias.TacoParts,
                    clip_global_norm: Optional[float] = None) -> TrainStep:
  """The step on one batch (no micro-batch axis)."""

  def step(params, opt_state, batch):
    outer, layers = params
    hidden = loss.embed(outer, batch)
    clip = None
    if clip_global_norm is not None:
      norm = _clipping.global_norm(
          _clipping.squared_norms(loss, params, batch))
      clip = _clipping.clipper(norm, clip_global_norm)
      # The step's forward after the norm's pass: one pass alive at a time.
      hidden = jax.tree.map(
          lambda x: _leaf_update.data_dependency(x, norm), hidden)
    ctx = _step_context.leaves(parts, params, opt_state, clip)
    n = ctx.num_outer
    context = _outer_step.Outer(loss, outer, batch, ctx.plans[:n],
                                ctx.leaf_states[:n], ctx.update, parts,
                                ctx.states, ctx.rounding,
                                two_phase_allowed=clip is None)
    run_layer = lambda p, h: loss.layer(p, h, batch)

    # Forward, keeping each layer's input (the only saved activations).
    hidden, layer_inputs = _backward.forward(run_layer, hidden, layers,
                                             loss.scan_layers)
    head = _outer_step.after_head(context, hidden)
    d_hidden, layer_leaves, layer_states, layer_grads = _layers_backward(
        loss, _backward.vjp_backward(run_layer), layers, ctx, layer_inputs,
        head.d_hidden)
    outer_leaves, outer_states, outer_grads = _outer_step.after_embedding(
        context, head, d_hidden)
    return _step_context.finish(
        parts, params, opt_state, ctx, clip, outer_leaves + layer_leaves,
        outer_grads + layer_grads, outer_states + layer_states, head.value)

  return step


def _accumulated_step(loss: LayeredLoss, parts: _alias.TacoParts,
                      steps: int,
                      clip_global_norm: Optional[float] = None) -> TrainStep:
  """The step on ``steps`` micro-batches, layer-major (``_accumulation``).

  The outer leaves take the roles of :func:`_outer_step.outer_roles` (no
  two-phase table: the head's share of a tied table is accumulated whole):
  the early ones are updated once the head's mean gradient is complete, the
  late ones after the embedding's pass.
  """
  one_batch = _one_batch_step(loss, parts, clip_global_norm)

  def step(params, opt_state, batches):
    _accumulation.check_micro_batches(batches, steps)
    if steps == 1:  # the one-batch step, and its memory
      return one_batch(params, opt_state,
                       jax.tree.map(lambda x: x[0], batches))
    outer, layers = params
    outer_leaves = jax.tree.leaves(outer)
    n = len(outer_leaves)
    first = jax.tree.map(lambda x: x[0], batches)
    embed_reads = _outer_step._used_inputs(lambda o: loss.embed(o, first),
                                           outer)
    # Forward over the micro-batches, keeping each one's layer inputs.
    hidden, layer_inputs = _backward.forward(
        _accumulation.layer_forward(loss.layer, batches),
        _accumulation.embed_forward(loss.embed, outer, batches), layers,
        loss.scan_layers)
    head_reads = _outer_step._used_inputs(
        lambda o: loss.head(o, jax.tree.map(lambda x: x[0], hidden), first),
        outer)
    value, head_grads, d_hidden = _accumulation.head_backward(
        loss.head, outer, hidden, batches, head_reads)
    clip = None
    if clip_global_norm is not None:
      norm = _clipping.accumulated_norm(
          loss, outer, layers, layer_inputs, d_hidden, batches, embed_reads,
          head_grads)
      clip = _clipping.clipper(norm, clip_global_norm)
      d_hidden = jax.tree.map(
          lambda x: _leaf_update.data_dependency(x, norm), d_hidden)
    ctx = _step_context.leaves(parts, params, opt_state, clip)
    roles = _outer_step.outer_roles(loss, outer, ctx.plans[:n], {},
                                    ctx.leaf_states[:n], first,
                                    two_phase_allowed=False)

    def early_grad(i):  # its mean dies with the update
      grad, head_grads[i] = head_grads[i], None
      return _mean_as(grad, outer_leaves[i])

    updated, d_hidden = _outer_step.update_early(
        ctx.update, outer_leaves, ctx.leaf_states, ctx.plans, roles.early,
        early_grad, d_hidden)
    d_hidden, layer_leaves, layer_states, layer_grads = _layers_backward(
        loss, _accumulation.layer_backward(loss.layer, batches), layers, ctx,
        layer_inputs, d_hidden)
    grads = [_mean_as(g, x) for g, x in zip(
        _accumulation.embed_backward(loss.embed, outer, d_hidden, batches,
                                     embed_reads, head_grads), outer_leaves)]
    for i in roles.late:
      updated[i] = ctx.update(i, outer_leaves[i], grads[i],
                              ctx.leaf_states[i], ctx.plans[i])
    new_outer = [updated[i][0] if i in updated else x
                 for i, x in enumerate(outer_leaves)]
    outer_states = [tuple(updated[i][1:]) if i in updated else s
                    for i, s in enumerate(ctx.leaf_states[:n])]
    outer_grads = [None if plan is not None else g
                   for g, plan in zip(grads, ctx.plans[:n])]
    return _step_context.finish(
        parts, params, opt_state, ctx, clip, new_outer + layer_leaves,
        outer_grads + layer_grads, outer_states + layer_states, value)

  return step


def _mean_as(grad, like):
  """An accumulated mean (``None``: the leaf is read by nothing) in the
  leaf's dtype."""
  return jnp.zeros_like(like) if grad is None else grad.astype(like.dtype)
