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
