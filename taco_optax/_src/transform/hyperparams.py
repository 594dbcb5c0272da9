"""TACO's learning rates and ``mu``: refused where they can be read.

A negative learning rate makes every step go uphill and a NaN one makes
every update NaN; ``mu`` outside ``[0, 1)`` makes the history grow or flip
and every step go uphill too. Where the value can be read (a Python number,
a concrete array, a schedule at step 0) it is refused with a message. A value
that only exists inside ``jit`` (an ``optax.inject_hyperparams`` value, a
schedule past step 0) cannot be refused, so it follows one stated rule
instead: a learning rate that is negative or not finite, or a ``mu`` outside
``[0, 1)``, makes that step's updates NaN (TACO leaves keep their history),
exactly as a non-finite gradient does, so :func:`optax.apply_if_finite`
skips the step.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def concrete(value: Any) -> bool:
  """Whether ``value`` can be read now (not a tracer inside ``jit``)."""
  return not isinstance(value, jax.core.Tracer)


def valid_rate(rate: Any) -> jax.Array:
  """``rate`` is finite and ``>= 0`` (a ``()`` bool, False for NaN)."""
  rate = jnp.asarray(rate)
  return jnp.all(jnp.isfinite(rate) & (rate >= 0))


def valid_mu(mu: Any) -> jax.Array:
  """``0 <= mu < 1`` (a ``()`` bool, False for NaN)."""
  mu = jnp.asarray(mu)
  return jnp.all((mu >= 0) & (mu < 1))


def _shown(value: np.ndarray) -> str:
  """A number as a float32 reads (``-0.001``, not ``-0.0010000000474``)."""
  return (f'{float(np.float32(value)):.7g}' if value.size == 1
          else str(value))


def check_rate(name: str, rate: Any, when: str = '') -> None:
  """Raises if a readable ``rate`` is negative or not finite."""
  if callable(rate) or not concrete(rate):
    return
  value = np.asarray(rate, dtype=np.float64)
  if not np.all(np.isfinite(value) & (value >= 0)):
    raise ValueError(
        f'{name} must be finite and >= 0{when}, got {_shown(value)}: a '
        'negative rate moves every weight uphill and a NaN or Inf one makes '
        'every update NaN.')


def check_mu(mu: Any) -> None:
  """Raises if a readable ``mu`` is outside ``[0, 1)``."""
  if not concrete(mu):
    return
  value = np.asarray(mu, dtype=np.float64)
  if not np.all((value >= 0) & (value < 1)):
    raise ValueError(
        f'mu must be in [0, 1), got {_shown(value)}: the history is an EMA '
        '(mu M + (1 - mu) G), and outside [0, 1) it grows or flips sign and '
        'the step goes uphill.')


def scale_by_checked_learning_rate(learning_rate: optax.ScalarOrSchedule,
                                   name: str = 'learning_rate'
                                   ) -> optax.GradientTransformation:
  """``optax.scale_by_learning_rate`` (same state) that never steps uphill.

  A number or concrete array is checked now, a schedule at ``init`` (its
  value at step 0); a rate only known inside ``jit`` makes that step's
  updates NaN when negative or not finite (the module's rule).

  Args:
    learning_rate: the rate or schedule.
    name: the argument's name, for the message.

  Returns:
    A transformation with ``optax.scale_by_learning_rate``'s state and, for
    valid rates, its updates bit for bit.
  """
  check_rate(name, learning_rate)
  inner = optax.scale_by_learning_rate(learning_rate)

  def init_fn(params):
    if callable(learning_rate):
      check_rate(f'{name} (a schedule)',
                 learning_rate(jnp.zeros([], jnp.int32)), ' at step 0')
    return inner.init(params)

  def update_fn(updates, state, params=None):
    scaled, state_out = inner.update(updates, state, params)
    rate = (learning_rate(state.count) if callable(learning_rate)
            else learning_rate)
    if concrete(rate) and not callable(learning_rate):
      return scaled, state_out  # checked when built
    ok = valid_rate(rate)
    return jax.tree.map(lambda u: jnp.where(ok, u, jnp.nan), scaled), state_out

  return optax.GradientTransformation(init_fn, update_fn)
