"""tunix's trainer with the layer-wise step, read in tunix's own terms.

Both modules need tunix and are imported by :mod:`taco_optax.tunix` only,
after tunix (:data:`OPTIONAL_MODULES`): ``tunix_model`` (the model's layers
as a :class:`~taco_optax.layerwise.LayeredLoss`) and ``tunix_api`` (the
trainer's hooks). Which leaves of a Flax, Linen or Equinox model are
matrices is routing's (:mod:`taco_optax._src.routing`).
"""

# Modules of this package that import an optional framework at their top:
# imported directly by the public module of that framework, never from here.
OPTIONAL_MODULES = ('tunix_model', 'tunix_api')

__all__ = (
    'OPTIONAL_MODULES',
)
