"""taco_optax: the TACO optimizer for JAX and Optax."""

from taco_optax._alias import taco
from taco_optax._dimension_numbers import TacoDimensionNumbers
from taco_optax._state_shardings import for_nnx_optimizer
from taco_optax._state_shardings import state_shardings
from taco_optax._train_step import LayeredLoss
from taco_optax._train_step import layerwise_train_step
from taco_optax._train_step import LayerwiseTrainStep
from taco_optax._transform import scale_by_taco
from taco_optax._transform import TacoState

__version__ = '0.1.0'

__all__ = (
    'LayeredLoss',
    'LayerwiseTrainStep',
    'TacoDimensionNumbers',
    'TacoState',
    'for_nnx_optimizer',
    'layerwise_train_step',
    'scale_by_taco',
    'state_shardings',
    'taco',
)
