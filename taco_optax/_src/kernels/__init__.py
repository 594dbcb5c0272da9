"""TACO's column step on rows, and what runs it.

The kernels work on *rows*: ``(N, m)`` arrays whose row ``i`` holds the ``m``
candidates of one of the paper's columns. They know nothing of parameters'
layouts or of optax: the transformation reshapes a leaf to rows and hands
them here. What its siblings use:

* :func:`history_step`: one step of a leaf's stored ``batch + (k, n)``
  history on its gradient rows, by the implementation :func:`resolve` names
  (the one place that chooses, ``dispatch``), and :func:`winner_write`, the
  layer-wise step's write of a leaf's winners by the CPU kernel where it runs;
* :class:`ColumnStep` and the reference's pieces that the tied token table
  reuses (:func:`merged_candidates`, :func:`step_from_top_k`,
  :func:`decode_history`);
* the step on a leaf split over an explicit mesh: :func:`map_over_shards`
  (per-device update in ``shard_map``) and :func:`all_finite`. Where the
  leaf's blocks live is the sharding room's (:mod:`taco_optax._src.sharding`).
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
from taco_optax._src.kernels.dispatch import winner_write
from taco_optax._src.kernels.reference import ColumnStep
from taco_optax._src.kernels.reference import merged_candidates
from taco_optax._src.kernels.reference import step_from_top_k
from taco_optax._src.kernels.sharded_step import all_finite
from taco_optax._src.kernels.sharded_step import map_over_shards

__all__ = (
    'ENV',
    'EXPONENT_DTYPE',
    'IMPLEMENTATIONS',
    'Implementation',
    'ColumnStep',
    'History',
    'all_finite',
    'decode_history',
    'history_rows',
    'history_step',
    'map_over_shards',
    'merged_candidates',
    'resolve',
    'step_from_top_k',
    'stored_history',
    'winner_write',
)
