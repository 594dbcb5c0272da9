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

from examples.finetune import losses as losses_lib
from examples.finetune import memory_plan
from examples.finetune import optimizers as optimizers_lib
from examples.finetune.model import layered
import taco_optax


def make_train_step(needs_loss: bool) -> Callable:
  """``step(model, optimizer, batch) -> loss``, jitted, model/state donated.
  """

  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(losses_lib.completion_loss)(model, batch)
    if needs_loss:
      graphdef, _, rest = nnx.split(model, nnx.Param, ...)
      objective = lambda params: losses_lib.completion_loss(
          nnx.merge(graphdef, params, rest), batch)
      optimizer.update(model, grads, obj_fn=objective)
    else:
      optimizer.update(model, grads)
    return loss

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

  def __init__(self, model, tx, needs_loss: bool):
    self.model = model
    self.optimizer = nnx.Optimizer(
        model, taco_optax.nnx.for_nnx_optimizer(tx), wrt=nnx.Param)
    self._step = make_train_step(needs_loss)

  def compile(self, batch):
    return self._step.lower(self.model, self.optimizer, batch).compile()

  def step(self, batch):
    return self._step(self.model, self.optimizer, batch)

  @property
  def step_count(self) -> int:
    return int(self.optimizer.step[...])

  def optimizer_state_bytes(self) -> int:
    return memory_plan.tree_bytes(
        nnx.state(self.optimizer, nnx.optimizer.OptState))

  def checkpoint_tree(self):
    return nnx.to_pure_dict(nnx.state((self.model, self.optimizer)))

  def load_checkpoint_tree(self, tree) -> None:
    state = nnx.state((self.model, self.optimizer))
    nnx.replace_by_pure_dict(state, tree)
    nnx.update((self.model, self.optimizer), state)


class LayerwiseTacoTrainer:
  """TACO through ``taco_optax``'s layer-wise step: each block's gradient is
  consumed (history updated, winners written into the weight) as soon as
  backprop produces it, so no dense update and at most one block's gradients
  exist at a time. Same parameters and state as the optax path."""
  path = ('layer-wise TACO step (taco_optax): per-block backward, winners '
          'written into the weights during backprop')

  def __init__(self, model, schedule, hints: optimizers_lib.ModelHints,
               taco: Optional[optimizers_lib.TacoSettings] = None):
    self.model = model
    self._layered = layered.layered_model(model)
    taco = optimizers_lib.TacoSettings() if taco is None else taco
    tx = optimizers_lib.taco_optimizer(schedule, hints, taco)
    self.params = self._layered.params
    self.opt_state = tx.init(self.params)
    self.count = 0
    self._step = jax.jit(taco_optax.layerwise.train_step(self._layered.loss,
                                                         tx),
                         donate_argnums=(0, 1))

  def compile(self, batch):
    return self._step.lower(self.params, self.opt_state, batch).compile()

  def step(self, batch):
    self.params, self.opt_state, loss = self._step(self.params,
                                                   self.opt_state, batch)
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
    return {'params': self.params, 'opt_state': self.opt_state,
            'step': np.asarray(self.count, np.int64)}

  def load_checkpoint_tree(self, tree) -> None:
    self.params, self.opt_state = tree['params'], tree['opt_state']
    self.count = int(tree['step'])
    self._layered.write_back(self.params)


def uses_layerwise_step(config) -> bool:
  """Whether ``config`` (a ``flags.RunConfig``) trains with the
  layer-wise TACO step: TACO, unless ``--taco-step optax``."""
  return config.optimizer == 'taco' and config.taco_step != 'optax'


def make_trainer(config, model, schedule, hints):
  """The layer-wise step for TACO when ``--taco-step`` allows, else optax."""
  if uses_layerwise_step(config):
    return LayerwiseTacoTrainer(model, schedule, hints, config.taco)
  spec = optimizers_lib.get(config.optimizer)
  return NnxTrainer(model, spec.build(schedule, hints, config.taco),
                    spec.needs_loss)
