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
import inspect
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from taco_optax._src import layerwise
from taco_optax._src import transform
from taco_optax._src.integrations import tunix_api
from taco_optax._src.integrations import tunix_model

try:
  from flax import nnx
  from tunix.sft import peft_trainer
  from tunix.sft import utils
except ImportError as error:  # pragma: no cover - depends on the install
  raise ImportError(
      'taco_optax.tunix needs tunix; install it with '
      '`pip install "taco_optax[tunix]"`.') from error

__all__ = ('LayerwisePeftTrainer',)

_logger = logging.getLogger('taco_optax')


class LayerwisePeftTrainer(peft_trainer.PeftTrainer):
  """tunix's ``PeftTrainer`` whose train step is TACO's layer-wise step.

  Construct it as ``PeftTrainer``: ``LayerwisePeftTrainer(model,
  taco_optax.taco(lr, weight_dimension_numbers=...), training_config)``.
  Each layer's weight gradient is consumed by its column step as the
  backward pass makes it, the token tables never get a dense gradient, and
  the result equals ``PeftTrainer`` with the same optimizer up to the
  floating-point order of the recomputed gradients (tested in float32, and
  bit for bit in bfloat16 with stochastic rounding: each leaf's bits are
  keyed by its index in the model's parameter ``State``, as
  ``PeftTrainer``'s optimizer keys them).
  The model is a tunix decoder (``embedder``, a list of ``layers``,
  ``final_norm``, tied or ``lm_head``: ``Qwen3``, ``Llama3``, ``Gemma3``...)
  trained with tunix's default loss on full parameters. Supported: tunix
  0.1.7 and 0.1.8 (whose train steps differ; the trainer reads which one
  tunix has when it is built, see ``docs/tunix.md``).

  ``gradient_accumulation_steps=A`` is fused into the step: the trainer
  groups each ``A`` consecutive batches of ``train_ds`` (an incomplete last
  group is dropped, as tunix's accumulators never apply it) and runs the
  layer-wise step with ``accumulation_steps=A`` on the group, layer by layer,
  with no gradient-sized buffer. The micro-batches are weighted as this
  tunix's ``PeftTrainer`` weights its default loss's (``micro_batch_weights``
  says otherwise): on 0.1.7 the mean of their mean losses (``MultiSteps``),
  on 0.1.8 by their target tokens (``GradientAccumulator`` of the summed
  loss, ``Σ ∇S_a / Σ n_a``). tunix then counts one iteration per optimizer
  step (``trainer.config`` has ``gradient_accumulation_steps=None``), and the
  optimizer state has no ``MultiSteps`` wrapper: a 0.1.7 checkpoint of
  ``PeftTrainer`` with accumulation does not resume here, nor the other way
  round.

  Where the layer-wise step does not apply, the trainer logs one warning
  naming the reason and runs ``PeftTrainer``'s own step, which is correct but
  keeps the dense gradients: LoRA, a loss set with ``with_loss_fn``, sequence
  packing (``max_seq_token_per_tpu``), or a model of another shape (with
  accumulation, a loss set later is refused: the fallback's accumulator
  would have to be built with the trainer).

  The ``grad_norm`` metric is the global norm of the step's gradient (with
  accumulation, of the accumulated gradient), summed from each leaf's
  ``sum(g**2)`` as its gradient appears (no extra pass). The train step
  donates the model's parameters as well as the optimizer state
  (``PeftTrainer`` does not donate the model), so the weights are updated in
  place: arrays read from the model before a step are invalid after it.

  Args:
    model: the tunix model.
    optimizer: the transformation :func:`taco_optax.taco` returns.
    training_config: tunix's ``TrainingConfig``.
    *args: ``PeftTrainer``'s other arguments.
    micro_batch_weights: with fused accumulation, ``'tokens'`` (each
      micro-batch's summed loss over all the group's target tokens) or
      ``'equal'`` (the mean of the micro-batches' mean losses); ``None``
      (default): as this tunix's ``PeftTrainer``.
    **kwargs: ``PeftTrainer``'s other keyword arguments.

  Raises:
    ValueError: if ``optimizer`` is not the transformation
      :func:`taco_optax.taco` returns (use ``PeftTrainer`` for others), if
      the installed tunix's train step is of no form the trainer knows
      (naming the supported range), or ``micro_batch_weights`` is not one of
      the above.
  """

  def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation,
               training_config: peft_trainer.TrainingConfig, *args,
               micro_batch_weights: Optional[str] = None, **kwargs):
    try:
      self._taco_parts = transform.parts_of(optimizer,
                                            user='LayerwisePeftTrainer')
    except ValueError as error:
      raise ValueError(f'{error} Or use tunix\'s PeftTrainer for other '
                       'optimizers.') from None
    if micro_batch_weights not in (None, 'tokens', 'equal'):
      raise ValueError("micro_batch_weights must be 'tokens', 'equal' or "
                       f'None; got {micro_batch_weights!r}.')
    steps = training_config.gradient_accumulation_steps
    self._taco_fused_steps = None
    if (steps not in (None, 1) and _packing(training_config) is None
        and _fusable(model)):
      self._taco_fused_steps = steps
      training_config = dataclasses.replace(training_config,
                                            gradient_accumulation_steps=None)
    super().__init__(model, optimizer, training_config, *args, **kwargs)
    self._taco_tunix = tunix_api.check(super().create_train_step_fn(),
                                       tunix_api.installed_version())
    self._taco_default_loss = self.loss_fn
    self._taco_micro_batch_weights = micro_batch_weights or (
        'tokens' if self._taco_tunix.token_weighted else 'equal')
    self._taco_jitted: Optional[tuple[Any, Any]] = None

  @property
  def fused_accumulation_steps(self) -> Optional[int]:
    """``A`` when gradient accumulation runs inside the layer-wise step."""
    return self._taco_fused_steps

  @property
  def donated_arguments(self) -> tuple[str, ...]:
    """The layer-wise train step's donated arguments."""
    return ('model', 'optimizer') + (
        ('grad_accumulator',) if self._taco_tunix.accumulator else ())

  def fallback_reason(self) -> Optional[str]:
    """Why this trainer runs ``PeftTrainer``'s step, or ``None``."""
    if utils.is_lora_enabled(self.model):
      return 'the model has LoRA parameters'
    if self.loss_fn is not self._taco_default_loss:
      return 'a custom loss was set with with_loss_fn'
    if _packing(self.config) is not None:
      return ('sequence packing (max_seq_token_per_tpu) sets the update '
              'steps from the data')
    return tunix_model.unsupported(self.model)

  def create_train_step_fn(self):
    reason = self.fallback_reason()
    if reason is not None and self._taco_fused_steps:
      raise ValueError(
          f'LayerwisePeftTrainer: {reason}, which needs PeftTrainer\'s step, '
          f'but gradient_accumulation_steps={self._taco_fused_steps} was fused '
          'into the layer-wise step when the trainer was built; use '
          'PeftTrainer for this loss.')
    if reason is not None:
      _logger.warning(
          'LayerwisePeftTrainer: %s; running PeftTrainer\'s train step '
          '(correct, with dense gradients).', reason)
      return super().create_train_step_fn()
    if self._taco_tunix.accumulator:
      return self._taco_step_with_accumulator
    return self._taco_step

  def clear_jit_cache(self):
    super().clear_jit_cache()
    self._taco_jitted = None

  def jit_train_and_eval_step(self, skip_jit: bool = False,
                              cache_nnx_graph: bool = False):
    """As ``PeftTrainer``'s, with the model donated on the layer-wise step."""
    if skip_jit or self.fallback_reason() is not None:
      return super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
    if self._taco_jitted is None:
      # tunix's own: shards the optimizer state for the mesh, jits the eval
      # step (its train step, jitted without the model donated, is unused).
      _, evaluate = super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
      train = nnx.jit(self.create_train_step_fn(),
                      donate_argnames=self.donated_arguments)
      bound = (self.model, self.optimizer) + (
          (self.grad_accumulator,) if self._taco_tunix.accumulator else ())
      bind = nnx.cached_partial if cache_nnx_graph else functools.partial
      # functools.partial outside, as tunix reads ``.func.jitted_fn``.
      self._taco_jitted = (functools.partial(bind(train, *bound)),
                               evaluate)
    return self._taco_jitted

  def train(self, train_ds, eval_ds=None, skip_jit=False, **kwargs):
    """tunix's loop; with fused accumulation, over groups of batches."""
    if self._taco_fused_steps:
      if self.data_hooks is not None:
        raise ValueError('LayerwisePeftTrainer: data hooks with fused '
                         'gradient accumulation are not supported; pass the '
                         'batches as train_ds.')
      train_ds = _Grouped(train_ds, self._taco_fused_steps)
    return super().train(train_ds, eval_ds, skip_jit, **kwargs)

  def _taco_step(self, model, optimizer, inputs):
    """tunix 0.1.7's train step: ``(loss, aux, grad_norm)``."""
    loss, grad_norm, _ = self._taco_run(model, optimizer, inputs)
    return loss, None, grad_norm

  def _taco_step_with_accumulator(self, model, optimizer,
                                       grad_accumulator, inputs,
                                       is_update_step):
    """tunix 0.1.8's train step: ``(loss, LossOutput, grad_norm)``.

    Every step updates: the trainer's config has no accumulation for tunix
    to count (it is fused, or absent), so ``grad_accumulator`` holds nothing
    and ``is_update_step`` is always true.
    """
    del grad_accumulator, is_update_step
    loss, grad_norm, tokens = self._taco_run(model, optimizer, inputs)
    total = utils.WeightedMetric(loss * tokens, tokens, eps=1e-8)
    return loss, utils.LossOutput(primary_loss=total, aux_metrics={}), grad_norm

  def _taco_run(self, model, optimizer, inputs):
    """``(loss, grad_norm, target tokens)`` of one layer-wise step."""
    inputs = self._taco_model_inputs(inputs)
    layered = tunix_model.layered(model)
    relayout = layered.relayout
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    tokens = jnp.sum(inputs['input_mask'][..., 1:]).astype(jnp.float32)
    if self._taco_fused_steps and self._taco_micro_batch_weights == 'tokens':
      # A S_a / N per micro-batch: their mean gradient is sum_a dS_a / N.
      inputs = dict(inputs, **{tunix_model.DENOMINATOR: jnp.full(
          (self._taco_fused_steps,), tokens / self._taco_fused_steps)})
    step = layerwise.step_from_parts(
        layered.loss,
        layerwise.pair_parts(self._taco_parts, params, relayout),
        accumulation_steps=self._taco_fused_steps, with_grad_norm=True)
    new_params, new_state, loss, grad_norm = step(
        relayout.forward(params),
        relayout.forward_state(nnx.as_pure(optimizer.opt_state)), inputs)
    nnx.update(model, relayout.backward(new_params))
    nnx.update(optimizer.opt_state,
               nnx.state(relayout.backward_state(new_state)))
    optimizer.step[...] += 1
    return loss, grad_norm, tokens

  def _taco_model_inputs(self, inputs):
    """The loss's inputs, checked against the keys the default loss takes."""
    if not self._taco_fused_steps:
      model_inputs = self.gen_model_input_fn(inputs)
    else:
      # A group stacked on axis 1 (tunix shards axis 0, the batch).
      micro = [self.gen_model_input_fn(
          jax.tree.map(lambda x, i=i: x[:, i], inputs))
               for i in range(self._taco_fused_steps)]
      model_inputs = jax.tree.map(lambda *xs: jnp.stack(xs), *micro)
    accepted = inspect.signature(self._taco_default_loss).parameters
    unknown = sorted(set(model_inputs) - set(accepted))
    if unknown:
      raise ValueError(
          f'LayerwisePeftTrainer: the model inputs have {unknown}, which '
          f'tunix\'s default loss does not take (it takes '
          f'{", ".join(accepted)}).')
    if model_inputs.get('images') is not None:
      raise ValueError('LayerwisePeftTrainer: image inputs are not supported '
                       'by the layer-wise step; use PeftTrainer.')
    return model_inputs


def _packing(config) -> Optional[int]:
  """The config's sequence-packing budget (tunix 0.1.7 and 0.1.8)."""
  return getattr(config, 'max_seq_token_per_tpu', None)


def _fusable(model) -> bool:
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
