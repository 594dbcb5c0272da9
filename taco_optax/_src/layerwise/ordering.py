"""How the layer-wise step orders XLA's work: true data edges.

The step frees each gradient by updating its weight as soon as it exists;
XLA is free to reorder anything without a data edge between, and would then
postpone updates (keeping gradients alive) or copy a donated weight whose
other reads are not ancestors of its update. :func:`data_dependency` adds
an edge XLA neither drops nor merges away.
"""

from typing import Any

import jax
import jax.numpy as jnp

from taco_optax._src import sharding


def data_dependency(values: jax.Array, after: Any) -> jax.Array:
  """``values + 0`` computed from ``after``: orders ``after`` first.

  A true data edge, which XLA neither drops nor lets CSE merge away (an
  ``optimization_barrier`` is lowered to a control edge on CPU and does not
  survive). E.g. XLA updates a donated weight in place only if every other
  read of it is an ancestor of the update, or else copies the weight up
  front; the input cotangent ``d_out @ W.T`` reads ``W`` without feeding the
  update, so the update is made to depend on it.
  """
  first = sharding.first_element(jax.tree.leaves(after)[0])
  first = first.astype(values.dtype)
  return values + jnp.where(jnp.isfinite(first), first, 0) * 0


def ordered_after(tree: Any, after: Any) -> Any:
  """Every leaf of ``tree`` made to depend on ``after``."""
  return jax.tree.map(lambda x: data_dependency(x, after), tree)


def ordered_after_if_sharded(tree: Any, after: Any) -> Any:
  """:func:`ordered_after` for the leaves split over explicit mesh axes
  (whose uses gather them whole); the other leaves are returned as they
  are, so no copy of an unsharded weight is made."""
  return jax.tree.map(
      lambda x: x if sharding.explicit_sharding(x) is None
      else data_dependency(x, after), tree)


def ordered_after_all(tree: Any, afters: list[Any]) -> Any:
  """:func:`ordered_after` every array of ``afters`` (one scalar edge made
  of each one's first element), not only the first."""
  total = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(afters):
    first = sharding.first_element(x).astype(jnp.float32)
    total = total + jnp.where(jnp.isfinite(first), first, 0)
  return ordered_after(tree, total)
