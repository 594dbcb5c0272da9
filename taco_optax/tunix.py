"""tunix support: the layer-wise TACO step inside tunix's ``PeftTrainer``.

Needs tunix: ``pip install "taco_optax[tunix]"``.

:class:`LayerwisePeftTrainer` is built exactly like tunix's
``PeftTrainer(model, optimizer, training_config)`` with
``optimizer=taco_optax.taco(...)``; its train step is
:func:`taco_optax.layerwise.train_step` on the model's own modules, so no
whole dense gradient exists (peak memory near inference). tunix's loop,
hooks, metrics, evaluation and checkpoints are tunix's own: the optimizer
state keeps the layout of ``PeftTrainer``'s, so checkpoints of either resume
in the other.
"""

import dataclasses
import functools
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from taco_optax._src import transform
from taco_optax._src import layerwise
from taco_optax._src.integrations import tunix_model

try:
  from flax import nnx
  from tunix.sft import peft_trainer
except ImportError as error:  # pragma: no cover - depends on the install
  raise ImportError(
      'taco_optax.tunix needs tunix; install it with '
      '`pip install "taco_optax[tunix]"`.') from error

__all__ = ('LayerwisePeftTrainer',)

_logger = logging.getLogger('taco_optax')


def pair_parts(parts: transform.TacoParts, params: Any,
               relayout: Any) -> transform.TacoParts:
  """``parts`` of an optimizer built for ``params``, for its relayout.

  The dimension numbers and update scales are read per leaf of ``params``
  (what ``nnx.Optimizer`` hands to the optimizer) and moved with the leaves.
  """
  dims = transform.leaf_dimension_numbers(parts.dimension_numbers, params)
  scales = transform.leaf_scales(parts.update_scale, params)
  pair_dims = relayout.target.unflatten([dims[i] for i in relayout.order])
  pair_scales = relayout.target.unflatten(
      [scales[i] for i in relayout.order])
  return parts._replace(dimension_numbers=lambda _: pair_dims,
                        update_scale=pair_scales)


class LayerwisePeftTrainer(peft_trainer.PeftTrainer):
  """tunix's ``PeftTrainer`` whose train step is TACO's layer-wise step.

  Construct it as ``PeftTrainer``: ``LayerwisePeftTrainer(model,
  taco_optax.taco(lr, weight_dimension_numbers=...), training_config)``.
  Each layer's weight gradient is consumed by its column step as the
  backward pass makes it, the token tables never get a dense gradient, and
  the result equals ``PeftTrainer`` with the same optimizer up to the
  floating-point order of the recomputed gradients (tested in float32; with
  16-bit parameters the stochastic rounding draws its bits per leaf of the
  re-laid tree, so they differ from ``PeftTrainer``'s: both are unbiased). The model is a
  tunix decoder (``embedder``, a list of ``layers``, ``final_norm``, tied or
  ``lm_head``: ``Qwen3``, ``Llama3``, ``Gemma3``...) trained with tunix's
  default loss on full parameters.

  ``gradient_accumulation_steps=A`` is fused into the step: the trainer
  groups each ``A`` consecutive batches of ``train_ds`` (an incomplete last
  group is dropped, as ``optax.MultiSteps`` would never apply it) and runs
  the layer-wise step with ``accumulation_steps=A`` on the group, layer by
  layer, with no gradient-sized buffer; the result is ``PeftTrainer``'s
  (``optax.MultiSteps``) on the same batches. tunix then counts one
  iteration per optimizer step (``trainer.config`` has
  ``gradient_accumulation_steps=None``), and the optimizer state has no
  ``MultiSteps`` wrapper: a checkpoint of ``PeftTrainer`` with accumulation
  does not resume here, nor the other way round.

  Where the layer-wise step does not apply, the trainer logs one warning
  naming the reason and runs ``PeftTrainer``'s own step, which is correct but
  keeps the dense gradients: LoRA, a loss set with ``with_loss_fn``, or a
  model of another shape (with accumulation, a loss set later is refused:
  the ``MultiSteps`` fallback would have to be built with the trainer).

  The ``grad_norm`` metric is ``NaN`` on the layer-wise step: no whole
  gradient exists to take the norm of. The train step donates the model's
  parameters as well as the optimizer state (``PeftTrainer`` donates the
  state only), so the weights are updated in place: arrays read from the
  model before a step are invalid after it.

  Raises:
    ValueError: if ``optimizer`` is not the transformation
      :func:`taco_optax.taco` returns (use ``PeftTrainer`` for others).
  """

  def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation,
               training_config: peft_trainer.TrainingConfig, *args, **kwargs):
    try:
      self._taco_parts = transform.parts_of(optimizer,
                                            user='LayerwisePeftTrainer')
    except ValueError as error:
      raise ValueError(f'{error} Or use tunix\'s PeftTrainer for other '
                       'optimizers.') from None
    steps = training_config.gradient_accumulation_steps
    self._fused_steps = None
    if steps not in (None, 1) and _fusable(model):
      self._fused_steps = steps
      training_config = dataclasses.replace(training_config,
                                            gradient_accumulation_steps=None)
    super().__init__(model, optimizer, training_config, *args, **kwargs)

  donated_arguments = ('model', 'optimizer')

  @property
  def fused_accumulation_steps(self) -> Optional[int]:
    """``A`` when gradient accumulation runs inside the layer-wise step."""
    return self._fused_steps

  def fallback_reason(self) -> Optional[str]:
    """Why this trainer runs ``PeftTrainer``'s step, or ``None``."""
    if self._lora_enabled:
      return 'the model has LoRA parameters'
    if self.loss_fn is not peft_trainer._default_loss_fn:  # pylint: disable=protected-access
      return 'a custom loss was set with with_loss_fn'
    return tunix_model.unsupported(self.model)

  def create_train_step_fn(self):
    reason = self.fallback_reason()
    if reason is not None and self._fused_steps:
      raise ValueError(
          f'LayerwisePeftTrainer: {reason}, which needs PeftTrainer\'s step, '
          f'but gradient_accumulation_steps={self._fused_steps} was fused '
          'into the layer-wise step when the trainer was built; use '
          'PeftTrainer for this loss.')
    if reason is not None:
      _logger.warning(
          'LayerwisePeftTrainer: %s; running PeftTrainer\'s train step '
          '(correct, with dense gradients).', reason)
      return super().create_train_step_fn()
    return self._layerwise_train_step

  def jit_train_and_eval_step(self, skip_jit: bool = False,
                              cache_nnx_graph: bool = False):
    """As ``PeftTrainer``'s, with the model donated on the layer-wise step."""
    if (skip_jit or self._jitted_train_step_fn is not None
        or self.fallback_reason() is not None):
      return super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
    self._shard_optimizer(_physical_mesh())
    bind = nnx.cached_partial if cache_nnx_graph else functools.partial
    train = nnx.jit(self.create_train_step_fn(),
                    donate_argnames=self.donated_arguments)
    evaluate = nnx.jit(self.create_eval_step_fn())
    # functools.partial outside, as tunix reads ``.func.jitted_fn``.
    self._jitted_train_step_fn = functools.partial(
        bind(train, self.model, self.optimizer))
    self._jitted_eval_step_fn = functools.partial(bind(evaluate, self.model))
    return self._jitted_train_step_fn, self._jitted_eval_step_fn

  def train(self, train_ds, eval_ds=None, skip_jit=False, **kwargs):
    """tunix's loop; with fused accumulation, over groups of batches."""
    if self._fused_steps:
      if self.data_hooks is not None:
        raise ValueError('LayerwisePeftTrainer: data hooks with fused '
                         'gradient accumulation are not supported; pass the '
                         'batches as train_ds.')
      train_ds = _Grouped(train_ds, self._fused_steps)
    return super().train(train_ds, eval_ds, skip_jit, **kwargs)

  def _model_inputs(self, inputs):
    if not self._fused_steps:
      return self.gen_model_input_fn(inputs)
    # A group stacked on axis 1 (tunix shards axis 0, the batch, on a mesh).
    micro = [self.gen_model_input_fn(jax.tree.map(lambda x, i=i: x[:, i],
                                                  inputs))
             for i in range(self._fused_steps)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *micro)

  def _layerwise_train_step(self, model, optimizer, inputs):
    inputs = self._model_inputs(inputs)
    if inputs.get('images') is not None:
      raise ValueError('LayerwisePeftTrainer: image inputs are not supported '
                       'by the layer-wise step; use PeftTrainer.')
    layered = tunix_model.layered(model)
    relayout = layered.relayout
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    step = layerwise.step_from_parts(
        layered.loss, pair_parts(self._taco_parts, params, relayout),
        accumulation_steps=self._fused_steps)
    new_params, new_state, loss = step(
        relayout.forward(params),
        relayout.forward_state(nnx.as_pure(optimizer.opt_state)), inputs)
    nnx.update(model, relayout.backward(new_params))
    nnx.update(optimizer.opt_state,
               nnx.state(relayout.backward_state(new_state)))
    optimizer.step[...] += 1
    return loss, None, jnp.full((), jnp.nan, jnp.float32)


def _physical_mesh():
  """The mesh tunix trains under (``with mesh:``), as its trainer reads it."""
  from jax.interpreters import pxla  # pylint: disable=import-outside-toplevel
  return pxla.thread_resources.env.physical_mesh


def _fusable(model) -> bool:
  from tunix.sft import utils  # pylint: disable=import-outside-toplevel
  return (not utils.is_lora_enabled(model)
          and tunix_model.unsupported(model) is None)


class _Grouped:
  """``A`` consecutive batches of ``batches`` stacked on a new axis 1."""

  def __init__(self, batches, steps: int):
    self._batches, self._steps = batches, steps

  def __iter__(self):
    group = []
    for batch in self._batches:
      group.append(batch)
      if len(group) == self._steps:
        yield jax.tree.map(lambda *xs: np.stack(xs, axis=1), *group)
        group = []
