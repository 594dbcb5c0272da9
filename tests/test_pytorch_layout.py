"""The default routing refuses leaves the tree says are stored (out, in)
(issue 51, item 1): PyTorch / Hugging Face names and biases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taco_optax

DN = taco_optax.TacoDimensionNumbers


@pytest.mark.parametrize('params,name', [
    ({'fc': {'weight': jnp.ones((32, 64)), 'bias': jnp.zeros(32)}},
     "fc/weight \\(32, 64\\): named 'weight'"),
    ({'fc.weight': jnp.ones((32, 64)), 'fc.bias': jnp.zeros(32)},
     "fc.weight \\(32, 64\\): named 'weight'"),
    ({'embed': {'weight': jnp.ones((100, 8))}},
     "embed/weight \\(100, 8\\): named 'weight'"),
    ({'fc': {'w': jnp.ones((32, 64)), 'bias': jnp.zeros(32)}},
     'fc/w \\(32, 64\\): its bias has 32 entries, its axis 0'),
])
def test_pytorch_layout_refused_at_init_with_the_fix(params, name):
  tx = taco_optax.taco(1e-3)
  with pytest.raises(ValueError, match=(
      f'^taco\\(\\): {name}.*stored \\(out, in\\).*'
      r'TacoDimensionNumbers\(1, 0\) if x.ndim == 2 else None')):
    tx.init(params)


def test_the_fix_in_the_message_routes_out_in():
  params = {'fc': {'weight': jnp.ones((32, 64)), 'bias': jnp.zeros(32)}}
  dims = jax.tree.map(lambda x: DN(1, 0) if x.ndim == 2 else None, params)
  tx = taco_optax.taco(1e-3, weight_dimension_numbers=dims)
  grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(0),
                                                   x.shape), params)
  updates, _ = tx.update(grads, tx.init(params), params)
  moved = np.asarray(updates['fc']['weight'] != 0)
  # One weight per input (64 columns of a (32, 64) weight), at scale 32/64.
  np.testing.assert_array_equal(moved.sum(axis=0), np.ones(64))
  np.testing.assert_allclose(np.abs(updates['fc']['weight'][moved]),
                             1e-3 * 0.5)


@pytest.mark.parametrize('params', [
    {'fc': {'kernel': jnp.ones((64, 32)), 'bias': jnp.zeros(32)}},
    # A 'weight' whose bias matches axis 1 only is (in, out).
    {'fc': {'weight': jnp.ones((64, 32)), 'bias': jnp.zeros(32)}},
    {'w_in': jnp.ones((32, 64)), 'w_out': jnp.ones((32, 8))},
    {'square': {'w': jnp.ones((32, 32)), 'bias': jnp.zeros(32)}},
    {'norm': {'weight': jnp.ones((64,))}},
])
def test_flax_and_unnamed_trees_keep_the_default(params):
  taco_optax.taco(1e-3).init(params)


def test_readme_w_in_traced_as_out_in():
  def loss_fn(params, x):
    hidden = jnp.tanh(x @ params['w_in'].T)
    return jnp.mean((hidden @ params['w_out']) ** 2)

  params = {'w_in': jnp.ones((32, 64)), 'w_out': jnp.ones((32, 8))}
  dims, report = taco_optax.trace_dimension_numbers(loss_fn, params,
                                                    jnp.ones((4, 64)))
  assert (dims['w_in'].reduction_axis, dims['w_in'].output_axis) in (
      (1, 0), ((1,), (0,)))
  assert 'contracts axes (1,), keeps (0,)' in str(report)


def test_routing_report_refuses_the_same_tree():
  params = {'fc': {'weight': jnp.ones((32, 64)), 'bias': jnp.zeros(32)}}
  with pytest.raises(ValueError, match=r"fc/weight \(32, 64\): named 'weight'"):
    taco_optax.routing_report(taco_optax.taco(1e-3), params)
