"""Stochastic rounding of 16-bit parameters, so that small updates land.

A bfloat16 weight of magnitude 0.02 has an ulp of 1.2e-4: rounding ``w + u``
to the nearest bfloat16 drops every ``|u| < 6e-5``, which is most of TACO's
``lr * m / n`` steps at fine-tuning rates. Rounding up or down at random, with
the probability that makes the expectation the exact float32 sum, keeps every
step on average at no memory cost:

.. math::
  \\mathrm{SR}(x) = \\begin{cases} \\lceil x \\rceil & \\text{with probability }
  (x - \\lfloor x \\rfloor) / (\\lceil x \\rceil - \\lfloor x \\rfloor) \\\\
  \\lfloor x \\rfloor & \\text{otherwise,} \\end{cases}

with floor and ceiling the neighbouring values of the parameter's dtype.

The random bits of an element are a hash of its flat index in its (whole)
parameter and of a key folded from a seed, the step count and the leaf's
position, so they do not depend on how the update is computed: the optax path
(every element) and the layer-wise step (only the winners, per layer slice,
per block of columns or per device) draw the same bits, a run is reproducible
and a resumed run equals an uninterrupted one.
"""

from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from taco_optax._src import routing

# How 16-bit parameters' updates are rounded (taco's ``rounding``).
Rounding = Literal['stochastic', 'nearest']
MODES: tuple[str, ...] = get_args(Rounding)
_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class StochasticRoundingState(NamedTuple):
  """State of :func:`stochastic_rounding`: the steps taken (``int32``)."""
  # optax's name for a step count (as ScaleByAdamState's), shadowing
  # tuple.count.
  count: jax.Array  # type: ignore[assignment]


def advanced(state: StochasticRoundingState) -> StochasticRoundingState:
  """The state after one step (an ``EmptyState``, nothing rounded, stays)."""
  if isinstance(state, optax.EmptyState):
    return state
  return StochasticRoundingState(optax.safe_increment(state.count))


def check_mode(rounding: str) -> str:
  if rounding not in MODES:
    raise ValueError(f'rounding={rounding!r}; expected one of {MODES}.')
  return rounding


def is_low_precision(dtype: Any) -> bool:
  """Whether parameters of ``dtype`` are rounded stochastically."""
  return jnp.dtype(dtype) in _LOW_PRECISION


def leaf_key(seed: int, count: jax.Array, leaf: int) -> jax.Array:
  """The ``(2,)`` ``uint32`` key of one leaf at one step."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), count),
                           leaf)
  return jax.random.key_data(key)


def leaf_keys(seed: int, count: jax.Array, num_leaves: int) -> jax.Array:
  """``(num_leaves, 2)`` ``uint32``: every leaf's :func:`leaf_key` at once.

  One vectorised ``fold_in`` instead of one per leaf: the same keys, but
  one threefry in the compiled step rather than hundreds (each is some
  hundred HLO operations XLA compiles on its own).
  """
  step = jax.random.fold_in(jax.random.key(seed), count)
  keys = jax.vmap(lambda i: jax.random.fold_in(step, i))(
      jnp.arange(num_leaves, dtype=jnp.uint32))
  return jax.random.key_data(keys)


def _mix(h: jax.Array) -> jax.Array:
  # MurmurHash3's 32-bit finaliser: every input bit flips each output bit
  # with probability close to 1/2.
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def element_bits(key: jax.Array, index: jax.Array) -> jax.Array:
  """32 random bits per flat element ``index`` (``uint32``) under ``key``."""
  index = index.astype(jnp.uint32)
  return _mix(_mix(index * jnp.uint32(0x9E3779B9) + key[0]) ^ key[1])


def flat_index(shape: tuple[int, ...], coords: list[jax.Array]) -> jax.Array:
  """The row-major flat index of ``coords`` in ``shape``, modulo ``2**32``."""
  index = jnp.zeros(jnp.broadcast_shapes(*(c.shape for c in coords)),
                    jnp.uint32)
  for size, coord in zip(shape, coords):
    index = index * jnp.uint32(size) + coord.astype(jnp.uint32)
  return index


def dense_flat_index(x: jax.Array) -> jax.Array:
  """Every element's flat index in ``x``, laid out (and sharded) like ``x``."""
  sharding = getattr(jax.typeof(x), 'sharding', None)
  mesh = getattr(sharding, 'mesh', None)
  kwargs = {}
  if mesh is not None and not getattr(mesh, 'empty', True) and any(
      axis_type == jax.sharding.AxisType.Explicit
      for axis_type in mesh.axis_types):
    kwargs = {'out_sharding': sharding}
  coords = [jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis, **kwargs)
            for axis in range(x.ndim)]
  if not coords:
    return jnp.zeros((), jnp.uint32)
  return flat_index(x.shape, coords)


def round_stochastically(target: jax.Array, dtype: Any,
                         bits: jax.Array) -> jax.Array:
  """``target`` (float32) rounded to ``dtype`` up or down, unbiased.

  The neighbour on the far side is taken with probability ``|target -
  nearest| / |far - nearest|``, read off the top 24 of ``bits``; exactly
  representable and non-finite targets round to nearest.
  """
  nearest = target.astype(dtype)
  back = nearest.astype(jnp.float32)
  infinity = jnp.asarray(jnp.inf, dtype)
  far = jnp.nextafter(nearest, jnp.where(back > target, -infinity, infinity))
  chance = jnp.abs(target - back) / jnp.abs(far.astype(jnp.float32) - back)
  uniform = (bits >> 8).astype(jnp.float32) * (2.0 ** -24)
  rounded = jnp.where(uniform < chance, far, nearest)
  return jnp.where(jnp.isfinite(target) & (back != target), rounded, nearest)


def rounded_update(param: jax.Array, delta: jax.Array,
                   bits: jax.Array) -> jax.Array:
  """The update, in ``param``'s dtype, that takes ``param`` to
  ``SR(param + delta)`` under ``optax.apply_updates``.

  ``new - param`` is exact in the 16-bit dtype whenever the step does not
  more than halve the weight (Sterbenz); otherwise (a weight crossing zero)
  ``param + update`` is the nearest value to ``SR(param + delta)`` that such
  an update reaches.
  """
  start = param.astype(jnp.float32)
  new = round_stochastically(start + delta.astype(jnp.float32), param.dtype,
                             bits)
  return (new.astype(jnp.float32) - start).astype(param.dtype)


def rounded_leaf_update(param: jax.Array, update: jax.Array,
                        key: jax.Array) -> jax.Array:
  """:func:`rounded_update` of every element of a 16-bit ``param``'s update
  (bits from the leaf's ``key``); any other update passes unchanged."""
  if not is_low_precision(param.dtype):
    return update
  return rounded_update(param, update,
                        element_bits(key, dense_flat_index(param)))


def in_float32(inner: optax.GradientTransformation
               ) -> optax.GradientTransformation:
  """``inner`` run on float32 copies of 16-bit updates and params.

  Its state is float32 too (built from float32 params), and so are the
  updates it returns (wider floats pass as they are): for 16-bit
  parameters, an Adam whose moments do not
  underflow (float16's smallest subnormal is 6e-8; a squared fine-tuning
  gradient is far below) and whose update :func:`stochastic_rounding` then
  rounds from its exact value.
  """
  as_float32 = lambda tree: jax.tree.map(
      lambda x: x.astype(jnp.float32) if is_low_precision(x.dtype) else x,
      tree)

  def init_fn(params):
    return inner.init(as_float32(params))

  def update_fn(updates, state, params=None):
    return inner.update(as_float32(updates), state,
                        None if params is None else as_float32(params))

  return optax.GradientTransformation(init_fn, update_fn)


def rounded_to_params() -> optax.GradientTransformation:
  """Casts each update to its parameter's dtype (round to nearest)."""

  def update_fn(updates, state, params=None):
    if params is None:
      return updates, state
    return jax.tree.map(
        lambda u, p: u if routing.is_masked(u) else u.astype(p.dtype), updates,
        params, is_leaf=routing.is_masked), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update_fn)


def stochastic_rounding(seed: int = 0) -> optax.GradientTransformation:
  """Rounds the updates of 16-bit parameters stochastically; put it last.

  Each update ``u`` (of any float dtype; float32 keeps it exact) of a
  bfloat16 or float16 parameter ``p`` becomes the update, in ``p``'s dtype,
  that takes ``p`` to :func:`round_stochastically` of the exact sum ``p + u``
  under :func:`optax.apply_updates`; other updates pass unchanged.

  Args:
    seed: the seed of the random bits (see the module docstring).

  Returns:
    A transformation with state :class:`StochasticRoundingState`
    (``optax.EmptyState`` when no parameter is 16-bit: nothing to count);
    its ``update`` needs ``params`` when an update is 16-bit.

  Examples:
    >>> import jax.numpy as jnp, optax, taco_optax
    >>> params = {'w': jnp.full((4096,), 0.02, jnp.bfloat16)}
    >>> tx = optax.chain(optax.sgd(1e-5), taco_optax.stochastic_rounding())
    >>> updates, _ = tx.update({'w': -jnp.ones((4096,), jnp.bfloat16)},
    ...                        tx.init(params), params)
    >>> new = optax.apply_updates(params, updates)['w']
    >>> bool((new == params['w']).all())  # not all dropped, as nearest would
    False
  """

  def init_fn(params):
    if routing.is_params_placeholder(params):
      return routing.NotParams()  # tree_map_params: no params-shaped state
    if not any(is_low_precision(jnp.result_type(p))
               for p in jax.tree.leaves(params)):
      # Nothing to round: no counter (one 'count' in the state for
      # optax.tree_utils.tree_get).
      return optax.EmptyState()
    return StochasticRoundingState(count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    leaves, treedef = jax.tree.flatten(updates, is_leaf=routing.is_masked)
    if isinstance(state, optax.EmptyState):
      if any(not routing.is_masked(u) and is_low_precision(u.dtype)
             for u in leaves):
        raise ValueError(
            'Stochastic rounding: init saw no 16-bit parameters, but these '
            'updates are 16-bit; init with the parameters you update.')
      return updates, state
    if params is None:
      if any(not routing.is_masked(u) and is_low_precision(u.dtype)
             for u in leaves):
        raise ValueError(
            'Stochastic rounding of 16-bit parameters reads them: pass '
            "params to update(), or build the optimizer with rounding="
            "'nearest'.")
      return updates, advanced(state)
    keys = leaf_keys(seed, state.count, len(leaves))
    out = [update if routing.is_masked(update)
           else rounded_leaf_update(param, update, keys[i])
           for i, (update, param) in enumerate(zip(
               leaves, treedef.flatten_up_to(params)))]
    return treedef.unflatten(out), advanced(state)

  return optax.GradientTransformation(init_fn, update_fn)
