"""The optax transformation: :func:`taco`, :func:`scale_by_taco`, their parts.

What the package's public face and its siblings use: the public names
(:func:`taco`, :func:`scale_by_taco`, :class:`TacoState`,
:class:`TacoDimensionNumbers`, :func:`state_shardings`,
:func:`stochastic_rounding`, :func:`routing_report`); :func:`parts_of`, the
one place that gives a ``taco(...)``'s :class:`TacoParts` (the layer-wise step
and tunix's trainer apply them by hand); each leaf's :class:`LeafPlan`; the
layout helpers of dimension numbers; and the stochastic rounding's bits, which
the layer-wise step draws at its winners exactly as the optax path does;
:mod:`jaxpr_internals`, the one reader of jaxpr internals (the tracer's and
the layer-wise step's, which reads a plain loss's blocks).
"""

from taco_optax._src.transform import jaxpr_internals
from taco_optax._src.transform.alias import taco
from taco_optax._src.transform.dimension_numbers import MatrixLayout
from taco_optax._src.transform.dimension_numbers import TacoDimensionNumbers
from taco_optax._src.transform.dimension_numbers import ToAdam
from taco_optax._src.transform.dimension_numbers import as_tuple
from taco_optax._src.transform.dimension_numbers import decided
from taco_optax._src.transform.dimension_numbers import leaf_dimension_numbers
from taco_optax._src.transform.dimension_numbers import normalize_axes
from taco_optax._src.transform.dimension_numbers import path_name
from taco_optax._src.transform.dimension_numbers import source_of
from taco_optax._src.transform.overrides import Overrides
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
from taco_optax._src.transform.state_shardings import state_shardings
from taco_optax._src.transform.trace_routing import trace_dimension_numbers
from taco_optax._src.transform.trees import is_masked
from taco_optax._src.transform.trees import unboxed

__all__ = (
    'LeafPlan',
    'MatrixLayout',
    'Overrides',
    'TacoDimensionNumbers',
    'TacoParts',
    'TacoState',
    'TacoStates',
    'Rounding',
    'ToAdam',
    'advanced',
    'as_tuple',
    'decided',
    'element_bits',
    'flat_index',
    'is_low_precision',
    'is_masked',
    'jaxpr_internals',
    'leaf_dimension_numbers',
    'leaf_histories',
    'leaf_key',
    'leaf_keys',
    'leaf_scales',
    'normalize_axes',
    'parts_of',
    'replace_init',
    'path_name',
    'rounded_update',
    'routing_report',
    'scale_by_taco',
    'source_of',
    'state_shardings',
    'stochastic_rounding',
    'taco',
    'taco_state',
    'taco_states',
    'trace_dimension_numbers',
    'unboxed',
    'with_taco_states',
)
