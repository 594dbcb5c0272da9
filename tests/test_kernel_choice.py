"""One place chooses what runs the column step: an argument, then the env."""

import logging

import jax
import jax.numpy as jnp
import optax
import pytest

import taco_optax
from taco_optax._src.kernels import cpu_kernel as _cpu_kernel
from taco_optax._src.kernels import dispatch as _kernels
from tests.support import layerwise_case
from tests.support import toy_lm
from tests.support.bitwise import assert_bitwise_equal

needs_kernel = pytest.mark.skipif(not _cpu_kernel.availability().ok,
                                  reason=_cpu_kernel.availability().reason)

_PARAMS = {'w': jnp.linspace(-1.0, 1.0, 64 * 48).reshape(64, 48),
           'b': jnp.zeros((48,))}


def _grads(seed):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(seed), p.shape), _PARAMS)


def _compiled_text(tx, params=_PARAMS):
  update = jax.jit(tx.update)
  return update.lower(params, tx.init(params), params).compile().as_text()


@needs_kernel
def test_argument_takes_effect_and_gives_the_same_bits():
  texts = {name: _compiled_text(taco_optax.taco(1e-2, implementation=name))
           for name in ('cpu', 'reference')}
  assert _cpu_kernel.TARGET_NAME in texts['cpu']
  assert _cpu_kernel.TARGET_NAME not in texts['reference']
  # The traced step names what it ran.
  assert 'taco_column_step_cpu' in texts['cpu']
  assert 'taco_column_step_reference' in texts['reference']
  results = []
  for name in ('cpu', 'reference'):
    tx = taco_optax.taco(1e-2, k=4, implementation=name)
    state, step = tx.init(_PARAMS), jax.jit(tx.update)
    for seed in range(3):
      updates, state = step(_grads(seed), state, _PARAMS)
    results.append((updates, state))
  assert_bitwise_equal(*results)


@needs_kernel
def test_environment_is_read_when_the_optimizer_is_built(monkeypatch):
  monkeypatch.setenv(_kernels.ENV, 'reference')
  built_under_reference = taco_optax.taco(1e-2)
  monkeypatch.setenv(_kernels.ENV, 'cpu')
  built_under_cpu = taco_optax.taco(1e-2)
  # Changing the variable later changes neither.
  monkeypatch.setenv(_kernels.ENV, 'auto')
  assert _cpu_kernel.TARGET_NAME not in _compiled_text(built_under_reference)
  assert _cpu_kernel.TARGET_NAME in _compiled_text(built_under_cpu)
  # The argument wins over the variable.
  monkeypatch.setenv(_kernels.ENV, 'reference')
  assert _cpu_kernel.TARGET_NAME in _compiled_text(
      taco_optax.taco(1e-2, implementation='cpu'))


@needs_kernel
def test_layerwise_step_runs_the_chosen_implementation():
  params = toy_lm.params(scan_layers=False, dtype=jnp.float32)
  loss = taco_optax.layerwise.LayeredLoss(
      toy_lm.embed, toy_lm.layer, toy_lm.head,
      scan_layers=False)
  batch = toy_lm.tokens(0)
  for name, expected in (('cpu', True), ('reference', False)):
    train = layerwise_case.train(loss, 1e-2, implementation=name)
    text = jax.jit(train.step).lower(
        params, train.optimizer.init(params), batch).compile().as_text()
    assert (_cpu_kernel.TARGET_NAME in text) == expected, name


@needs_kernel
def test_inject_hyperparams_keeps_the_choice():
  tx = optax.inject_hyperparams(taco_optax.taco, static_args=('k',))(
      1e-2, k=4, implementation='reference')
  assert _cpu_kernel.TARGET_NAME not in _compiled_text(tx)


@pytest.mark.parametrize('factory', [taco_optax.taco, lambda lr, **kw:
                                     taco_optax.scale_by_taco(**kw)])
def test_unknown_names_are_refused(monkeypatch, factory):
  with pytest.raises(ValueError, match=r"implementation='gpu'; expected one"):
    factory(1e-2, implementation='gpu')
  monkeypatch.setenv(_kernels.ENV, 'fast')
  with pytest.raises(ValueError, match=r"TACO_OPTAX_KERNEL='fast'"):
    factory(1e-2)


def _rows():
  return (jnp.ones((4, 32)), jnp.zeros((4, 2), jnp.float8_e4m3fn),
          jnp.zeros((4, 2), jnp.int32))


def test_unavailable_kernel_is_a_value_and_a_warning(monkeypatch, caplog):
  monkeypatch.setattr(_cpu_kernel, '_status',
                      _cpu_kernel.Availability(False, 'no compiler here'))
  monkeypatch.setattr(_kernels, '_logged', set())
  monkeypatch.setattr(jax, 'default_backend', lambda: 'cpu')
  choice = _kernels.choose('auto', *_rows(), 0.9, 1)
  assert choice == _kernels.Choice(
      'reference', 'the CPU kernel is unavailable (no compiler here)',
      fallback=True)
  with pytest.raises(RuntimeError, match='no compiler here'):
    _kernels.choose('cpu', *_rows(), 0.9, 1)
  tx = taco_optax.taco(1e-2, k=2)
  with caplog.at_level(logging.INFO, logger='taco_optax'):
    jax.jit(tx.update).lower(_PARAMS, tx.init(_PARAMS), _PARAMS)
  (record,) = caplog.records
  assert record.levelno == logging.WARNING
  assert 'no compiler here' in record.getMessage()


@needs_kernel
def test_choices_that_keep_the_references_bits(caplog):
  grads, values, indices = _rows()
  assert _kernels.choose('auto', grads, values, indices, 0.9, 1) == (
      _kernels.Choice('cpu', _kernels.choose('cpu', grads, values, indices,
                                             0.9, 1).reason))
  # A folded (1 - mu) or a dtype the kernel does not take: the reference,
  # logged as information, not a warning.
  for args in ((grads, values, indices, 0.0, 1),
               (grads.astype(jnp.float16), values, indices, 0.9, 1)):
    choice = _kernels.choose('auto', *args)
    assert (choice.implementation, choice.fallback) == ('reference', False)
  with pytest.raises(ValueError, match="implementation='cpu', but that"):
    _kernels.choose('cpu', grads.astype(jnp.float16), values, indices, 0.9, 1)
  long_rows = jnp.ones((4, 8193))
  assert _kernels.choose('pallas', long_rows, values, indices, 0.9,
                         1).implementation == 'reference'
