"""The layer-wise TACO train step: each layer's gradient dies as it appears.

:func:`train_step` turns a plain ``loss_fn(params, batch)`` whose blocks are
rematerialised (each under ``jax.checkpoint``, or Flax's and Equinox's remat
wrappers, or stacked in one scan with a rematerialised body;
:func:`layered_loss_of` reads them from its jaxpr), or a loss written as
:class:`LayeredLoss` (``embed -> layer x L -> head``), and a
:func:`taco_optax.taco` optimizer into a train step whose peak memory is about
inference's: the backward pass is written one layer
at a time and every weight's winners are written into it in place. A language
model's token tables read through :class:`TableLookup` and
:class:`TableProjection` never get a dense gradient either.
:func:`table_mean_bytes` says what an accumulated step keeps of a token
table's mean gradient (for memory planners).

Examples:
  >>> import taco_optax
  >>> from taco_optax import layerwise
  >>> print(*sorted(layerwise.__all__), sep='\\n')
  LayeredLoss
  TableLookup
  TableProjection
  TrainStep
  layered_loss_of
  remat_layers
  table_mean_bytes
  train_step
"""

from taco_optax._src.layerwise import LayeredLoss
from taco_optax._src.layerwise import TableLookup
from taco_optax._src.layerwise import TableProjection
from taco_optax._src.layerwise import TrainStep
from taco_optax._src.layerwise import layered_loss_of
from taco_optax._src.layerwise import remat_layers
from taco_optax._src.layerwise import table_mean_bytes
from taco_optax._src.layerwise import train_step

__all__ = (
    'LayeredLoss',
    'TableLookup',
    'TableProjection',
    'TrainStep',
    'layered_loss_of',
    'remat_layers',
    'table_mean_bytes',
    'train_step',
)


def __getattr__(name):
  if name == 'COLUMN_BLOCK_ELEMENTS':
    raise AttributeError(
        'taco_optax.layerwise.COLUMN_BLOCK_ELEMENTS is gone (assigning it '
        'changed nothing): pass train_step(..., column_block_elements=n).')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
