"""The loss, the optimizers, the two train steps and held-out accuracy.

Both train steps have one signature, ``step(model, optimizer, batch) ->
loss``, and update the model and its ``nnx.Optimizer`` in place:

* :func:`optax_train_step`, the plain path: ``nnx.value_and_grad`` of
  :func:`loss_fn`, then ``optimizer.update``. Any optax transformation
  works; with TACO every dense gradient exists at once, as with AdamW.
* :func:`lean_train_step`, TACO's memory-lean path:
  ``taco_optax.layerwise.train_step`` takes the same loss as a plain function
  of the parameters, reads the model's rematerialised blocks (and the tied
  token table's lookup and projection) from its program, and runs the
  backward pass one block at a time, writing each column's winner into the
  weights as soon as that block's gradient exists, so at most one block's
  gradients are alive. The same step: bit for bit in float32 at a constant
  rate on jax 0.10, else up to last-bit differences in float order.
"""

from typing import Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.smollm2 import input_pipeline
import taco_optax

# Peak learning rates at 40 steps, the budget rule of
# examples/finetune/optimizers.py (chosen over seeds on three tasks'
# validation sets).
PEAK_LEARNING_RATES = {'taco': 5.6e-4, 'adamw': 6.4e-5}


def candidate_scores(model, batch: input_pipeline.Batch) -> jax.Array:
  """``[B, C]`` logits of the label words after each prompt's last token."""
  hidden = model.hidden_states(batch.input_ids, batch.attention_mask)
  last = batch.attention_mask.sum(-1).astype(jnp.int32) - 1
  hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
  # The whole vocabulary's logits (B x 49152): a projection through the tied
  # table that the lean step recognises, so it never forms the table's dense
  # gradient.
  logits = model.logits(hidden)
  return jnp.take_along_axis(logits, batch.candidate_ids, axis=-1)


def loss_fn(model, batch: input_pipeline.Batch) -> jax.Array:
  """Cross-entropy of the correct label word among the label words."""
  log_probs = jax.nn.log_softmax(candidate_scores(model, batch), axis=-1)
  return -jnp.take_along_axis(log_probs, batch.labels[:, None], -1).mean()


def learning_rate_schedule(peak: float, steps: int) -> optax.Schedule:
  """Linear warm-up over a tenth of the steps (at most 50), then linear
  decay to 0 at ``steps``."""
  warmup = min(50, steps // 10)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, max(warmup, 1)),
       optax.linear_schedule(peak, 0.0, max(steps - warmup, 1))],
      boundaries=[warmup])


def make_optimizer(name: str, model, learning_rate: optax.ScalarOrSchedule
                   ) -> optax.GradientTransformation:
  """TACO (matrices; norm scales to its AdamW branch) or AdamW (everything).

  TACO moves one weight per input feature, so it must know which axis of a
  kernel holds the inputs: :func:`taco_optax.nnx.dimension_numbers` reads it
  from the modules (``nnx.Linear`` kernels ``(in, out)``; the ``nnx.Embed``
  table with the vocabulary as the rows it chooses among), and
  :func:`taco_optax.nnx.update_scales` gives the table the paper's scale 1.
  """
  if name == 'taco':
    return taco_optax.taco(
        learning_rate,
        weight_dimension_numbers=taco_optax.nnx.dimension_numbers(model),
        update_scale=taco_optax.nnx.update_scales(model))
  if name == 'adamw':
    return optax.adamw(learning_rate, weight_decay=0.0)
  raise ValueError(f"optimizer must be 'taco' or 'adamw', got {name!r}")


def optax_train_step(model, optimizer: nnx.Optimizer,
                     batch: input_pipeline.Batch) -> jax.Array:
  """One step of the plain optax path (any optimizer)."""
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


def lean_train_step(model, tx: optax.GradientTransformation) -> Callable:
  """TACO's layer-wise step for ``model``, as ``step(model, optimizer,
  batch)``.

  Args:
    model: the model; only its structure is read here.
    tx: the ``taco_optax.taco(...)`` transformation ``optimizer`` holds.
  """
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)

  def plain_loss(params, batch):  # what one would give jax.grad
    return loss_fn(nnx.merge(graphdef, params, rest), batch)

  lean = taco_optax.layerwise.train_step(plain_loss, tx)

  def step(model, optimizer, batch):
    params, opt_state, loss = lean(nnx.state(model, nnx.Param),
                                   optimizer.opt_state, batch)
    nnx.update(model, params)
    nnx.update(optimizer.opt_state, nnx.state(opt_state))
    optimizer.step[...] += 1
    return loss

  return step


def jit_step(step: Callable) -> Callable:
  """``step`` compiled, its model and optimizer donated: updated in place."""
  return nnx.jit(step, donate_argnames=('model', 'optimizer'))


@nnx.jit
def _predictions(model, batch: input_pipeline.Batch) -> jax.Array:
  return jnp.argmax(candidate_scores(model, batch), axis=-1)


def accuracy(model, examples, candidate_ids, *, batch_size: int,
             seq_len: int) -> float:
  """The share of ``examples`` whose label word scores highest."""
  correct = 0
  for batch, real in input_pipeline.eval_batches(
      examples, candidate_ids, batch_size, seq_len):
    predicted = np.asarray(_predictions(model, batch))[:real]
    correct += int((predicted == batch.labels[:real]).sum())
  return correct / len(examples)
