"""Equinox support: TACO's routing read from the model's own modules.

Equinox stores a linear layer's weight as ``(out, in)``, the transpose of
Flax's ``(in, out)`` that :func:`taco_optax.taco` assumes by default for a
rank-2 leaf; TACO moves one weight per *input* feature, so the default would
move one per output instead. :func:`dimension_numbers` and
:func:`update_scales` read each array's axes from the ``eqx.Module`` that
holds it, for the parameters ``eqx.filter(model, eqx.is_inexact_array)``
that an optax training loop over an Equinox model hands to ``tx.init`` and
``tx.update``.

Needs Equinox: ``pip install "taco_optax[equinox]"``.

Example:

  >>> import equinox as eqx, jax
  >>> import taco_optax
  >>> from taco_optax import equinox as taco_eqx
  >>> model = eqx.nn.Linear(64, 32, key=jax.random.key(0))  # weight (32, 64)
  >>> dims = taco_eqx.dimension_numbers(model)
  >>> dims.weight
  TacoDimensionNumbers(reduction_axis=1, output_axis=0)
  >>> params = eqx.filter(model, eqx.is_inexact_array)
  >>> tx = taco_optax.taco(1e-2, weight_dimension_numbers=dims,
  ...                      update_scale=taco_eqx.update_scales(model))
  >>> state = tx.init(params)
  >>> grads = jax.tree.map(jax.numpy.ones_like, params)
  >>> updates, state = tx.update(grads, state, params)
  >>> int((updates.weight != 0).sum())  # one weight per input feature
  64
"""

from typing import Any, Mapping, Optional

from taco_optax._src import routing

try:
  import equinox as eqx
except ImportError as error:  # pragma: no cover - depends on the install
  raise ImportError(
      'taco_optax.equinox needs Equinox; install it with '
      '`pip install "taco_optax[equinox]"`.') from error

# Equinox is imported above: the module that reads its modules may now load.
from taco_optax._src.routing import equinox_routes  # pylint: disable=g-import-not-at-top,g-bad-import-order

__all__ = ('dimension_numbers', 'update_scales')


def dimension_numbers(
    model: Any, *, filter_spec: Any = eqx.is_inexact_array,
    overrides: Optional[Mapping[str, Optional[
        routing.TacoDimensionNumbers]]] = None) -> Any:
  """TACO's ``weight_dimension_numbers`` for an Equinox ``model``.

  Each array is routed by the ``eqx.Module`` that holds it:
  ``eqx.nn.Linear`` weights ``(out, in)`` (those of ``eqx.nn.MLP`` and of
  ``eqx.nn.MultiheadAttention``'s projections too) as ``reduction_axis=1``,
  ``output_axis=0``; ``eqx.nn.GRUCell`` and ``LSTMCell`` weights ``(gates *
  hidden, in)`` likewise; ``eqx.nn.Embedding`` tables ``(vocab, d)`` with
  the vocabulary as the rows: ``reduction_axis=1``, ``output_axis=0``.
  Biases, norms' weights, a ``Linear`` with a ``'scalar'`` side, vectors and
  integers go to Adam, and so do convolution kernels; an array of rank >= 2
  of any other module goes to Adam with a logged warning naming it. Layers
  stacked by ``eqx.filter_vmap`` have leading layer axes (one per vmap):
  batch axes, each layer its own matrix (a ``(layers, out, in)`` weight is
  ``reduction_axis=2``, ``output_axis=1``).

  Args:
    model: the model (an ``eqx.Module``, or a tree of them).
    filter_spec: what ``eqx.filter(model, filter_spec)`` keeps as the
      parameters given to ``tx.init`` and ``tx.update``. The default,
      ``eqx.is_inexact_array``, is what ``eqx.filter_grad`` differentiates:
      floating arrays; with ``eqx.is_array`` integer arrays are kept too (and
      sent to Adam).
    overrides: ``{pattern: TacoDimensionNumbers or None}``; an array whose
      ``'/'``-joined path (``'layers/0/weight'``) matches a pattern
      (``fnmatch``: ``'layers/*/weight'``) gets the first match's value
      instead of the rule (``None``: Adam). Every pattern must match an
      array.

  Returns:
    A tree like ``eqx.filter(model, filter_spec)`` (a tree prefix of what
    ``tx.init`` and ``tx.update`` get) whose leaves are
    :class:`taco_optax.TacoDimensionNumbers` or Adam entries, each saying
    which rule chose it (shown by :func:`taco_optax.routing_report`), for
    ``taco(..., weight_dimension_numbers=...)``. It is an ``eqx.Module``,
    hence callable: ``taco`` takes it as a tree all the same, but
    :func:`optax.inject_hyperparams` calls every callable argument as a
    schedule, so there name it (and ``update_scale``) in ``static_args``.

  Raises:
    ValueError: once, naming every array whose axes cannot be told (a known
      module's weight whose last axes are not the shape it declares) and
      every override that matches nothing.
  """
  return equinox_routes.dimension_numbers(model, filter_spec,
                                          dict(overrides or {}))


def update_scales(model: Any, *,
                  filter_spec: Any = eqx.is_inexact_array) -> Any:
  """TACO's ``update_scale`` for an Equinox ``model``: 1 for embedding tables.

  The paper updates the token embedding with scale 1 (its ``m / n =
  vocab / d`` would move every touched weight far too much); every
  ``eqx.nn.Embedding`` table gets ``1.0``, every other array ``None``
  (``m / n``).

  Args:
    model: the model.
    filter_spec: as for :func:`dimension_numbers`.

  Returns:
    A tree like ``eqx.filter(model, filter_spec)`` of ``1.0`` or ``None``,
    for ``taco(..., update_scale=...)``.
  """
  return equinox_routes.update_scales(model, filter_spec)
