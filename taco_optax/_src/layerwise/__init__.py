"""The layer-wise train step: each layer's gradient consumed as it appears.

What the public :mod:`taco_optax.layerwise` and the integrations use:
:func:`train_step` (from a :func:`taco_optax.taco` optimizer),
:func:`step_from_parts` (from its parts, for a caller that re-lays the
parameters, as tunix's trainer does, with :func:`pair_parts`), the loss's
shape (:class:`LayeredLoss`, or read from a plain loss's jaxpr:
:func:`layered_loss_of`), the token tables' reads (:class:`TableLookup`,
:class:`TableProjection`), the bytes an accumulated step keeps for a token
table's mean (:func:`table_mean_bytes`, for memory planners) and the plain
step's layers with FSDP gathers issued when used (:func:`remat_layers`).
"""

from taco_optax._src.layerwise.layered_loss import LayeredLoss
from taco_optax._src.layerwise.micro_batch_table import table_mean_bytes
from taco_optax._src.layerwise.relayout import Relayout
from taco_optax._src.layerwise.relayout import pair_parts
from taco_optax._src.layerwise.remat import remat_layers
from taco_optax._src.layerwise.token_table import TableLookup
from taco_optax._src.layerwise.token_table import TableProjection
from taco_optax._src.layerwise.traced_loss import layered_loss_of
from taco_optax._src.layerwise.train_step import TrainStep
from taco_optax._src.layerwise.train_step import step_from_parts
from taco_optax._src.layerwise.train_step import train_step
from taco_optax._src.layerwise.winners import DEFAULT_COLUMN_BLOCK_ELEMENTS

__all__ = (
    'DEFAULT_COLUMN_BLOCK_ELEMENTS',
    'LayeredLoss',
    'Relayout',
    'TableLookup',
    'TableProjection',
    'TrainStep',
    'layered_loss_of',
    'pair_parts',
    'remat_layers',
    'step_from_parts',
    'table_mean_bytes',
    'train_step',
)
