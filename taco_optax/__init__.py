"""taco_optax: the TACO optimizer for JAX and Optax.

The optimizer: :func:`taco` (TACO on matrices, AdamW on the rest),
:func:`scale_by_taco` (the direction alone), :class:`TacoState`,
:class:`TacoDimensionNumbers`, :func:`state_shardings` and
:func:`routing_report` (which leaves go to TACO, and the state's bytes); and
:func:`stochastic_rounding`, which :func:`taco` ends with for 16-bit
parameters and any optax chain can end with. The memory-lean
layer-wise train step lives in :mod:`taco_optax.layerwise`, Flax NNX support
in :mod:`taco_optax.nnx`, tunix's trainer with the layer-wise step in
:mod:`taco_optax.tunix`. Which leaves are matrices, and their axes, are read
from the modules by :mod:`taco_optax.nnx`, :mod:`taco_optax.linen` and
:mod:`taco_optax.equinox`, or from the computation by
:func:`trace_dimension_numbers`.
"""

from taco_optax import layerwise  # noqa: F401  (the public submodule, imported with the package)
from taco_optax._src.routing import TacoDimensionNumbers
from taco_optax._src.routing import trace_dimension_numbers
from taco_optax._src.sharding import state_shardings
from taco_optax._src.transform import TacoState
from taco_optax._src.transform import routing_report
from taco_optax._src.transform import scale_by_taco
from taco_optax._src.transform import stochastic_rounding
from taco_optax._src.transform import taco

__version__ = '0.1.0'

# Names of 0.1.0's development versions, and where they went.
_MOVED = {
    'layerwise_train_step': 'taco_optax.layerwise.train_step(loss, taco(...))',
    'LayerwiseTrainStep': 'taco_optax.layerwise.TrainStep',
    'LayeredLoss': 'taco_optax.layerwise.LayeredLoss',
    'TableLookup': 'taco_optax.layerwise.TableLookup',
    'TableProjection': 'taco_optax.layerwise.TableProjection',
    'for_nnx_optimizer': 'taco_optax.nnx.for_nnx_optimizer',
}


def __getattr__(name):
  # Flax, Equinox and tunix are optional: taco_optax.nnx, .linen, .equinox
  # and .tunix import them, and name the extra if absent.
  if name in ('equinox', 'linen', 'nnx', 'tunix'):
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f'taco_optax.{name}')
  if name in _MOVED:
    raise AttributeError(f'taco_optax.{name} moved: use {_MOVED[name]}.')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = (
    'TacoDimensionNumbers',
    'TacoState',
    'routing_report',
    'scale_by_taco',
    'state_shardings',
    'stochastic_rounding',
    'taco',
    'trace_dimension_numbers',
)
