"""taco_optax: the TACO optimizer for JAX and Optax."""

from taco_optax._alias import ADAM_LABEL
from taco_optax._alias import TACO_LABEL
from taco_optax._alias import taco
from taco_optax._alias import taco_parts
from taco_optax._alias import taco_states
from taco_optax._alias import TacoParts
from taco_optax._alias import TacoStates
from taco_optax._alias import with_taco_states
from taco_optax._dimension_numbers import TacoDimensionNumbers
from taco_optax._layered_loss import LayeredLoss
from taco_optax._layerwise import layerwise_train_step
from taco_optax._layerwise import LayerwiseTrainStep
from taco_optax._state_shardings import state_shardings
from taco_optax._token_table import TableLookup
from taco_optax._token_table import TableProjection
from taco_optax._transform import scale_by_taco
from taco_optax._transform import TacoState

__version__ = '0.1.0'


def __getattr__(name):
  # Flax is optional: taco_optax.nnx imports it, and names the extra if absent.
  if name == 'for_nnx_optimizer':
    from taco_optax import nnx  # pylint: disable=g-import-not-at-top
    return nnx.for_nnx_optimizer
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = (
    'ADAM_LABEL',
    'LayeredLoss',
    'LayerwiseTrainStep',
    'TACO_LABEL',
    'TableLookup',
    'TableProjection',
    'TacoDimensionNumbers',
    'TacoParts',
    'TacoState',
    'TacoStates',
    'for_nnx_optimizer',
    'layerwise_train_step',
    'scale_by_taco',
    'state_shardings',
    'taco',
    'taco_parts',
    'taco_states',
    'with_taco_states',
)
