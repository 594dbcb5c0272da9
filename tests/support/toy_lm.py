"""The toy language model the layer-wise tests share, and its plain path.

Three layers of ``x + tanh((x * scale) @ w_up) @ w_down`` between a token
embedding and a head tied to it (or an untied ``w_head``): every TACO matrix
kind of a decoder (embedding rows, projections, a head) at a size XLA:CPU
compiles in seconds. The tests compare the layer-wise step on it with
:func:`plain_step`, ``optax`` on ``jax.grad``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import taco_optax
from taco_optax._src.transform import parts as _alias
from tests.support.bitwise import assert_bitwise_equal

WIDTH, VOCAB, LAYERS = 16, 24, 3
# Micro-batches of one accumulated step.
MICRO = 3


def embed(outer, tokens):
  return outer['embedding'][tokens]


def layer(p, hidden, tokens):
  del tokens
  normed = hidden * p['scale']
  return hidden + jnp.tanh(normed @ p['w_up']) @ p['w_down']


def head(outer, hidden, tokens):
  logits = (hidden * outer['final_scale']) @ outer['embedding'].T
  logits = logits.astype(jnp.float32)
  targets = jnp.roll(tokens, -1, axis=-1)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def untied_head(outer, hidden, tokens):
  logits = (hidden * outer['final_scale']) @ outer['w_head']
  targets = jnp.roll(tokens, -1, axis=-1)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def params(scan_layers, dtype, seed=0):
  """Outer params and ``LAYERS`` layers (stacked when ``scan_layers``)."""
  keys = jax.random.split(jax.random.key(seed), 2 * LAYERS + 1)
  init = lambda key, shape: (jax.random.normal(key, shape) /
                             np.sqrt(shape[-2])).astype(dtype)
  outer = {'embedding': init(keys[0], (VOCAB, WIDTH)),
           'final_scale': jnp.ones((WIDTH,), dtype)}
  layers = [{'w_up': init(keys[1 + 2 * l], (WIDTH, 2 * WIDTH)),
             'w_down': init(keys[2 + 2 * l], (2 * WIDTH, WIDTH)),
             'scale': jnp.ones((WIDTH,), dtype)} for l in range(LAYERS)]
  if scan_layers:
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return outer, layers


def untied_params(scan_layers, dtype=jnp.float32):
  """:func:`params` with a head ``w_head`` of its own (``WIDTH x VOCAB``)."""
  outer, layers = params(scan_layers, dtype)
  w_head = (jax.random.normal(jax.random.key(7), (WIDTH, VOCAB))
            / 4).astype(dtype)
  return dict(outer, w_head=w_head), layers


def big_vocab_params(vocab):
  """Unstacked float32 :func:`params` with a ``vocab``-row embedding."""
  outer, layers = params(False, jnp.float32)
  outer = dict(outer, embedding=jax.random.normal(
      jax.random.key(3), (vocab, WIDTH)) / np.sqrt(WIDTH))
  return outer, layers


def matrix_dims(params_):
  """Matrices are rank 2, plus a leading layer axis when layers are stacked."""
  outer, layers = params_
  stacked = not isinstance(layers, list)
  matrix = lambda rank: lambda x: (
      taco_optax.TacoDimensionNumbers(rank - 2, rank - 1)
      if x.ndim == rank else None)
  return (jax.tree.map(matrix(2), outer),
          jax.tree.map(matrix(3 if stacked else 2), layers))


def embedding_rows_are_tokens(params_):
  """The example's layout: vocabulary as rows (``m``), features as columns."""
  outer_dims, layer_dims = matrix_dims(params_)
  outer_dims = dict(outer_dims,
                    embedding=taco_optax.TacoDimensionNumbers(1, 0))
  return outer_dims, layer_dims


def tokens(step):
  """The batch of ``step``: 4 sequences of 8 tokens."""
  return jax.random.randint(jax.random.key(100 + step), (4, 8), 0, VOCAB)


def micro_batches(step, count=MICRO):
  """``count`` micro-batches of 2 sequences: shape (count, 2, 8)."""
  keys = jax.random.split(jax.random.key(200 + step), count)
  return jnp.stack([jax.random.randint(k, (2, 8), 0, VOCAB)
                    for k in keys])


def next_token_loss(logits, tokens_):
  targets = jnp.roll(tokens_, -1, axis=-1)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def features(outer, hidden, tokens_):
  del tokens_
  return hidden * outer['final_scale']


# The embedding and the two heads as the layer-wise step's table calls.
EMBED = taco_optax.layerwise.TableLookup(
    ('embedding',), ids=lambda tokens_: tokens_,
    apply=lambda outer, rows, tokens_: rows)
TIED = taco_optax.layerwise.TableProjection(('embedding',), features,
                                            next_token_loss)
UNTIED = taco_optax.layerwise.TableProjection(
    ('w_head',), features, next_token_loss,
    project=lambda features_, kernel: features_ @ kernel, table_axis=0)


def plain_step(loss, tx):
  """One step of ``tx`` on ``jax.grad(loss)``: the path TACO must equal."""
  def step(params_, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params_, batch)
    updates, opt_state = tx.update(grads, opt_state, params_)
    return optax.apply_updates(params_, updates), opt_state, value
  return step


def assert_same_runs(plain, lean, params_, tx, batches):
  """Runs both jitted steps from ``(params_, tx.init(params_))`` over
  ``batches``; asserts equal losses at each step and bit-equal params and
  state at the end, and returns the lean step's ``(params, state)``."""
  expected = got = (params_, tx.init(params_))
  for batch in batches:
    *expected, expected_loss = plain(*expected, batch)
    *got, loss = lean(*got, batch)
    assert float(loss) == float(expected_loss)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return got


def multisteps_run(loss, tx, params_, steps, count=MICRO):
  """``MultiSteps(tx, count)`` fed each micro-batch: params and inner state.
  """
  multi = optax.MultiSteps(tx, count)
  state = multi.init(params_)

  @jax.jit
  def micro_step(params_, state, batch):
    grads = jax.grad(loss)(params_, batch)
    updates, state = multi.update(grads, state, params_)
    return optax.apply_updates(params_, updates), state

  for step in range(steps):
    for batch in micro_batches(step, count):
      params_, state = micro_step(params_, state, batch)
  return params_, state.inner_opt_state


def assert_same_step(got, expected, exact_params=True):
  """TACO history and learning-rate state bit for bit, Adam moments close.

  The vectors' gradients (hence Adam's moments) come from backward passes
  that sum in another order; TACO's winners and stored history must not
  differ at all. Without ``exact_params`` a moved weight may differ by the
  rounding of ``lr * s`` (whether XLA fuses ``p - lr * s`` into one FMA),
  far below the step ``lr * s`` a wrong winner would leave.
  """
  (got_params, got_state), (expected_params, expected_state) = (got[:2],
                                                                expected[:2])
  got_parts = _alias.taco_states(got_state)
  expected_parts = _alias.taco_states(expected_state)
  assert_bitwise_equal(got_parts.direction, expected_parts.direction)
  assert_bitwise_equal(got_parts.learning_rate, expected_parts.learning_rate)
  chex.assert_trees_all_close(got_parts.adam, expected_parts.adam, rtol=1e-5,
                              atol=1e-9)
  if exact_params:
    assert_bitwise_equal(got_params, expected_params)
  else:
    chex.assert_trees_all_close(got_params, expected_params, rtol=1e-6,
                                atol=1e-8)


def peak_bytes(fn, *args, donate=()):
  """Arguments, outputs and temporaries of ``fn``'s compiled program."""
  compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  stats = compiled.memory_analysis()
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
