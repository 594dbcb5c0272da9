"""TACO's column step on rows, what runs it, and where a leaf lives on a mesh.

The kernels work on *rows*: ``(N, m)`` arrays whose row ``i`` holds the ``m``
candidates of one of the paper's columns. They know nothing of parameters'
layouts or of optax: the transformation reshapes a leaf to rows and hands
them here. What its siblings use:

* :func:`history_step`: one step of a leaf's stored ``batch + (k, n)``
  history on its gradient rows, by the implementation :func:`resolve` names
  (the one place that chooses, ``dispatch``);
* :class:`ColumnStep` and the reference's pieces that the tied token table
  reuses (:func:`merged_candidates`, :func:`step_from_top_k`,
  :func:`decode_history`);
* the mesh: :class:`LeafSharding` of a leaf split over explicit mesh axes,
  :func:`map_over_shards` (per-device update in ``shard_map``) and its
  helpers.
"""

from taco_optax._src.kernels.codec import EXPONENT_DTYPE
from taco_optax._src.kernels.codec import History
from taco_optax._src.kernels.codec import decode_history
from taco_optax._src.kernels.dispatch import ENV
from taco_optax._src.kernels.dispatch import IMPLEMENTATIONS
from taco_optax._src.kernels.dispatch import Implementation
from taco_optax._src.kernels.dispatch import history_rows
from taco_optax._src.kernels.dispatch import history_step
from taco_optax._src.kernels.dispatch import resolve
from taco_optax._src.kernels.dispatch import stored_history
from taco_optax._src.kernels.mesh import LeafAxes
from taco_optax._src.kernels.mesh import LeafSharding
from taco_optax._src.kernels.mesh import MeshAxes
from taco_optax._src.kernels.mesh import all_finite
from taco_optax._src.kernels.mesh import block_start
from taco_optax._src.kernels.mesh import explicit_sharding
from taco_optax._src.kernels.mesh import first_element
from taco_optax._src.kernels.mesh import leaf_sharding_of
from taco_optax._src.kernels.mesh import local_rows
from taco_optax._src.kernels.mesh import map_over_shards
from taco_optax._src.kernels.mesh import padded_spec
from taco_optax._src.kernels.mesh import spec_entry
from taco_optax._src.kernels.mesh import with_state_sharding
from taco_optax._src.kernels.reference import ColumnStep
from taco_optax._src.kernels.reference import merged_candidates
from taco_optax._src.kernels.reference import step_from_top_k

__all__ = (
    'ENV',
    'EXPONENT_DTYPE',
    'IMPLEMENTATIONS',
    'Implementation',
    'ColumnStep',
    'History',
    'LeafAxes',
    'LeafSharding',
    'MeshAxes',
    'all_finite',
    'block_start',
    'decode_history',
    'explicit_sharding',
    'first_element',
    'history_rows',
    'history_step',
    'leaf_sharding_of',
    'local_rows',
    'map_over_shards',
    'merged_candidates',
    'padded_spec',
    'resolve',
    'spec_entry',
    'step_from_top_k',
    'stored_history',
    'with_state_sharding',
)
