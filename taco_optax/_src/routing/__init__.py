"""Routing: which leaves are TACO's matrices, and along which axes.

A parameter is a matrix when its dimension numbers say which axes are the
paper's columns (reduction) and rows (output); every other leaf goes to Adam.
This room decides that, and nothing else; the transformation
(:mod:`taco_optax._src.transform`) reads its answer. What its siblings use:

* the dimension numbers and their layout (:class:`TacoDimensionNumbers`,
  :class:`MatrixLayout`, :func:`normalize_axes`, :func:`matrix_layout`), an
  entry's provenance (:func:`decided`, :func:`source_of`, :class:`ToAdam`)
  and a tree's entries (:func:`resolve`, :func:`entries`,
  :func:`leaf_dimension_numbers`);
* the default rule and its checks (:func:`rank2_matrices`,
  :func:`checked_init`, :func:`framework_of`, :data:`HELPERS`);
* the routing helpers' overrides (:class:`Overrides`) and the tracer
  (:func:`trace_dimension_numbers`, reading the jaxpr through
  :mod:`jaxpr_internals`, the one reader of jaxpr internals: the tracer's and
  the layer-wise step's, which reads a plain loss's blocks);
* an einsum's axes (:func:`weight_dimension_numbers`,
  :func:`lora_dimension_numbers`);
* trees of settings and of states: a prefix's value per leaf
  (:func:`per_leaf`), optax's masked placeholders (:func:`is_masked`), Flax
  NNX Variables (:func:`unboxed`, :func:`box_structure`,
  :func:`without_masked_boxes`) and ``tree_map_params``'s placeholders
  (:class:`NotParams`, :func:`is_params_placeholder`).

The framework readers need an optional framework and are imported by their
public module only, after that framework (:data:`OPTIONAL_MODULES`):
``nnx_routes`` (Flax NNX; by :mod:`taco_optax.nnx`), ``linen_routes`` (Flax
Linen; by :mod:`taco_optax.linen`) and ``equinox_routes`` (Equinox; by
:mod:`taco_optax.equinox`).
"""

from taco_optax._src.routing import jaxpr_internals
from taco_optax._src.routing.default_routing import HELPERS
from taco_optax._src.routing.default_routing import checked_init
from taco_optax._src.routing.default_routing import framework_of
from taco_optax._src.routing.dimension_numbers import MatrixLayout
from taco_optax._src.routing.dimension_numbers import TacoDimensionNumbers
from taco_optax._src.routing.dimension_numbers import ToAdam
from taco_optax._src.routing.dimension_numbers import WeightDimNumOrFn
from taco_optax._src.routing.dimension_numbers import as_tuple
from taco_optax._src.routing.dimension_numbers import decided
from taco_optax._src.routing.dimension_numbers import entries
from taco_optax._src.routing.dimension_numbers import is_tree_of
from taco_optax._src.routing.dimension_numbers import leaf_dimension_numbers
from taco_optax._src.routing.dimension_numbers import matrix_layout
from taco_optax._src.routing.dimension_numbers import normalize_axes
from taco_optax._src.routing.dimension_numbers import path_name
from taco_optax._src.routing.dimension_numbers import rank2_matrices
from taco_optax._src.routing.dimension_numbers import resolve
from taco_optax._src.routing.dimension_numbers import source_of
from taco_optax._src.routing.einsum import AmbiguousEinsum
from taco_optax._src.routing.einsum import lora_dimension_numbers
from taco_optax._src.routing.einsum import weight_dimension_numbers
from taco_optax._src.routing.einsum import weight_rank
from taco_optax._src.routing.overrides import Overrides
from taco_optax._src.routing.trace_routing import trace_dimension_numbers
from taco_optax._src.routing.trees import NotParams
from taco_optax._src.routing.trees import box_structure
from taco_optax._src.routing.trees import is_masked
from taco_optax._src.routing.trees import is_params_placeholder
from taco_optax._src.routing.trees import per_leaf
from taco_optax._src.routing.trees import unboxed
from taco_optax._src.routing.trees import without_masked_boxes

# Modules of this package that import an optional framework at their top:
# imported directly by the public module of that framework, never from here.
OPTIONAL_MODULES = ('nnx_routes', 'linen_routes', 'equinox_routes')

__all__ = (
    'HELPERS',
    'OPTIONAL_MODULES',
    'AmbiguousEinsum',
    'MatrixLayout',
    'NotParams',
    'Overrides',
    'TacoDimensionNumbers',
    'ToAdam',
    'WeightDimNumOrFn',
    'as_tuple',
    'box_structure',
    'checked_init',
    'decided',
    'entries',
    'framework_of',
    'is_masked',
    'is_params_placeholder',
    'is_tree_of',
    'jaxpr_internals',
    'leaf_dimension_numbers',
    'lora_dimension_numbers',
    'matrix_layout',
    'normalize_axes',
    'path_name',
    'per_leaf',
    'rank2_matrices',
    'resolve',
    'source_of',
    'trace_dimension_numbers',
    'unboxed',
    'weight_dimension_numbers',
    'weight_rank',
    'without_masked_boxes',
)
