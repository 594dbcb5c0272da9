"""The layer-wise step with the optimizer it runs, as the tests build it."""

from typing import Any, Callable, NamedTuple

import optax

import taco_optax


class Train(NamedTuple):
  optimizer: optax.GradientTransformation
  step: Callable[..., Any]


def train(loss: taco_optax.layerwise.LayeredLoss, *taco_args: Any,
          **taco_kwargs: Any) -> Train:
  """``taco(*taco_args, **taco_kwargs)`` and its layer-wise step on ``loss``."""
  optimizer = taco_optax.taco(*taco_args, **taco_kwargs)
  return Train(optimizer, taco_optax.layerwise.train_step(loss, optimizer))
