"""Settings given as a tree prefix: one value for a whole subtree."""

from typing import Any, Callable

import jax


def per_leaf(prefix: Any, tree: Any, is_leaf: Callable[[Any], bool]
             ) -> list[Any]:
  """``prefix``'s value for every leaf of ``tree``, in ``tree``'s leaf order.

  ``is_leaf`` says which nodes of ``prefix`` are values (e.g. ``None`` and
  :class:`TacoDimensionNumbers`); a subtree of ``tree`` without leaves (an
  ``optax.MaskedNode``) gets no entry.
  """
  return jax.tree.structure(tree).flatten_up_to(
      jax.tree.broadcast(prefix, tree, is_leaf=is_leaf))
