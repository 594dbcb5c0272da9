"""Trees of settings and of optax states: prefixes, and masked placeholders."""

from typing import Any, Callable

import jax
import optax


def per_leaf(prefix: Any, tree: Any, is_leaf: Callable[[Any], bool]
             ) -> list[Any]:
  """``prefix``'s value for every leaf of ``tree``, in ``tree``'s leaf order.

  ``is_leaf`` says which nodes of ``prefix`` are values (e.g. ``None`` and
  :class:`TacoDimensionNumbers`); a subtree of ``tree`` without leaves (an
  ``optax.MaskedNode``) gets no entry.
  """
  return jax.tree.structure(tree).flatten_up_to(
      jax.tree.broadcast(prefix, tree, is_leaf=is_leaf))


def is_masked(x: Any) -> bool:
  """Whether ``x`` is the placeholder ``optax.partition`` (and
  ``optax.masked``) leaves where a branch does not apply."""
  return isinstance(x, optax.MaskedNode)


def is_variable(x: Any) -> bool:
  """Whether ``x`` boxes one parameter (a Flax ``nnx.Variable``).

  ``nnx.Optimizer`` hands ``init`` the model's ``State`` of Variables (and
  ``update`` their bare arrays).
  """
  return callable(getattr(x, 'get_value', None))


def unboxed(tree: Any) -> Any:
  """``tree`` with each :func:`is_variable` box replaced by its value."""
  return jax.tree.map(lambda x: x.get_value() if is_variable(x) else x, tree,
                      is_leaf=is_variable)


def box_structure(params: Any) -> Any:
  """``params``' structure with each :func:`is_variable` box one leaf.

  Labels built on it make ``optax.partition`` mask whole boxes: a branch's
  state then holds ``optax.MaskedNode`` where a Variable was, not a Variable
  around a ``MaskedNode`` (which has no ``dtype``; tunix reads the dtype of
  every optimizer-state Variable). Each box holds one array, so the leaf
  order is the order of ``params``' leaves.
  """
  return jax.tree.structure(params, is_leaf=is_variable)


def without_masked_boxes(tree: Any) -> Any:
  """``tree`` with each :func:`is_variable` box that holds a placeholder
  replaced by the placeholder (the box has no array to give a ``dtype``)."""
  return jax.tree.map(
      lambda x: (optax.MaskedNode() if is_variable(x)
                 and is_masked(x.get_value()) else x),
      tree, is_leaf=is_variable)


class NotParams:
  """A leaf of the state :func:`optax.tree_utils.tree_map_params` builds,
  where the real state holds something not shaped like the params (a
  ``(k, n)`` history, a rounding counter): ``tree_map_params`` then leaves
  that part alone instead of calling the user's function on it."""

  def __repr__(self) -> str:
    return 'NotParams()'


def is_params_placeholder(params: Any) -> bool:
  """Whether ``params`` is the object :func:`optax.tree_utils.tree_map_params`
  hands ``init`` for the params: an optax pytree of no leaves (not a
  container or ``MaskedNode``), which ``init`` maps over like params."""
  return (not jax.tree.leaves(params) and not is_masked(params)
          and type(params).__module__.startswith('optax.')
          and type(params).__name__ == '_ParamsPlaceholder')
