"""taco_optax: the TACO optimizer for JAX and Optax."""

from taco_optax._alias import taco
from taco_optax._dimension_numbers import TacoDimensionNumbers
from taco_optax._sharding import for_nnx_optimizer
from taco_optax._sharding import state_shardings
from taco_optax._transform import scale_by_taco
from taco_optax._transform import TacoState

__version__ = '0.1.0'

__all__ = (
    'TacoDimensionNumbers',
    'TacoState',
    'for_nnx_optimizer',
    'scale_by_taco',
    'state_shardings',
    'taco',
)
