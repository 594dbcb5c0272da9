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

from taco_optax._src import kernels


def data_dependency(values: jax.Array, after: Any) -> jax.Array:
  """``values + 0`` computed from ``after``: orders ``after`` first.

  A true data edge, which XLA neither drops nor lets CSE merge away (an
  ``optimization_barrier`` is lowered to a control edge on CPU and does not
  survive). E.g. XLA updates a donated weight in place only if every other
  read of it is an ancestor of the update, or else copies the weight up
  front; the input cotangent ``d_out @ W.T`` reads ``W`` without feeding the
  update, so the update is made to depend on it.
  """
  first = kernels.first_element(jax.tree.leaves(after)[0])
  first = first.astype(values.dtype)
  return values + jnp.where(jnp.isfinite(first), first, 0) * 0


def ordered_after(tree: Any, after: Any) -> Any:
  """Every leaf of ``tree`` made to depend on ``after``."""
  return jax.tree.map(lambda x: data_dependency(x, after), tree)
