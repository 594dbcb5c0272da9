"""What the installed tunix offers the layer-wise trainer, checked at build.

tunix's ``PeftTrainer`` changed its train step between releases:

* 0.1.7: ``train_step(model, optimizer, inputs)``; accumulation is
  ``optax.MultiSteps`` (the mean of the micro-batches' mean losses'
  gradients); the default loss returns the mean.
* 0.1.8 (main): ``train_step(model, optimizer, grad_accumulator, inputs,
  is_update_step)``; accumulation is its ``GradientAccumulator``, and its
  default loss returns a ``utils.LossOutput`` (the summed loss and its token
  count), so micro-batches are weighted by their tokens (``Σ ∇S_a / Σ n_a``).

The trainer reads the form from the signature of the step tunix's own
``create_train_step_fn()`` returns (a public method), so a tunix whose step
takes other arguments is refused when the trainer is built, naming the
range, not with a ``TypeError`` at the first step.
"""

import importlib.metadata
import inspect
import logging
import re
from typing import Any, Callable, NamedTuple

_logger = logging.getLogger('taco_optax')

# The tunix versions tests/test_tunix.py passes on (docs/tunix.md), oldest
# and newest; pyproject's [tunix] extra says the same.
SUPPORTED = ('0.1.7', '0.1.8')

# The train-step parameters of each known form.
STEP_0_1_7 = ('model', 'optimizer', 'inputs')
STEP_0_1_8 = ('model', 'optimizer', 'grad_accumulator', 'inputs',
              'is_update_step')


class TunixApi(NamedTuple):
  """The installed tunix, as the layer-wise trainer uses it.

  Attributes:
    version: its version string.
    step_parameters: the parameters of ``PeftTrainer``'s train step.
    accumulator: whether the step takes ``grad_accumulator`` and
      ``is_update_step`` (0.1.8), which the trainer jits and donates.
    token_weighted: whether tunix accumulates its default loss's
      micro-batches weighted by their tokens (0.1.8) rather than as the mean
      of their means (0.1.7's ``MultiSteps``).
  """
  version: str
  step_parameters: tuple[str, ...]
  accumulator: bool
  token_weighted: bool


def installed_version() -> str:
  """The installed ``google-tunix`` distribution's version."""
  try:
    return importlib.metadata.version('google-tunix')
  except importlib.metadata.PackageNotFoundError:  # a source tree on the path
    return 'unknown'


def _release(version: str) -> tuple[int, ...]:
  match = re.match(r'(\d+)\.(\d+)\.(\d+)', version)
  return tuple(map(int, match.groups())) if match else ()


def in_range(version: str) -> bool:
  """Whether ``version``'s release is within :data:`SUPPORTED`."""
  release = _release(version)
  low, high = (_release(v) for v in SUPPORTED)
  return bool(release) and low <= release <= high


def supported_range() -> str:
  return f'tunix {SUPPORTED[0]} to {SUPPORTED[1]}'


def check(step: Callable[..., Any], version: str) -> TunixApi:
  """The :class:`TunixApi` of a tunix whose train step is ``step``.

  Raises:
    ValueError: when ``step`` takes arguments of no known form, naming the
      supported range.
  """
  parameters = tuple(inspect.signature(step).parameters)
  if parameters not in (STEP_0_1_7, STEP_0_1_8):
    raise ValueError(
        f'LayerwisePeftTrainer supports {supported_range()}; the installed '
        f'tunix {version} has a train step taking ({", ".join(parameters)}), '
        'which it does not know. Use tunix\'s PeftTrainer with taco(...), or '
        'install a supported tunix: pip install "taco_optax[tunix]".')
  if not in_range(version):
    _logger.warning(
        'LayerwisePeftTrainer: tunix %s is outside the tested range (%s); '
        'its train step has the known form (%s), so the trainer runs it.',
        version, supported_range(), ', '.join(parameters))
  accumulator = parameters == STEP_0_1_8
  return TunixApi(version, parameters, accumulator, token_weighted=accumulator)
