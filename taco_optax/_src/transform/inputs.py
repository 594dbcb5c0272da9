"""What ``update`` checks of its inputs before anything runs.

Each error names the leaf and the argument, where the cause is: a gradient of
another shape than its parameter, a ``float0`` gradient (``jax.grad(...,
allow_int=True)`` of an integer leaf). NumPy arrays are taken as
``optax.adamw`` takes them, as arrays.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from taco_optax._src import routing


def as_arrays(tree: Any) -> Any:
  """``tree`` with its NumPy leaves as jax arrays (``None`` stays)."""
  if tree is None:
    return None
  return jax.tree.map(
      lambda x: jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic))
      else x, tree)


def check_like_params(updates: Any, params: Any) -> None:
  """Raises, naming the leaf, if a gradient is ``float0`` or its shape is
  not its parameter's (``params`` of another tree structure are left to
  optax's own error)."""
  paths = jax.tree_util.tree_leaves_with_path(updates)
  for path, grad in paths:
    if jnp.result_type(grad) == jax.dtypes.float0:
      raise ValueError(
          f'The gradient of {routing.path_name(path)!r} is float0, the '
          'gradient of an integer parameter (jax.grad(..., allow_int=True)): '
          'optimizers update floating parameters only; leave integer leaves '
          'out of the params and grads given to init and update (e.g. '
          'eqx.partition(model, eqx.is_inexact_array)).')
  if params is None:
    return
  try:
    expected = jax.tree.structure(updates).flatten_up_to(params)
  except (ValueError, TypeError):
    return
  for (path, grad), param in zip(paths, expected):
    shape = getattr(param, 'shape', None)
    if shape is not None and tuple(shape) != tuple(jnp.shape(grad)):
      raise ValueError(
          f'The gradient of {routing.path_name(path)!r} has shape '
          f'{tuple(jnp.shape(grad))}, its parameter {tuple(shape)}: they '
          'must be equal.')


def checked(updates: Any, params: Any) -> tuple[Any, Any]:
  """``(updates, params)`` as arrays, checked (:func:`check_like_params`)."""
  updates, params = as_arrays(updates), as_arrays(params)
  check_like_params(updates, params)
  return updates, params
