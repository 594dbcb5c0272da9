"""Mesh placement: where a TACO leaf and the optimizer state live on a mesh.

What its siblings use: a leaf's :class:`LeafSharding` over explicit mesh axes
(:func:`leaf_sharding_of`, from the array's type; :func:`explicit_sharding`,
:func:`padded_spec`, :func:`spec_entry`), a device's block inside
``shard_map`` (:func:`local_rows`, :func:`global_rows`, :func:`block_start`,
:func:`first_element`), the history placed on its shardings
(:func:`with_state_sharding`), the whole state's shardings for ``jit`` and
checkpoints (:func:`state_shardings`, public), and the column step's
partitioning rule on an Auto mesh (:func:`partitioned_step`). The column
step's arithmetic across devices is the kernels'.
"""

from taco_optax._src.sharding.auto_partition import partitioned_step
from taco_optax._src.sharding.mesh import LeafAxes
from taco_optax._src.sharding.mesh import LeafSharding
from taco_optax._src.sharding.mesh import MeshAxes
from taco_optax._src.sharding.mesh import block_start
from taco_optax._src.sharding.mesh import explicit_sharding
from taco_optax._src.sharding.mesh import first_element
from taco_optax._src.sharding.mesh import global_rows
from taco_optax._src.sharding.mesh import leaf_sharding_of
from taco_optax._src.sharding.mesh import local_rows
from taco_optax._src.sharding.mesh import padded_spec
from taco_optax._src.sharding.mesh import spec_entry
from taco_optax._src.sharding.mesh import with_state_sharding
from taco_optax._src.sharding.state_shardings import state_shardings

__all__ = (
    'LeafAxes',
    'LeafSharding',
    'MeshAxes',
    'block_start',
    'explicit_sharding',
    'first_element',
    'global_rows',
    'leaf_sharding_of',
    'local_rows',
    'padded_spec',
    'partitioned_step',
    'spec_entry',
    'state_shardings',
    'with_state_sharding',
)
