"""Flax Linen support: TACO's routing read from the model's own modules.

A Linen model's parameters exist only inside ``module.init``, so
:func:`dimension_numbers` and :func:`update_scales` take the module and the
arguments of ``init`` and trace it abstractly (``jax.eval_shape``: nothing is
allocated), reading each parameter's axes from the module that creates it.

Needs Flax: ``pip install "taco_optax[flax]"``.
"""

from typing import Any, Mapping, Optional

import jax

from taco_optax._src import routing

try:
  from flax import linen as nn
except ImportError as error:  # pragma: no cover - depends on the install
  raise ImportError(
      'taco_optax.linen needs Flax; install it with '
      '`pip install "taco_optax[flax]"`.') from error

# Flax is imported above: the module that reads Linen modules may now load.
from taco_optax._src.routing import linen_routes  # pylint: disable=g-import-not-at-top,g-bad-import-order

__all__ = ('dimension_numbers', 'update_scales')


def _abstract_params(module: nn.Module, rngs: Any, init_args: tuple[Any, ...],
                     init_kwargs: Mapping[str, Any]) -> Any:
  rngs = jax.random.key(0) if rngs is None else rngs
  return linen_routes.abstract_params(module, rngs, init_args, init_kwargs)


def dimension_numbers(
    module: nn.Module, *init_args: Any, rngs: Any = None,
    overrides: Optional[Mapping[str, Optional[
        routing.TacoDimensionNumbers]]] = None,
    **init_kwargs: Any) -> Any:
  """TACO's ``weight_dimension_numbers`` for a Linen ``module``.

  Runs ``module.init(rngs, *init_args, **init_kwargs)`` under
  :func:`jax.eval_shape` and :func:`flax.linen.intercept_methods`, and routes
  each parameter by the module that creates it: ``nn.Dense`` kernels as
  ``(in, out)``; ``nn.DenseGeneral`` kernels by ``batch_dims`` (batch axes),
  ``axis`` (reduction) and ``features`` (output): ``features=(N, H)`` on
  ``(D,)`` inputs gives a ``(D, N, H)`` kernel with ``reduction_axis=0``,
  ``output_axis=(1, 2)``, ``axis=(-2, -1)`` an ``(N, H, D)`` kernel with
  ``((0, 1), 2)`` (a module declaring ``features`` and ``axis`` alike);
  ``nn.Einsum`` (and a module with an ``einsum_str``) by its einsum, as
  :func:`taco_optax.nnx.dimension_numbers` reads it; ``nn.Embed`` tables
  ``(vocab, d)`` with the vocabulary as the rows: ``reduction_axis=1``,
  ``output_axis=0``. Biases and scales (of any rank: ``DenseGeneral``'s
  ``(N, H)`` bias, a stacked ``(layers, d)`` bias), norms' parameters,
  vectors and integers go to Adam, and so do convolution kernels; a matrix
  of any other module goes to Adam with a logged warning naming it. Layers
  stacked by ``nn.scan`` or ``nn.vmap`` (nested, under ``nn.remat``, at the
  top or inside) keep their layer axis where ``variable_axes`` put it
  (``{'params': 1}``, as MaxText's ``param_scan_axis=1``, as well as ``0``):
  a batch axis, each layer its own matrix. The reading relies on Linen's
  public :func:`flax.linen.intercept_methods` and
  :class:`flax.linen.meta.AxisMetadata` (whose ``add_axis`` the stacking
  transforms call, and which this function adds inside transforms); a model
  whose code reads raw variables there (``nn.SpectralNorm``) is traced again
  without it, with a logged warning, and its stacked matrices then need
  ``overrides``.

  Args:
    module: the Linen module, unbound.
    *init_args: the arguments of ``module.init`` after its PRNG keys
      (arrays or ``jax.ShapeDtypeStruct``: only their shapes are used).
    rngs: the PRNG keys of ``module.init`` (a key, or a dict of keys by
      name); ``None`` means ``jax.random.key(0)``.
    overrides: ``{pattern: TacoDimensionNumbers or None}``; a parameter whose
      ``'/'``-joined path in ``variables['params']`` (``'layers/Dense_0/
      kernel'``) matches a pattern (``fnmatch``) gets the first match's value
      instead of the rule. Every pattern must match a parameter.
    **init_kwargs: keyword arguments of ``module.init`` (``train=False``).

  Returns:
    A tree like ``variables['params']`` (what ``tx.init`` and ``tx.update``
    get) of :class:`taco_optax.TacoDimensionNumbers` and Adam entries, each
    saying which rule chose it (shown by :func:`taco_optax.routing_report`),
    for ``taco(..., weight_dimension_numbers=...)``.

  Raises:
    ValueError: once, naming every parameter whose axes cannot be told (an
      ambiguous einsum; an axis added by something other than ``nn.scan``
      or ``nn.vmap``, such as ``nn.map_variables``) and every override that
      matches nothing.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import taco_optax
    >>> from taco_optax import linen as taco_linen
    >>> query = nn.DenseGeneral(features=(2, 4))  # kernel (8, 2, 4)
    >>> x = jnp.ones((1, 8))
    >>> dims = taco_linen.dimension_numbers(query, x)
    >>> dims['kernel']
    TacoDimensionNumbers(reduction_axis=0, output_axis=(1, 2))
    >>> dims['bias']
    ToAdam('nn.DenseGeneral bias')
    >>> params = query.init(jax.random.key(0), x)['params']
    >>> tx = taco_optax.taco(1e-3, weight_dimension_numbers=dims)
    >>> state = tx.init(params)
  """
  params, records = _abstract_params(module, rngs, init_args, init_kwargs)
  return linen_routes.dimension_numbers(params, records,
                                        dict(overrides or {}))


def update_scales(module: nn.Module, *init_args: Any, rngs: Any = None,
                  **init_kwargs: Any) -> Any:
  """TACO's ``update_scale`` for a Linen ``module``: 1 for embedding tables.

  The paper updates the token embedding with scale 1 (its ``m / n =
  vocab / d`` would move every touched weight far too much); every table
  :func:`dimension_numbers` routes as one (``nn.Embed``'s ``embedding``)
  gets ``1.0``, every other parameter ``None`` (``m / n``).

  Args:
    module: the Linen module, unbound.
    *init_args: as for :func:`dimension_numbers`.
    rngs: as for :func:`dimension_numbers`.
    **init_kwargs: as for :func:`dimension_numbers`.

  Returns:
    A tree like ``variables['params']`` of ``1.0`` or ``None``, for
    ``taco(..., update_scale=...)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import flax.linen as nn
    >>> from taco_optax import linen as taco_linen
    >>> taco_linen.update_scales(nn.Embed(10, 4), jnp.zeros((2,), jnp.int32))
    {'embedding': 1.0}
  """
  params, records = _abstract_params(module, rngs, init_args, init_kwargs)
  return linen_routes.update_scales(params, records)
