"""How a run stores, computes with and updates its parameters.

``--dtype`` is the compute dtype; ``--rounding`` says how updates reach
16-bit parameters (a bfloat16 weight of 0.02 has an ulp of 1.2e-4, so rounding
``w + u`` to nearest drops every step below 6e-5):

* ``stochastic``: parameters in the 16-bit dtype, each update rounded up or
  down at random so that it lands on average (TACO: ``taco(...,
  rounding='stochastic')``; the others: ``optax.chain(tx,
  taco_optax.stochastic_rounding(seed))``). No extra memory.
* ``nearest``: parameters in the 16-bit dtype, rounded to nearest
  (``optax.apply_updates``): the ablation.
* ``master``: parameters stored in float32, computation in the 16-bit dtype
  (Flax ``param_dtype=float32, dtype=bfloat16``), for any optimizer: what
  users of the optax peers run (the optimizer state follows the parameters'
  dtype, so it grows too).
* ``auto``: TACO keeps 16-bit parameters with stochastic rounding (its memory
  advantage is the point), every other optimizer gets float32 master weights.

With float32 computation there is nothing to round: all four are the same.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from examples.finetune import memory_plan
from examples.finetune import optimizers as optimizers_lib
from examples.finetune import report

ROUNDINGS = ('auto', 'stochastic', 'nearest', 'master')
# What a run's rounding resolves to with float32 computation.
NO_ROUNDING = 'none'


def compute_dtype(name: str) -> jnp.dtype:
  """The dtype ``--dtype`` names (``auto``: float32 on CPU, else bfloat16)."""
  if name == 'auto':
    # CPUs upcast bf16 matmuls (slower, no memory gain in the temporaries).
    return jnp.dtype(jnp.float32 if jax.default_backend() == 'cpu'
                     else jnp.bfloat16)
  return jnp.dtype(name)


class Precision(NamedTuple):
  """A run's dtypes and how its updates land.

  Attributes:
    compute_dtype: activations and matmuls.
    param_dtype: the stored parameters.
    rounding: ``'stochastic'``, ``'nearest'``, ``'master'``, or
      :data:`NO_ROUNDING` with float32 computation.
    why: how ``--rounding`` resolved, for the log.
  """
  compute_dtype: jnp.dtype
  param_dtype: jnp.dtype
  rounding: str
  why: str

  def optimizer_rounding(self, seed: int) -> optimizers_lib.Rounding:
    """What the optimizer is told: stochastic rounding only where the
    parameters are 16-bit and ``stochastic`` was chosen."""
    mode = 'stochastic' if self.rounding == 'stochastic' else 'nearest'
    return optimizers_lib.Rounding(mode, seed)


def resolve(dtype: str, rounding: str, optimizer: str) -> Precision:
  """The :class:`Precision` of ``--dtype``, ``--rounding`` and
  ``--optimizer``."""
  compute = compute_dtype(dtype)
  if compute == jnp.float32:
    return Precision(compute, compute, NO_ROUNDING,
                     f'--rounding {rounding} changes nothing: float32 '
                     'updates land as computed')
  why = f'--rounding {rounding}'
  if rounding == 'auto':
    rounding = 'stochastic' if optimizer == 'taco' else 'master'
    why += (': TACO keeps 16-bit parameters' if optimizer == 'taco' else
            f': {optimizer} as its users run it in {compute.name}')
  param = jnp.dtype(jnp.float32) if rounding == 'master' else compute
  return Precision(compute, param, rounding, why)


def describe(precision: Precision, extra_parameter_bytes: int,
             extra_state_bytes: int) -> str:
  """How 16-bit updates land and what that costs in memory, in a few words.

  Args:
    precision: the run's.
    extra_parameter_bytes: parameter bytes beyond the same parameters stored
      in the compute dtype (:func:`master_cost`).
    extra_state_bytes: the same for the optimizer state.
  """
  compute = precision.compute_dtype.name
  if precision.rounding == NO_ROUNDING:
    return 'none: float32 parameters'
  if precision.rounding == 'master':
    cost = f'+{report.format_bytes(extra_parameter_bytes)} of parameters'
    if extra_state_bytes:
      cost += f', +{report.format_bytes(extra_state_bytes)} of state'
    return f'float32 master weights, {compute} compute ({cost})'
  if precision.rounding == 'stochastic':
    return f'stochastic rounding, {compute} parameters (no extra memory)'
  return (f'round to nearest, {compute} parameters (no extra memory; steps '
          'under half an ulp are dropped)')


def master_cost(params: Any, init: Any, compute: Any) -> tuple[int, int]:
  """``(parameter bytes, state bytes)`` beyond storing ``params`` in
  ``compute``: both 0 unless the parameters are wider than the computation.

  Args:
    params: the parameters as stored (arrays or ``ShapeDtypeStruct``).
    init: the optimizer's ``init``.
    compute: the compute dtype.
  """
  narrow = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, compute)
      if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  parameters = memory_plan.tree_bytes(params) - memory_plan.tree_bytes(narrow)
  state = (memory_plan.tree_bytes(jax.eval_shape(init, params))
           - memory_plan.tree_bytes(jax.eval_shape(init, narrow)))
  return parameters, state
