"""Other frameworks' weights and trainers, read in their own terms.

What needs nothing beyond jax and optax is here: the TACO axes of a weight
read from its einsum (:func:`weight_dimension_numbers`). The modules that need
an optional framework are imported by their public module only, after that
framework (:data:`OPTIONAL_MODULES`): ``nnx_routes`` (Flax NNX; by
:mod:`taco_optax.nnx`), ``linen_routes`` (Flax Linen; by
:mod:`taco_optax.linen`), ``equinox_routes`` (Equinox; by
:mod:`taco_optax.equinox`), and ``tunix_model`` and ``tunix_api`` (tunix;
by :mod:`taco_optax.tunix`).
"""

from taco_optax._src.integrations.einsum import AmbiguousEinsum
from taco_optax._src.integrations.einsum import lora_dimension_numbers
from taco_optax._src.integrations.einsum import weight_dimension_numbers
from taco_optax._src.integrations.einsum import weight_rank

# Modules of this package that import an optional framework at their top:
# imported directly by the public module of that framework, never from here.
OPTIONAL_MODULES = ('nnx_routes', 'tunix_model', 'tunix_api', 'linen_routes',
                    'equinox_routes')

__all__ = (
    'OPTIONAL_MODULES',
    'AmbiguousEinsum',
    'lora_dimension_numbers',
    'weight_dimension_numbers',
    'weight_rank',
)
