"""A fused projection is flagged by the tracer (issue 51, item 7).

A PyTorch-style ``(3 D, D)`` qkv weight whose product is split into q, k and
v after the matmul is three matrices stored as one: read as one, one weight
per input would move across all three, at 3x the scale. The tracer sends it
to Adam with that reason and the fix; stored ``(3, D, D)`` with the 3 axis
in front of the input's axes, it is three matrices (a batch axis).
"""

import jax.numpy as jnp
import pytest

import taco_optax

D = 8
DN = taco_optax.TacoDimensionNumbers


def _by_split(params, x):
  q, k, v = jnp.split(x @ params['qkv'].T, 3, axis=-1)
  return jnp.sum(q * k * v)


def _by_slices(params, x):
  y = x @ params['qkv'].T
  return jnp.sum(y[:, :D] * y[:, D:2 * D] * y[:, 2 * D:])


def _with_bias(params, x):
  q, k, v = jnp.split(x @ params['qkv'].T + params['qkv_bias'], 3, axis=-1)
  return jnp.sum(q * k * v)


@pytest.mark.parametrize('loss', [_by_split, _by_slices, _with_bias])
def test_fused_qkv_is_flagged_in_the_report(loss):
  params = {'qkv': jnp.ones((3 * D, D)), 'qkv_bias': jnp.zeros(3 * D)}
  dims, report = taco_optax.trace_dimension_numbers(loss, params,
                                                    jnp.ones((2, D)))
  assert dims['qkv'] is None or not dims['qkv']
  assert report.ambiguous == ('qkv',)
  text = str(report)
  assert 'splits that output axis into 3 pieces (a fused projection' in text
  assert 'Store it as 3 matrices' in text


def test_an_override_keeps_it_one_matrix():
  params = {'qkv': jnp.ones((3 * D, D))}
  dims, _ = taco_optax.trace_dimension_numbers(
      _by_split, params, jnp.ones((2, D)), overrides={'qkv': DN(1, 0)})
  assert dims['qkv'] == DN(1, 0)


def test_stored_as_three_matrices_it_is_three():
  def loss(params, x):
    q, k, v = jnp.einsum('bd,sod->sbo', x, params['qkv'])
    return jnp.sum(q * k * v)

  params = {'qkv': jnp.ones((3, D, D))}
  dims, report = taco_optax.trace_dimension_numbers(loss, params,
                                                    jnp.ones((2, D)))
  assert dims['qkv'] == DN(2, 1)
  assert not report.ambiguous


def test_a_split_along_the_batch_is_no_fused_projection():
  def loss(params, x):
    first, second = jnp.split(x @ params['w'], 2, axis=0)
    return jnp.sum(first * second)

  params = {'w': jnp.ones((D, 3 * D))}
  dims, _ = taco_optax.trace_dimension_numbers(loss, params,
                                               jnp.ones((4, D)))
  assert dims['w'] == DN(0, 1)


def test_rotary_halves_are_no_fused_projection():
  # RoPE splits q's last axis in halves and joins them again.
  def loss(params, x):
    first, second = jnp.split(x @ params['wq'], 2, axis=-1)
    cos, sin = jnp.cos(1.0), jnp.sin(1.0)
    rotated = jnp.concatenate([first * cos - second * sin,
                               second * cos + first * sin], axis=-1)
    return jnp.sum(rotated ** 2)

  params = {'wq': jnp.ones((D, 2 * D))}
  dims, report = taco_optax.trace_dimension_numbers(loss, params,
                                                    jnp.ones((2, D)))
  assert dims['wq'] == DN(0, 1), str(report)
