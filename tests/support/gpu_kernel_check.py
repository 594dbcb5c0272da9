"""GPU check of the Pallas column-step kernel; run by benchmarks/gpu_kernel.sh.

Not a pytest module (it needs a GPU, or ``1`` as its argument for a smoke run
in interpret mode): ``python -m tests.support.gpu_kernel_check [0|1]``. It
lives with the tests because it compares private kernels with the reference.
"""

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from taco_optax._src.kernels import pallas_kernel as _pallas_kernel
from taco_optax._src.kernels import reference as _column_step

SMOKE = sys.argv[1] == '1'
INTERPRET = SMOKE
print('jax', jax.__version__, jax.devices())


def history(rng, n, m, k):
  indices = np.stack([rng.permutation(m)[:k] for _ in range(n)])
  values = np.clip(rng.standard_normal((n, k)) * 100, -448, 448)
  values[rng.random((n, k)) < 0.2] = 0.0
  return (jnp.asarray(values.astype(ml_dtypes.float8_e4m3fn)),
          jnp.asarray(indices.astype(np.int32)),
          jnp.asarray(rng.integers(-126, 120, n).astype(np.int8)))


def gradient(rng, shape, kind):
  if kind == 'normal':
    return rng.standard_normal(shape).astype(np.float32)
  if kind == 'ties':
    levels = np.array([0.0, -0.0, 1.5, -1.5, 0.25, -0.25], np.float32)
    return rng.choice(levels, shape)
  if kind == 'zero':
    return np.where(rng.random(shape) < 0.5, 0.0, -0.0).astype(np.float32)
  if kind == 'subnormal':
    scale = rng.choice([1e-45, 1e-40, 1.2e-38, 1e-36])
    return (rng.standard_normal(shape) * scale).astype(np.float32)
  if kind == 'wide':
    exponents = rng.uniform(-30, 30, shape)
    return (rng.choice([-1.0, 1.0], shape) * 10.0**exponents).astype(np.float32)
  if kind == 'huge':
    return (rng.choice([-1.0, 1.0], shape) * 3.3e38).astype(np.float32)
  grads = rng.standard_normal(shape).astype(np.float32)
  grads[0, shape[1] // 2] = np.nan if kind == 'nan' else np.inf
  return grads


def kernel_step(r):
  return jax.jit(lambda g, v, i, e, mu: _pallas_kernel.pallas_column_step(
      g, v, i, e, mu, r, interpret=INTERPRET))


def reference_step(r):
  return jax.jit(lambda g, v, i, e, mu: _column_step.reference_column_step(
      g, v, i, e, mu, r))


def args_for(n, m, k, dtype, rng):
  grads = jnp.asarray(rng.standard_normal((n, m)), dtype)
  return (grads, *history(rng, n, m, k), jnp.float32(0.95))


print('== compile')
compile_shapes = [(64, 7, 2), (576, 576, 16), (576, 1536, 16), (64, 8192, 16)]
if SMOKE:
  compile_shapes = [(8, 7, 2), (8, 576, 16)]
for n, m, k in compile_shapes:
  for dtype in (jnp.float32, jnp.bfloat16):
    args = args_for(n, m, k, dtype, np.random.default_rng(0))
    try:
      kernel_step(2).lower(*args).compile()
      print(f'compile n={n} m={m} k={k} {dtype.__name__}: ok')
    except Exception:  # pylint: disable=broad-except
      print(f'compile n={n} m={m} k={k} {dtype.__name__}: FAILED')
      traceback.print_exc(limit=3)

print('== bitwise')
kinds = ('normal', 'ties', 'zero', 'subnormal', 'wide', 'huge', 'nan', 'inf')
cases = [(1, 1, 1, 1), (37, 7, 2, 2), (300, 576, 16, 2), (50, 1536, 16, 1),
         (9, 1536, 1, 1), (20, 8192, 16, 2)]
if SMOKE:
  cases = [(3, 7, 2, 2), (5, 576, 16, 1)]
failures = 0
for n, m, k, r in cases:
  for dtype in (jnp.float32, jnp.bfloat16):
    kernel, reference = kernel_step(r), reference_step(r)
    rng = np.random.default_rng(n + m)
    for kind in kinds:
      values, indices, exponents = history(rng, n, m, k)
      for step in range(2):
        grads = jnp.asarray(gradient(rng, (n, m), kind)).astype(dtype)
        args = (grads, values, indices, exponents, jnp.float32(0.95))
        try:
          actual = kernel(*args)
        except Exception as error:  # pylint: disable=broad-except
          print(f'bitwise n={n} m={m} k={k} r={r} {dtype.__name__} {kind}: '
                f'ERROR {type(error).__name__}: {str(error)[:300]}')
          failures += 1
          break
        expected = reference(*args)
        fields = (expected._fields if bool(expected.finite)
                  else ('values', 'exponents', 'indices', 'finite'))
        bad = [f for f in fields if np.asarray(getattr(actual, f)).tobytes()
               != np.asarray(getattr(expected, f)).tobytes()]
        if bad:
          failures += 1
          print(f'bitwise n={n} m={m} k={k} r={r} {dtype.__name__} {kind} '
                f'step {step}: DIFFERS in {bad}')
        values, indices, exponents = (expected.values, expected.indices,
                                      expected.exponents)
print(f'bitwise_failures={failures}')

print('== time')
# SmolLM2-135M in TACO's row layout, 30 layers stacked: (rows, m) per matrix.
layers = 30
shapes = {'q,o (576x576)': (2 * layers * 576, 576),
          'k,v (576x192)': (2 * layers * 576, 192),
          'gate,up (576x1536)': (2 * layers * 576, 1536),
          'down (1536x576)': (layers * 1536, 576)}
if SMOKE:
  shapes = {'small': (16, 576)}
repeats = 3 if SMOKE else 20


def timed(fn, args):
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(repeats):
    out = fn(*args)
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - start) / repeats


topk = jax.jit(lambda g: jax.lax.top_k(jnp.abs(g.astype(jnp.float32)), 16))
totals = {}
for name, (n, m) in shapes.items():
  args = args_for(n, m, 16, jnp.bfloat16, np.random.default_rng(1))
  topk_ms = timed(topk, args[:1])
  reference_ms = timed(reference_step(1), args)
  line = (f'{name} n={n} m={m}: top_k {topk_ms:.3f} ms, '
          f'reference {reference_ms:.3f} ms')
  totals['top_k'] = totals.get('top_k', 0.0) + topk_ms
  totals['reference'] = totals.get('reference', 0.0) + reference_ms
  for tile in (2048, 4096, 8192, 16384):
    _pallas_kernel._TILE_ELEMENTS = tile  # pylint: disable=protected-access
    jax.clear_caches()
    try:
      kernel_ms = timed(kernel_step(1), args)
    except Exception as error:  # pylint: disable=broad-except
      kernel_ms = float('nan')
      print(f'  tile {tile}: {type(error).__name__}: {str(error)[:200]}')
    rows = _pallas_kernel.rows_per_program(m, n)
    line += f', kernel[tile {tile}, {rows} rows] {kernel_ms:.3f} ms'
    totals[tile] = totals.get(tile, 0.0) + kernel_ms
  print(line)
tiles = [t for t in totals if isinstance(t, int) and totals[t] == totals[t]]
best = min(tiles, key=lambda t: totals[t]) if tiles else None
if best is None:
  print('no tile ran')
else:
  print(f'best_tile={best} kernel_ms={totals[best]:.3f} '
        f'top_k_ms={totals["top_k"]:.3f} '
        f'reference_ms={totals["reference"]:.3f} '
        f'kernel_over_topk={totals[best] / totals["top_k"]:.3f} '
        f'kernel_over_reference={totals[best] / totals["reference"]:.3f}')
