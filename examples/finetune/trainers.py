"""Train steps and the trainers that hold a run's parameters and state.

:class:`NnxTrainer` is the optax path for every optimizer
(``nnx.Optimizer`` + a donated ``nnx.jit`` step); :class:`LayerwiseTacoTrainer`
is TACO through ``taco_optax.layerwise.train_step``. Both expose one
interface: ``compile``, ``step``, ``step_count``, ``optimizer_state_bytes``
and a checkpoint tree.
"""

from typing import Callable, Optional

from flax import nnx
import jax
import numpy as np
import optax

from examples.finetune import data as data_lib
from examples.finetune import landed as landed_lib
from examples.finetune import losses as losses_lib
from examples.finetune import memory_plan
from examples.finetune import optimizers as optimizers_lib
from examples.finetune.model import layered
import taco_optax


def make_train_step(needs_loss: bool,
                    measurement: Optional[landed_lib.Measurement] = None
                    ) -> Callable:
  """``step(model, optimizer, batch) -> loss``, jitted, model/state donated;
  with ``measurement``, ``-> (loss, landed counts)`` (:mod:`landed`)."""

  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(losses_lib.completion_loss)(model, batch)
    extra_args = {}
    if needs_loss:
      graphdef, _, rest = nnx.split(model, nnx.Param, ...)
      extra_args['obj_fn'] = lambda params: losses_lib.completion_loss(
          nnx.merge(graphdef, params, rest), batch)
    if measurement is None:
      optimizer.update(model, grads, **extra_args)
      return loss
    before = nnx.as_pure(nnx.state(model, nnx.Param))
    exact = landed_lib.float32_updates(
        optimizer.tx, nnx.as_pure(nnx.state(grads, nnx.Param)),
        nnx.as_pure(optimizer.opt_state), before, **extra_args)
    optimizer.update(model, grads, **extra_args)
    return loss, landed_lib.optax_counts(
        before, nnx.as_pure(nnx.state(model, nnx.Param)), exact,
        measurement.dimension_numbers)

  return nnx.jit(train_step, donate_argnames=('model', 'optimizer'))


def peak_memory(compiled=None) -> tuple[Optional[int], str]:
  """Peak bytes and where the figure comes from.

  The device's own counter where the backend has one (GPU/TPU); else the
  compiled train step's memory analysis (arguments + outputs + temporaries
  - donated aliases), an estimate of the step's peak.
  """
  stats = None
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # Backends without memory stats raise or return None.
    stats = None
  if stats and 'peak_bytes_in_use' in stats:
    return int(stats['peak_bytes_in_use']), 'device memory_stats'
  if compiled is not None:
    analysis = compiled.memory_analysis()
    if analysis is not None:
      total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
               + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
      return int(total), 'compiled memory analysis of the train step'
  return None, 'unavailable'


class NnxTrainer:
  """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and a donated ``nnx.jit`` step.
  """
  path = 'optax (nnx.Optimizer + nnx.jit)'

  def __init__(self, model, tx, needs_loss: bool,
               measurement: Optional[landed_lib.Measurement] = None,
               accumulation_steps: int = 1):
    """With ``accumulation_steps`` ``A > 1``, ``tx`` runs inside
    ``optax.MultiSteps(tx, A)`` and each step is ``A`` calls of the jitted
    micro-step, one per micro-batch (``data.micro_batches``)."""
    self.model = model
    self.accumulation_steps = accumulation_steps
    if accumulation_steps > 1:
      tx = optax.MultiSteps(tx, accumulation_steps).gradient_transformation()
    self.optimizer = nnx.Optimizer(
        model, taco_optax.nnx.for_nnx_optimizer(tx), wrt=nnx.Param)
    self.measurement = measurement
    self._step = make_train_step(needs_loss, measurement)
    self._micro_batch = jax.jit(
        lambda batch, index: jax.tree.map(
            lambda x: x[index],
            data_lib.micro_batches(batch, accumulation_steps)))

  def _micro_batches(self, batch):
    if self.accumulation_steps == 1:
      return [batch]
    return [self._micro_batch(batch, index)
            for index in range(self.accumulation_steps)]

  def compile(self, batch):
    return self._step.lower(self.model, self.optimizer,
                            self._micro_batches(batch)[0]).compile()

  def step(self, batch):
    if self.measurement is None:
      losses = [self._step(self.model, self.optimizer, micro)
                for micro in self._micro_batches(batch)]
      return sum(losses) / len(losses)
    loss, counts = self._step(self.model, self.optimizer, batch)
    self.measurement.counts.add(counts)
    return loss

  @property
  def step_count(self) -> int:
    """Optimizer steps (``nnx.Optimizer`` counts every micro-step)."""
    return int(self.optimizer.step[...]) // self.accumulation_steps

  def optimizer_state_bytes(self) -> int:
    return memory_plan.tree_bytes(
        nnx.state(self.optimizer, nnx.optimizer.OptState))

  def checkpoint_tree(self):
    """``{'params': by module path, 'optimizer': nnx.Optimizer's state}``."""
    return {'params': nnx.to_pure_dict(nnx.state(self.model, nnx.Param)),
            'optimizer': nnx.to_pure_dict(nnx.state(self.optimizer))}

  def load_checkpoint_tree(self, tree) -> None:
    for part, name in ((self.model, 'params'), (self.optimizer, 'optimizer')):
      state = nnx.state(part, nnx.Param) if name == 'params' else \
          nnx.state(part)
      nnx.replace_by_pure_dict(state, tree[name])
      nnx.update(part, state)


class LayerwiseTacoTrainer:
  """TACO through ``taco_optax``'s layer-wise step: each block's gradient is
  consumed (history updated, winners written into the weight) as soon as
  backprop produces it, so no dense update and at most one block's gradients
  exist at a time. Same parameters and state as the optax path."""
  path = ('layer-wise TACO step (taco_optax): per-block backward, winners '
          'written into the weights during backprop')

  def __init__(self, model, tx: optax.GradientTransformation,
               measurement: Optional[landed_lib.Measurement] = None,
               accumulation_steps: int = 1):
    """``tx`` is the ``taco_optax.taco`` transformation itself
    (``optimizers.taco_optimizer``); with ``accumulation_steps > 1`` each
    batch is split into that many micro-batches inside the jitted step."""
    self.model = model
    self._layered = layered.layered_model(model)
    self.params = self._layered.params
    self.opt_state = tx.init(self.params)
    self.count = 0
    self.measurement = measurement
    blocks = memory_plan.COLUMN_BLOCK_ELEMENTS
    if accumulation_steps == 1:
      step = taco_optax.layerwise.train_step(
          self._layered.loss, tx, column_block_elements=blocks)
    else:
      accumulated = taco_optax.layerwise.train_step(
          self._layered.loss, tx, accumulation_steps=accumulation_steps,
          column_block_elements=blocks)
      step = lambda params, opt_state, batch: accumulated(
          params, opt_state,
          data_lib.micro_batches(batch, accumulation_steps))
    if measurement is not None:
      self._moves = landed_lib.layerwise_moves(
          self.params, measurement.dimension_numbers,
          measurement.update_topk)
      step = _with_changed_counts(step, measurement.dimension_numbers)
    self._step = jax.jit(step, donate_argnums=(0, 1))

  def compile(self, batch):
    return self._step.lower(self.params, self.opt_state, batch).compile()

  def step(self, batch):
    self.params, self.opt_state, loss, *counts = self._step(
        self.params, self.opt_state, batch)
    if counts:
      rate = float(self.measurement.schedule(self.count))
      self.measurement.counts.add(
          counts[0], {group: moves if rate else 0
                      for group, moves in self._moves.items()})
    # The donated old arrays are gone: point the model at the new ones.
    self._layered.write_back(self.params)
    self.count += 1
    return loss

  @property
  def step_count(self) -> int:
    return self.count

  def optimizer_state_bytes(self) -> int:
    return memory_plan.tree_bytes(self.opt_state)

  def checkpoint_tree(self):
    """``{'params', 'opt_state', 'step'}``, parameters and their state by
    module path, as ``nnx.state(model)`` names them (not the layer-wise
    step's ``(outer, layers)`` positions)."""
    return {'params': self._layered.named(self.params),
            'opt_state': self._layered.named_state(self.opt_state),
            'step': np.asarray(self.count, np.int64)}

  def load_checkpoint_tree(self, tree) -> None:
    self.params = self._layered.from_named(tree['params'])
    self.opt_state = self._layered.state_from_named(tree['opt_state'],
                                                    self.opt_state)
    self.count = int(tree['step'])
    self._layered.write_back(self.params)


def _with_changed_counts(step: Callable, dimension_numbers: Callable
                         ) -> Callable:
  """The layer-wise ``step``, also returning its changed entries per group.
  """
  def measured(params, opt_state, batch):
    new_params, new_state, loss = step(params, opt_state, batch)
    return new_params, new_state, loss, landed_lib.changed_counts(
        params, new_params, dimension_numbers)
  return measured


def uses_layerwise_step(config) -> bool:
  """Whether ``config`` (a ``flags.RunConfig``) trains with the
  layer-wise TACO step: TACO, unless ``--taco-step optax``."""
  return config.optimizer == 'taco' and config.taco_step != 'optax'


def make_trainer(config, model, tx: optax.GradientTransformation,
                 measurement: Optional[landed_lib.Measurement] = None):
  """The layer-wise step for TACO when ``--taco-step`` allows, else optax.

  Args:
    config: the run's ``flags.RunConfig``.
    model: the model to train.
    tx: ``optimizers.get(config.optimizer).build(...)``.
    measurement: what ``--measure-landed`` counts, if given.
  """
  if uses_layerwise_step(config):
    return LayerwiseTacoTrainer(model, tx, measurement,
                                accumulation_steps=config.grad_accum)
  return NnxTrainer(model, tx, optimizers_lib.get(config.optimizer).needs_loss,
                    measurement, accumulation_steps=config.grad_accum)
