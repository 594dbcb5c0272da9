"""The layer-wise step with the optimizer it runs, as the tests build it."""

from typing import Any, Callable, NamedTuple, Optional

import optax

import taco_optax


class Train(NamedTuple):
  optimizer: optax.GradientTransformation
  step: Callable[..., Any]


def train(loss: taco_optax.layerwise.LayeredLoss, *taco_args: Any,
          column_block_elements: Optional[int] = None,
          **taco_kwargs: Any) -> Train:
  """``taco(*taco_args, **taco_kwargs)`` and its layer-wise step on ``loss``
  (with ``column_block_elements`` when given)."""
  optimizer = taco_optax.taco(*taco_args, **taco_kwargs)
  blocks = ({} if column_block_elements is None
            else {'column_block_elements': column_block_elements})
  return Train(optimizer,
               taco_optax.layerwise.train_step(loss, optimizer, **blocks))
