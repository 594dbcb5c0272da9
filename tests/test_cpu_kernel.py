"""The fused CPU kernel gives the reference column step's results exactly."""

import functools
import shutil

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from taco_optax._src.kernels import cpu_kernel as _cpu_kernel
from taco_optax._src.kernels import dispatch as _kernels
from taco_optax._src.kernels import reference as _column_step
from taco_optax._src.transform import rounding as _rounding
from tests.support import kernel_cases
from tests.support.bitwise import assert_bitwise_equal

_AVAILABLE, _REASON = _cpu_kernel.availability()
needs_kernel = pytest.mark.skipif(not _AVAILABLE, reason=_REASON)

_check = functools.partial(kernel_cases.check,
                           _cpu_kernel.cpu_column_step)
# What taco(implementation='cpu') runs: the kernel, or the reference where
# only the reference gives the reference's bits.
_dispatched = functools.partial(_kernels.column_step, implementation='cpu')
_check_dispatched = functools.partial(kernel_cases.check, _dispatched)










def test_kernel_builds_and_runs():
  # Fails (not skips) when a compiler exists but the kernel silently fell back.
  if shutil.which('g++') is None:
    pytest.skip('no g++ on this machine: the reference runs instead')
  assert _AVAILABLE, _REASON
  grads = jnp.ones((4, 32), jnp.float32)
  values, indices, exponents = kernel_cases.history(
      np.random.default_rng(0), 4, 32, 16, np.int32)
  compiled = jax.jit(_cpu_kernel.cpu_column_step, static_argnums=5).lower(
      grads, values, indices, exponents, 0.95, 1).compile()
  assert _cpu_kernel.TARGET_NAME in compiled.as_text()


@needs_kernel
@hypothesis.given(
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(['normal', 'ties', 'zero', 'constant', 'subnormal',
                          'wide']),
    n=st.sampled_from([1, 3, 40]),
    m=st.sampled_from([1, 2, 3, 17, 33, 257, 600]),
    k_choice=st.sampled_from([1, 2, 16, 'm']),
    update_topk=st.sampled_from([1, 2]),
    grad_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    index_dtype=st.sampled_from([np.int32, np.int16]),
    mu=st.sampled_from([0.95, 0.0, 0.5, 0.999, 'array']),
    steps=st.integers(1, 3),
)
def test_matches_reference(seed, kind, n, m, k_choice, update_topk, grad_dtype,
                           index_dtype, mu, steps):
  k = min(m if k_choice == 'm' else k_choice, m)
  update_topk = min(update_topk, k)
  if mu == 'array':
    mu = jnp.asarray(np.random.default_rng(seed).uniform(0, 1), jnp.float32)
  rng = np.random.default_rng(seed)
  values, indices, exponents = kernel_cases.history(rng, n, m, k, index_dtype)
  # Chained steps: later ones start from a history the step itself wrote.
  # A Python mu whose 1 - mu rounds to 1 (mu=0) is folded by XLA in the
  # reference, so the kernel would flush subnormal gradients the reference
  # keeps: there the dispatcher runs the reference, and that is what is
  # checked.
  check = (_check_dispatched if _column_step.decay_folds_away(mu)
           else _check)
  for _ in range(steps):
    grads = jnp.asarray(kernel_cases.gradient(rng, (n, m), kind)).astype(
        grad_dtype)
    step = check(grads, values, indices, exponents, mu, update_topk)
    values, indices, exponents = step.values, step.indices, step.exponents


@needs_kernel
@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
def test_non_finite_gradient_keeps_history(bad, grad_dtype):
  rng = np.random.default_rng(1)
  values, indices, exponents = kernel_cases.history(rng, 8, 64, 16, np.int32)
  grads = rng.standard_normal((8, 64)).astype(np.float32)
  grads[5, 17] = bad  # one entry of one row poisons the whole leaf
  step = jax.jit(_cpu_kernel.cpu_column_step, static_argnums=5)(
      jnp.asarray(grads).astype(grad_dtype), values, indices, exponents, 0.95,
      1)
  assert not bool(step.finite)
  assert_bitwise_equal((step.values, step.indices, step.exponents),
                       (values, indices, exponents))
  _check(jnp.asarray(grads).astype(grad_dtype), values, indices, exponents,
         0.95, 1)


@needs_kernel
@pytest.mark.parametrize('m,k', [(50_000, 16), (50_000, 1), (4097, 4097)])
def test_long_rows(m, k):
  rng = np.random.default_rng(m + k)
  values, indices, exponents = kernel_cases.history(rng, 1, m, k, np.int32)
  grads = jnp.asarray(kernel_cases.gradient(rng, (1, m), 'wide'))
  _check(grads, values, indices, exponents, 0.95, 1)
  _check(grads, values, indices, exponents, 0.95, min(2, k))


@needs_kernel
@pytest.mark.parametrize('k', [1, 16, 32, 33, 100, 300])
@pytest.mark.parametrize('grad_dtype', [jnp.float32, jnp.bfloat16])
def test_floor_rises_through_the_row(k, grad_dtype):
  # A small history leaves the floor low: rows whose magnitudes grow along
  # the row put every entry into the running top k (each one raises the
  # floor), shrinking rows only the first k, and the shuffled ones in between;
  # k up to 32 keeps a sorted array, larger k a heap.
  m = 300
  rng = np.random.default_rng(k)
  ramp = np.linspace(1.0, 2.0, m, dtype=np.float32)
  rows = np.stack([ramp, -ramp[::-1], rng.permutation(ramp),
                   np.where(rng.random(m) < 0.5, -1, 1) * ramp,
                   np.repeat(ramp[::10], 10)])  # ties: equal runs of 10
  values, indices, exponents = kernel_cases.history(rng, len(rows), m, k,
                                                    np.int32)
  small = jnp.full_like(exponents, -120)  # history values near 2**-120
  grads = jnp.asarray(rows).astype(grad_dtype)
  _check(grads, values, indices, small, 0.95, 1)
  _check(grads, values, indices, small, 0.5, min(2, k))
  # A history that ranks above every entry (floor high from the start).
  _check(grads, values, indices, jnp.full_like(exponents, 10), 0.95, 1)


def _fp8_sweep_rows(top, multiplier, limit):
  """Rows of m = k = 1024 whose stored values are the f32 -> FP8 casts of a
  dense sweep and of all halfway points (and their neighbours).

  Entry 0 of each row, ``top``, fixes the row scale; the others are ``x *
  multiplier`` for sweep values ``|x| <= limit``.
  """
  codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
  finite = np.unique(np.abs(codes.astype(np.float32)))
  finite = finite[np.isfinite(finite)]
  halfway = (finite[:-1] + finite[1:]) / 2
  near = np.concatenate([np.nextafter(halfway, 0), halfway,
                         np.nextafter(halfway, np.inf)])
  dense = np.arange(0x39000000, 0x43fa0000, 1 << 12,
                    dtype=np.uint32).view(np.float32)  # 2**-13 .. 500
  sweep = np.concatenate([near, dense, finite, [464.0, 465.0, 480.0]])
  sweep = sweep[np.abs(sweep) <= limit]
  sweep = np.concatenate([sweep, -sweep]).astype(np.float32)
  rows = -(-sweep.size // 1023)
  padded = np.zeros(rows * 1023, np.float32)
  padded[:sweep.size] = sweep * np.float32(multiplier)
  return np.concatenate([np.full((rows, 1), top, np.float32),
                         padded.reshape(rows, 1023)], axis=1)


@needs_kernel
@pytest.mark.parametrize('top,multiplier,limit,codes', [
    # Row scale 2**0: entries are cast as they are (FP8 subnormals included).
    (255.0, 1.0, 255.0, 200),
    # Row scale clamped at 2**119: 256 .. 480 after scaling, clipped at 448.
    (2.0**127, 2.0**119, np.inf, 200),
    # Gradients at float32's normal limit: those below it are flushed to 0.
    (255 * 2.0**-126, 2.0**-126, 255.0, 100),
])
def test_fp8_encoding_sweep(top, multiplier, limit, codes):
  grads = jnp.asarray(_fp8_sweep_rows(top, multiplier, limit))
  n = grads.shape[0]
  values = jnp.zeros((n, 1024), jnp.float8_e4m3fn)
  indices = jnp.tile(jnp.arange(1024, dtype=jnp.int32), (n, 1))
  exponents = jnp.zeros((n,), jnp.int8)
  # mu = 0 as an array: c = g exactly, through the kernel (a Python 0.0
  # runs the reference, see test_python_zero_mu).
  step = _check(grads, values, indices, exponents, jnp.float32(0.0), 1)
  # The sweep really reaches the cast: it produces many distinct codes.
  assert len(np.unique(np.asarray(step.values).view(np.uint8))) > codes


@needs_kernel
@pytest.mark.parametrize('mu', [0.95, 0.9])
def test_one_minus_mu_is_rounded_like_the_reference(mu):
  # For these mu, f32(1 - mu) (float64 first) is not 1.0f - f32(mu).
  assert np.float32(1 - mu) != np.float32(1) - np.float32(mu)
  rng = np.random.default_rng(2)
  values, indices, exponents = kernel_cases.history(rng, 64, 128, 16, np.int32)
  grads = jnp.asarray(rng.standard_normal((64, 128)).astype(np.float32))
  _check(grads, values, indices, exponents, mu, 2)
  _check(grads, values, indices, exponents, jnp.float32(mu), 2)


@needs_kernel
def test_python_zero_mu():
  # XLA folds (1 - 0.0) * g to g, so subnormal gradients survive; the
  # kernel would flush them, so the dispatcher runs the reference.
  rng = np.random.default_rng(5)
  values, indices, exponents = kernel_cases.history(rng, 4, 40, 2, np.int32)
  grads = jnp.asarray(kernel_cases.gradient(rng, (4, 40), 'subnormal'))
  kernel_cases.check(_dispatched, grads, values, indices, exponents, 0.0, 1)
  lowered = jax.jit(_dispatched, static_argnums=(4, 5)).lower(
      grads, values, indices, exponents, 0.0, 1)
  assert _cpu_kernel.TARGET_NAME not in lowered.as_text()


@needs_kernel
def test_donated_history():
  rng = np.random.default_rng(3)
  values, indices, exponents = kernel_cases.history(rng, 32, 300, 16, np.int16)
  grads = jnp.asarray(rng.standard_normal((32, 300)).astype(np.float32))
  expected = _column_step.reference_column_step(
      grads, values, indices, exponents, 0.95, 1)
  donating = jax.jit(_cpu_kernel.cpu_column_step, static_argnums=5,
                     donate_argnums=(1, 2, 3))
  copies = jax.tree.map(jnp.copy, (values, indices, exponents))
  assert_bitwise_equal(donating(grads, *copies, 0.95, 1), expected)


@needs_kernel
def test_vmap_treats_each_entry_as_a_leaf():
  rng = np.random.default_rng(4)
  histories = [kernel_cases.history(rng, 8, 96, 16, np.int32) for _ in range(3)]
  values, indices, exponents = (jnp.stack(parts) for parts in zip(*histories))
  grads = rng.standard_normal((3, 8, 96)).astype(np.float32)
  grads[1, 2, 3] = np.nan  # only entry 1 keeps its history
  mus = jnp.asarray([0.95, 0.5, 0.0], jnp.float32)
  batched = lambda step: jax.vmap(step, in_axes=(0, 0, 0, 0, 0, None))
  expected = batched(_column_step.reference_column_step)(
      jnp.asarray(grads), values, indices, exponents, mus, 1)
  actual = jax.jit(batched(_cpu_kernel.cpu_column_step), static_argnums=5)(
      jnp.asarray(grads), values, indices, exponents, mus, 1)
  assert_bitwise_equal(actual.finite, expected.finite)
  assert list(np.asarray(actual.finite)) == [True, False, True]
  for field in _column_step.ColumnStep._fields:
    got, want = getattr(actual, field), getattr(expected, field)
    assert_bitwise_equal(got[::2], want[::2])
  assert_bitwise_equal(actual.values[1], values[1])


def test_supports():
  grads = jnp.zeros((4, 32), jnp.float32)
  values = jnp.zeros((4, 16), jnp.float8_e4m3fn)
  indices = jnp.zeros((4, 16), jnp.int32)
  assert _cpu_kernel.supports(grads, values, indices)
  assert _cpu_kernel.supports(grads.astype(jnp.bfloat16), values,
                              indices.astype(jnp.int16), update_topk=2)
  assert not _cpu_kernel.supports(grads.astype(jnp.float16), values, indices)
  assert not _cpu_kernel.supports(grads, values.astype(jnp.float32), indices)
  assert not _cpu_kernel.supports(grads, values, indices.astype(jnp.int8))
  assert not _cpu_kernel.supports(grads[:, :8], values, indices)  # k > m
  assert not _cpu_kernel.supports(grads, values, indices, update_topk=17)
  assert not _cpu_kernel.supports(grads[None], values[None], indices[None])
  long_rows = jnp.zeros((4, 2**15 + 1), jnp.bfloat16)
  assert _cpu_kernel.supports(long_rows, values, indices)
  assert not _cpu_kernel.supports(long_rows, values, indices.astype(jnp.int16))


def test_unavailable_compiler_is_reported_not_raised(monkeypatch, tmp_path):
  monkeypatch.setattr(_cpu_kernel, '_status', None)
  monkeypatch.setenv('TACO_OPTAX_CACHE_DIR', str(tmp_path))
  monkeypatch.setenv('CXX', str(tmp_path / 'no-such-compiler'))
  available, reason = _cpu_kernel.availability()
  assert not available
  assert 'no-such-compiler' in reason
  assert list(tmp_path.iterdir()) == []  # no partial library left behind


def test_cache_dir(monkeypatch, tmp_path):
  monkeypatch.delenv('TACO_OPTAX_CACHE_DIR', raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  assert _cpu_kernel.cache_dir() == tmp_path / 'taco_optax'
  monkeypatch.setenv('TACO_OPTAX_CACHE_DIR', str(tmp_path / 'mine'))
  assert _cpu_kernel.cache_dir() == tmp_path / 'mine'


# The layer-wise step's winner write.

def _scattered(weight, winners, delta, finite, column_axis):
  """What the write must equal: XLA's scatter on the weight's rows, rounded
  once to float32, and the whole weight NaN where not finite."""
  rows = weight if column_axis == 0 else weight.T
  row_ids = jnp.arange(rows.shape[0])[:, None]
  rows = rows.at[row_ids, winners].set(rows[row_ids, winners] + delta)
  written = rows if column_axis == 0 else rows.T
  return jnp.where(finite, written, jnp.nan)


@needs_kernel
@pytest.mark.parametrize('column_axis', [0, 1])
@pytest.mark.parametrize('r', [1, 3])
@pytest.mark.parametrize('finite', [True, False])
def test_winner_write_equals_scatter_bitwise(column_axis, r, finite):
  n, m = 24, 40
  key = jax.random.split(jax.random.key(column_axis * 10 + r), 3)
  shape = (n, m) if column_axis == 0 else (m, n)
  # Magnitudes from 1e-30 to 1e30, so sums round in every way.
  weight = jax.random.normal(key[0], shape) * 10.0 ** jax.random.randint(
      key[1], shape, -30, 31)
  winners = jnp.argsort(jax.random.uniform(key[2], (n, m)), axis=1)[:, :r]
  delta = (jnp.where(jnp.arange(n * r).reshape(n, r) % 3 == 0, -1.0, 1.0)
           * jnp.float32(1e-3) * jnp.float32(m / n))
  expected = _scattered(weight, winners.astype(jnp.int32), delta, finite,
                        column_axis)
  written = jax.jit(_cpu_kernel.cpu_winner_write, static_argnums=4,
                    donate_argnums=0)(jnp.copy(weight), winners, delta,
                                      jnp.asarray(finite), column_axis)
  assert_bitwise_equal(written, expected)
  if finite:  # nothing but the winners moved (a huge weight absorbs delta)
    rows = jnp.zeros((n, m), bool).at[jnp.arange(n)[:, None], winners].set(
        True)
    untouched = ~(rows if column_axis == 0 else rows.T)
    assert_bitwise_equal(written[untouched], weight[untouched])
    assert int(jnp.sum(written != weight)) > 0


def _optax_path_bf16(weight, winners, delta, finite, column_axis, key):
  """The optax path's write of a bfloat16 weight: a dense update, zero but
  at the winners, rounded by transform.rounded_leaf_update (stochastically
  with a key, else cast to bfloat16) and added by optax.apply_updates."""
  rows_shape = weight.shape if column_axis == 0 else weight.T.shape
  row_ids = jnp.arange(rows_shape[0])[:, None]
  dense = jnp.zeros(rows_shape, jnp.float32).at[row_ids, winners].set(delta)
  dense = dense if column_axis == 0 else dense.T
  dense = jnp.where(finite, dense, jnp.nan)
  update = (dense.astype(weight.dtype) if key is None else
            _rounding.rounded_leaf_update(weight, dense, key))
  return optax.apply_updates(weight, update)


def _bf16_edge_weights(key, shape):
  """bfloat16 weights from 1e-38 to 3e38, zeros of both signs, infinities,
  a NaN, and values a step of 1e-3 takes across zero."""
  keys = jax.random.split(key, 3)
  weight = (jax.random.normal(keys[0], shape) * 10.0 ** jax.random.randint(
      keys[1], shape, -38, 39).astype(jnp.float32))
  special = jnp.array([0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan, 3e-4, -3e-4,
                       1.0, 1e-40, 3.3e38], jnp.float32)
  pick = jax.random.randint(keys[2], shape, 0, 2 * special.size)
  weight = jnp.where(pick < special.size,
                     special[jnp.minimum(pick, special.size - 1)], weight)
  return weight.astype(jnp.bfloat16)


@needs_kernel
@pytest.mark.parametrize('column_axis', [0, 1])
@pytest.mark.parametrize('r', [1, 3])
@pytest.mark.parametrize('rounding', ['stochastic', 'nearest'])
@pytest.mark.parametrize('finite', [True, False])
def test_bf16_winner_write_equals_the_optax_path_bitwise(column_axis, r,
                                                         rounding, finite):
  n, m = 48, 40
  keys = jax.random.split(jax.random.key(column_axis * 10 + r), 4)
  shape = (n, m) if column_axis == 0 else (m, n)
  weight = _bf16_edge_weights(keys[0], shape)
  winners = jnp.argsort(jax.random.uniform(keys[1], (n, m)),
                        axis=1)[:, :r].astype(jnp.int32)
  # Steps from 1e-6 to 1e2, both signs: most land between two bfloat16s.
  delta = (jax.random.normal(keys[2], (n, r)) * 10.0 ** jax.random.randint(
      keys[3], (n, r), -6, 3).astype(jnp.float32))
  # A quarter of the steps take their weight three quarters of the way to
  # zero: near 1e-38 the sum is subnormal, and XLA flushes it.
  rows = weight if column_axis == 0 else weight.T
  at_winners = jnp.take_along_axis(rows, winners, axis=1).astype(jnp.float32)
  delta = jnp.where(jnp.arange(n * r).reshape(n, r) % 4 == 0,
                    -0.75 * at_winners, delta)
  key = (_rounding.leaf_key(7, jnp.int32(3), 5) if rounding == 'stochastic'
         else None)
  optax_path = jax.jit(_optax_path_bf16, static_argnums=4)
  expected = optax_path(weight, winners, delta, jnp.asarray(finite),
                        column_axis, key)
  if finite:
    # The winners as the optax path writes them; every other entry keeps its
    # bits, as the scatter does (where the optax path adds 0: -0 becomes +0,
    # subnormals flush to 0, and, rounded stochastically, inf - inf is NaN).
    hit = jnp.zeros((n, m), bool).at[jnp.arange(n)[:, None], winners].set(
        True)
    expected = jnp.where(hit if column_axis == 0 else hit.T, expected, weight)
  written = jax.jit(_cpu_kernel.cpu_winner_write, static_argnums=4,
                    donate_argnums=0)(jnp.copy(weight), winners, delta,
                                      jnp.asarray(finite), column_axis, key)
  assert written.dtype == jnp.bfloat16
  assert_bitwise_equal(written, expected)
  if finite and rounding == 'stochastic':
    # The rounding drew on the bits: some winners went to the far neighbour.
    nearest = optax_path(weight, winners, delta, jnp.asarray(finite),
                         column_axis, None)
    assert int(jnp.sum(written.view(jnp.uint16) != nearest.view(jnp.uint16))
               ) > 0


@needs_kernel
def test_winner_write_refuses_what_it_cannot_write():
  winners, delta = jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1))
  with pytest.raises(ValueError, match='float32 or bfloat16'):
    _cpu_kernel.cpu_winner_write(jnp.zeros((3, 4), jnp.float16), winners,
                                 delta, True, 0)
  with pytest.raises(ValueError, match='bfloat16 only'):
    _cpu_kernel.cpu_winner_write(jnp.zeros((3, 4)), winners, delta, True, 0,
                                 jnp.zeros((2,), jnp.uint32))


@needs_kernel
def test_winner_write_keeps_an_undonated_weight():
  weight = jnp.arange(12.0).reshape(3, 4)
  write = jax.jit(lambda w: (_cpu_kernel.cpu_winner_write(
      w, jnp.array([[1], [0], [3]]), jnp.ones((3, 1)), True, 0), w))
  written, kept = write(weight)
  np.testing.assert_array_equal(kept, np.arange(12.0).reshape(3, 4))
  np.testing.assert_array_equal(np.asarray(written) - np.asarray(kept),
                                np.eye(4)[[1, 0, 3]])


@needs_kernel
def test_winner_write_refuses_a_winner_out_of_range():
  with pytest.raises(Exception, match='winner range'):
    jax.block_until_ready(_cpu_kernel.cpu_winner_write(
        jnp.zeros((3, 4)), jnp.array([[1], [4], [0]]), jnp.ones((3, 1)),
        True, 0))


def test_winner_write_runs_where_the_kernel_may():
  args = (jnp.zeros((3, 4)), jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1)),
          True, 0)
  assert _kernels.winner_write(*args, 'reference') is None
  # float16 weights, and a rounding key for a float32 weight, are scattered.
  assert _kernels.winner_write(jnp.zeros((3, 4), jnp.float16),
                               *args[1:], 'auto') is None
  assert _kernels.winner_write(*args, 'auto',
                               jnp.zeros((2,), jnp.uint32)) is None
  assert (_kernels.winner_write(jnp.zeros((3, 4), jnp.bfloat16), *args[1:],
                                'auto', jnp.zeros((2,), jnp.uint32)) is None
          ) == (not _AVAILABLE)
  assert (_kernels.winner_write(*args, 'auto') is None) == (not _AVAILABLE)
