"""The optax transformation: :func:`taco`, :func:`scale_by_taco`, their parts.

What the package's public face and its siblings use: the public names
(:func:`taco`, :func:`scale_by_taco`, :class:`TacoState`,
:func:`stochastic_rounding`, :func:`routing_report`);
:func:`parts_of`, the one place that gives a ``taco(...)``'s
:class:`TacoParts` (the layer-wise step and tunix's trainer apply them by
hand); each leaf's :class:`LeafPlan`; and the stochastic rounding's bits,
which the layer-wise step draws at its winners exactly as the optax path does.
Which leaves are matrices, and their axes, is routing's
(:mod:`taco_optax._src.routing`), where a leaf and the state live on a mesh
the sharding room's (:mod:`taco_optax._src.sharding`); :func:`routing_report`
stays here because it reports what a built ``taco(...)`` does with the leaves
(its parts and its state).
"""

from taco_optax._src.transform.alias import taco
from taco_optax._src.transform.parts import TacoParts
from taco_optax._src.transform.parts import TacoStates
from taco_optax._src.transform.parts import parts_of
from taco_optax._src.transform.parts import replace_init
from taco_optax._src.transform.parts import taco_states
from taco_optax._src.transform.parts import with_taco_states
from taco_optax._src.transform.plan import LeafPlan
from taco_optax._src.transform.plan import leaf_scales
from taco_optax._src.transform.rounding import Rounding
from taco_optax._src.transform.rounding import advanced
from taco_optax._src.transform.rounding import element_bits
from taco_optax._src.transform.rounding import flat_index
from taco_optax._src.transform.rounding import is_low_precision
from taco_optax._src.transform.rounding import leaf_key
from taco_optax._src.transform.rounding import leaf_keys
from taco_optax._src.transform.rounding import rounded_update
from taco_optax._src.transform.rounding import stochastic_rounding
from taco_optax._src.transform.routing_report import routing_report
from taco_optax._src.transform.scale import TacoState
from taco_optax._src.transform.scale import leaf_histories
from taco_optax._src.transform.scale import scale_by_taco
from taco_optax._src.transform.scale import taco_state

__all__ = (
    'LeafPlan',
    'TacoParts',
    'TacoState',
    'TacoStates',
    'Rounding',
    'advanced',
    'element_bits',
    'flat_index',
    'is_low_precision',
    'leaf_histories',
    'leaf_key',
    'leaf_keys',
    'leaf_scales',
    'parts_of',
    'replace_init',
    'rounded_update',
    'routing_report',
    'scale_by_taco',
    'stochastic_rounding',
    'taco',
    'taco_state',
    'taco_states',
    'with_taco_states',
)
