"""The Pallas kernel gives the reference column step's results exactly.

Without a GPU the kernel runs in Pallas interpret mode (XLA:CPU runs its
body), and its Triton lowering is checked by lowering for CUDA from here (on
jax >= 0.12 for an abstract H100: the Triton lowering reads the target GPU).
"""

import contextlib
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_optax._src.kernels import dispatch as _kernels
from taco_optax._src.kernels import pallas_kernel as _pallas_kernel
from taco_optax._src.kernels import reference as _column_step
from tests.support import kernel_cases
from tests.support import tiers
from tests.support.bitwise import assert_bitwise_equal


def _for_an_h100():
  """Lowering for an H100 from a machine without one: jax >= 0.12's Triton
  lowering asks the device, or an abstract device, for its generation."""
  device = jax.sharding.AbstractDevice(device_kind='NVIDIA H100 80GB HBM3',
                                       num_cores=132, platform='gpu')
  mesh = jax.sharding.AbstractMesh((1,), ('x',),
                                   (jax.sharding.AxisType.Explicit,),
                                   abstract_device=device)
  try:
    return jax.sharding.use_abstract_mesh(mesh)
  except TypeError:  # pragma: no cover - a jax whose meshes take no device
    return contextlib.nullcontext()


_interpreted = functools.partial(_pallas_kernel.pallas_column_step,
                                 interpret=True)
_check = functools.partial(kernel_cases.check, _interpreted)
# What taco(implementation='pallas') runs off GPU: the kernel in interpret
# mode, or the reference where the kernel cannot give the reference's bits.
_dispatched = functools.partial(_kernels.column_step, implementation='pallas')




# (rows, m, k, r, gradient dtype): every m, k and r of the brief, rows that
# do and do not fill the last program's block.
_SHAPES = [
    (1, 1, 1, 1, jnp.float32),
    (3, 7, 2, 2, jnp.bfloat16),
    (5, 7, 1, 1, jnp.float32),
    (6, 17, 16, 2, jnp.float32),
    (9, 576, 16, 2, jnp.bfloat16),
    (4, 576, 2, 1, jnp.float32),
    (11, 1536, 16, 1, jnp.float32),
    (2, 1536, 1, 1, jnp.bfloat16),
]


@pytest.mark.parametrize('n,m,k,update_topk,grad_dtype',
                         tiers.first_fast(_SHAPES))
def test_matches_reference(n, m, k, update_topk, grad_dtype):
  rng = np.random.default_rng(n * 7919 + m)
  mu = jnp.asarray(0.95, jnp.float32)
  for kind in kernel_cases.KINDS:
    values, indices, exponents = kernel_cases.history(rng, n, m, k)
    # Chained steps: the second starts from a history the step wrote.
    for _ in range(2):
      grads = jnp.asarray(kernel_cases.gradient(rng, (n, m), kind)).astype(
          grad_dtype)
      step = _check(grads, values, indices, exponents, mu, update_topk)
      values, indices, exponents = step.values, step.indices, step.exponents


@pytest.mark.parametrize('mu', [0.95, 0.0, 'array0'])
def test_python_and_array_mu(mu):
  # A Python mu is weakly typed in the reference: 1 - mu rounds once from
  # float64; for mu = 0.0 the dispatcher runs the reference (XLA folds its
  # multiply by 1).
  if mu == 'array0':
    mu = jnp.asarray(0.0, jnp.float32)
  rng = np.random.default_rng(3)
  values, indices, exponents = kernel_cases.history(rng, 5, 40, 16, np.int16)
  for kind in ('normal', 'subnormal', 'ties'):
    grads = jnp.asarray(kernel_cases.gradient(rng, (5, 40), kind))
    kernel_cases.check(_dispatched, grads, values, indices, exponents, mu, 2)


def _contains_pallas_call(function, *args):
  return 'pallas_call' in str(jax.make_jaxpr(function)(*args))


def test_kernel_runs_and_long_rows_fall_back():
  rng = np.random.default_rng(4)
  values, indices, exponents = kernel_cases.history(rng, 2, 64, 2)
  step = functools.partial(_dispatched, mu=0.9, update_topk=1)
  grads = jnp.asarray(kernel_cases.gradient(rng, (2, 64), 'normal'))
  assert _contains_pallas_call(step, grads, values, indices, exponents)
  long_grads = jnp.asarray(kernel_cases.gradient(
      rng, (1, _pallas_kernel.MAX_ROW_LENGTH + 1), 'normal'))
  values, indices, exponents = kernel_cases.history(
      rng, 1, _pallas_kernel.MAX_ROW_LENGTH + 1, 1)
  assert not _contains_pallas_call(step, long_grads, values, indices,
                                   exponents)
  kernel_cases.check(_dispatched, long_grads, values, indices, exponents, 0.9,
                     1)
  with pytest.raises(ValueError, match='rows of at most'):
    _interpreted(long_grads, values, indices, exponents, 0.9, 1)


def test_rejects_unsupported_inputs():
  values, indices, exponents = kernel_cases.history(
      np.random.default_rng(5), 2, 8, 2)
  with pytest.raises(ValueError, match='Pallas kernel takes'):
    _interpreted(jnp.zeros((2, 8), jnp.float16), values, indices, exponents,
                 0.9, 1)
  with pytest.raises(ValueError, match='Pallas kernel takes'):
    _interpreted(jnp.zeros((2, 8)), values, indices, exponents, 0.9, 3)


@pytest.mark.parametrize('m,grad_dtype', [(7, jnp.float32),
                                          (576, jnp.bfloat16),
                                          (1536, jnp.float32),
                                          (8192, jnp.bfloat16)])
def test_lowers_to_triton(m, grad_dtype):
  # Lowering for CUDA runs the Pallas Triton lowering of every primitive in
  # the kernel here, without a GPU (compiling and running it needs one).
  n, k = 40, min(16, m)
  args = (jax.ShapeDtypeStruct((n, m), grad_dtype),
          jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((n, k), jnp.int32),
          jax.ShapeDtypeStruct((n,), jnp.int8),
          jax.ShapeDtypeStruct((), jnp.float32))
  step = jax.jit(lambda *args: _pallas_kernel.pallas_column_step(*args, 2))
  with _for_an_h100():
    text = step.trace(*args).lower(lowering_platforms=('cuda',)).as_text()
  assert text.count('__gpu$xla.gpu.triton') == 1


def test_a_jax_without_the_triton_backend_refuses_pallas_by_name(monkeypatch):
  # jax deprecated the Pallas Triton backend in 0.12: a jax that drops it
  # makes implementation='pallas' one clear error, never a failed import.
  monkeypatch.delitem(sys.modules, _pallas_kernel.__name__)
  monkeypatch.delattr(sys.modules['taco_optax._src.kernels'], 'pallas_kernel',
                      raising=False)
  monkeypatch.setitem(sys.modules, 'jax.experimental.pallas.triton', None)
  monkeypatch.delattr(sys.modules['jax.experimental.pallas'], 'triton',
                      raising=False)
  rng = np.random.default_rng(3)
  values, indices, exponents = kernel_cases.history(rng, 3, 33, 2)
  grads = jnp.asarray(kernel_cases.gradient(rng, (3, 33), 'ties'))
  with pytest.raises(RuntimeError, match="needs jax's Pallas Triton backend"):
    _kernels.column_step(grads, values, indices, exponents, mu=0.95,
                         update_topk=2, implementation='pallas')


def test_selected_by_environment(monkeypatch):
  monkeypatch.setenv('TACO_OPTAX_KERNEL', 'pallas')
  implementation = _kernels.resolve(None)
  assert implementation == 'pallas'
  rng = np.random.default_rng(6)
  values, indices, exponents = kernel_cases.history(rng, 3, 33, 2)
  grads = jnp.asarray(kernel_cases.gradient(rng, (3, 33), 'ties'), jnp.bfloat16)
  step = functools.partial(_kernels.column_step, mu=0.95, update_topk=2,
                           implementation=implementation)
  args = (grads, values, indices, exponents)
  assert _contains_pallas_call(step, *args)
  assert_bitwise_equal(jax.jit(step)(*args),
                       kernel_cases.jitted(
                           _column_step.reference_column_step, 2,
                           0.95)(*args))


def test_vmap_batch_entries_are_leaves():
  # Under vmap each batch entry has its own mu and its own finite flag.
  rng = np.random.default_rng(7)
  histories = [kernel_cases.history(rng, 5, 40, 4) for _ in range(3)]
  values, indices, exponents = (jnp.stack(parts) for parts in zip(*histories))
  grads = jnp.asarray(kernel_cases.gradient(rng, (3, 5, 40), 'ties'))
  grads = grads.at[1, 2, 3].set(jnp.nan)
  mu = jnp.asarray([0.9, 0.5, 0.99], jnp.float32)
  args = (grads, values, indices, exponents, mu)
  run = lambda step: jax.jit(jax.vmap(lambda *a: step(*a, 2)))(*args)
  actual = run(_interpreted)
  expected = run(_column_step.reference_column_step)
  assert np.asarray(expected.finite).tolist() == [True, False, True]
  for field in kernel_cases.HISTORY_FIELDS:
    assert_bitwise_equal(getattr(actual, field), getattr(expected, field))
  finite = np.array([0, 2])
  for field in ('winner_indices', 'winner_signs'):
    assert_bitwise_equal(getattr(actual, field)[finite],
                         getattr(expected, field)[finite])
