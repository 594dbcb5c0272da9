"""The layer-wise step from a plain loss: blocks read from the program.

``layerwise.train_step(loss_fn, tx)`` with ``loss_fn(params, batch)`` as
written for ``jax.grad``: the step equals ``jax.grad -> tx.update ->
apply_updates`` bit for bit in float32, for user-style models of each
framework (not this repository's), and refuses, naming the fix, what it
cannot read.
"""

import equinox as eqx
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax import layerwise
from tests.support import tiers
from tests.support import toy_lm

D, VOCAB, FFN, HEADS, LAYERS = 16, 32, 24, 2, 3


def _attention_mlp(x, qkv, out, up, down, scale, scale2):
  """One pre-norm decoder block on ``(batch, seq, D)``: causal attention and
  a GELU MLP, kernels stored ``(in, out)``."""
  def norm(h, s):
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * s
  b, t, _ = x.shape
  q, k, v = jnp.split(norm(x, scale) @ qkv, 3, -1)
  q, k, v = (a.reshape(b, t, HEADS, D // HEADS) for a in (q, k, v))
  s = jnp.einsum('bqhd,bkhd->bhqk', q, k) / (D // HEADS) ** 0.5
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  a = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(s), v).reshape(b, t, D)
  x = x + a @ out
  return x + jax.nn.gelu(norm(x, scale2) @ up) @ down


def _next_token_loss(logits, tokens):
  log_p = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_p, tokens[:, 1:, None], -1))


def _tokens(seed=2):
  return jax.random.randint(jax.random.key(seed), (2, 9), 0, VOCAB)


# Flax NNX: a list of blocks each under nnx.remat, or nnx.scan over them.

class _NnxBlock(nnx.Module):

  def __init__(self, rngs):
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.norm2 = nnx.RMSNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, FFN, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(FFN, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return _attention_mlp(x, self.qkv.kernel[...], self.out.kernel[...],
                          self.up.kernel[...], self.down.kernel[...],
                          self.norm.scale[...], self.norm2.scale[...])


class _NnxDecoder(nnx.Module):

  def __init__(self, *, tied, scan, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.scan = scan
    if scan:
      @nnx.vmap(in_axes=0, out_axes=0)
      def blocks(key):
        return _NnxBlock(nnx.Rngs(key))
      self.blocks = blocks(jax.random.split(jax.random.key(1), LAYERS))
    else:
      self.blocks = nnx.List([_NnxBlock(rngs) for _ in range(LAYERS)])
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.head = None if tied else nnx.Linear(D, VOCAB, use_bias=False,
                                             rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    if self.scan:
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat
      def run(x, block):
        return block(x)
      x = run(x, self.blocks)
    else:
      for block in self.blocks:
        x = nnx.remat(lambda b, x: b(x))(block, x)
    x = self.norm(x)
    return self.embed.attend(x) if self.head is None else self.head(x)


def _nnx_case(tied, scan):
  model = _NnxDecoder(tied=tied, scan=scan, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params, tokens):
    return _next_token_loss(nnx.merge(graphdef, params)(tokens[:, :-1]),
                            tokens)

  tx = taco_optax.taco(1e-2, weight_dimension_numbers=(
      taco_optax.nnx.dimension_numbers(model)))
  return loss_fn, params, tx


# Plain JAX: a dict of arrays, some kernels stored (out, in).

def _dict_params(scan):
  keys = iter(jax.random.split(jax.random.key(0), 16))
  normal = lambda *shape: jax.random.normal(next(keys), shape) / shape[-1]**.5
  stack = (LAYERS,) if scan else ()
  block = lambda: {
      'qkv': normal(*stack, D, 3 * D), 'out_t': normal(*stack, D, D),
      'up': normal(*stack, D, FFN), 'down_t': normal(*stack, D, FFN),
      'scale': jnp.ones(stack + (D,)), 'scale2': jnp.ones(stack + (D,))}
  return {'embed': normal(VOCAB, D), 'final_scale': jnp.ones((D,)),
          'head_t': normal(VOCAB, D),
          'blocks': block() if scan else [block() for _ in range(LAYERS)]}


def _dict_block(p, x):
  # out_t and down_t are stored (out, in), as PyTorch stores a Linear.
  return _attention_mlp(x, p['qkv'], p['out_t'].T, p['up'], p['down_t'].T,
                        p['scale'], p['scale2'])


def _dict_loss(scan):
  def loss_fn(params, tokens):
    x = params['embed'][tokens[:, :-1]]
    if scan:
      x, _ = jax.lax.scan(
          jax.checkpoint(lambda h, p: (_dict_block(p, h), None)), x,
          params['blocks'])
    else:
      for p in params['blocks']:
        x = jax.checkpoint(_dict_block)(p, x)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return _next_token_loss(x * params['final_scale'] @ params['head_t'].T,
                            tokens)
  return loss_fn


def _dict_case(scan):
  params = _dict_params(scan)
  lead = 1 if scan else 0
  kernel = taco_optax.TacoDimensionNumbers(lead, lead + 1)
  stored_t = taco_optax.TacoDimensionNumbers(lead + 1, lead)
  block = {'qkv': kernel, 'out_t': stored_t, 'up': kernel,
           'down_t': stored_t, 'scale': None, 'scale2': None}
  dims = {'embed': taco_optax.TacoDimensionNumbers(1, 0),
          'final_scale': None, 'head_t': taco_optax.TacoDimensionNumbers(1, 0),
          'blocks': block if scan else [block] * LAYERS}
  return _dict_loss(scan), params, taco_optax.taco(
      1e-2, weight_dimension_numbers=dims)


# Flax Linen: nn.remat blocks, or nn.scan over an nn.remat block.

class _LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, x, _=None):
    param = lambda name, shape, init=nn.initializers.lecun_normal(): (
        self.param(name, init, shape))
    ones = nn.initializers.ones
    y = _attention_mlp(x, param('qkv', (D, 3 * D)), param('out', (D, D)),
                       param('up', (D, FFN)), param('down', (FFN, D)),
                       param('scale', (D,), ones), param('scale2', (D,), ones))
    return y, None


class _LinenDecoder(nn.Module):
  scan: bool

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, D)
    x = embed(tokens)
    block = nn.remat(_LinenBlock)
    if self.scan:
      x, _ = nn.scan(block, variable_axes={'params': 0},
                     split_rngs={'params': True}, length=LAYERS)()(x, None)
    else:
      for _ in range(LAYERS):
        x, _ = block()(x)
    return embed.attend(nn.RMSNorm()(x))


def _linen_case(scan):
  module = _LinenDecoder(scan=scan)
  params = module.init(jax.random.key(0), _tokens()[:, :-1])['params']

  def loss_fn(params, tokens):
    return _next_token_loss(module.apply({'params': params},
                                         tokens[:, :-1]), tokens)

  tx = taco_optax.taco(1e-2, weight_dimension_numbers=(
      taco_optax.linen.dimension_numbers(module, _tokens()[:, :-1])))
  return loss_fn, params, tx


# Equinox: eqx.filter_checkpoint around each block.

class _EqxBlock(eqx.Module):
  qkv: jax.Array
  out: jax.Array
  up: jax.Array
  down: jax.Array
  scale: jax.Array
  scale2: jax.Array

  def __init__(self, key):
    k = jax.random.split(key, 4)
    self.qkv = jax.random.normal(k[0], (D, 3 * D)) / D ** .5
    self.out = jax.random.normal(k[1], (D, D)) / D ** .5
    self.up = jax.random.normal(k[2], (D, FFN)) / D ** .5
    self.down = jax.random.normal(k[3], (FFN, D)) / FFN ** .5
    self.scale, self.scale2 = jnp.ones((D,)), jnp.ones((D,))

  def __call__(self, x):
    return _attention_mlp(x, self.qkv, self.out, self.up, self.down,
                          self.scale, self.scale2)


class _EqxDecoder(eqx.Module):
  embed: jax.Array
  blocks: list
  head: jax.Array

  def __init__(self, key):
    keys = jax.random.split(key, LAYERS + 2)
    self.embed = jax.random.normal(keys[0], (VOCAB, D)) / D ** .5
    self.blocks = [_EqxBlock(k) for k in keys[1:-1]]
    self.head = jax.random.normal(keys[-1], (D, VOCAB)) / D ** .5

  def __call__(self, tokens):
    x = self.embed[tokens]
    for block in self.blocks:
      x = eqx.filter_checkpoint(lambda b, h: b(h))(block, x)
    return x @ self.head


def _equinox_case():
  params, static = eqx.partition(_EqxDecoder(jax.random.key(0)),
                                 eqx.is_inexact_array)

  def loss_fn(params, tokens):
    return _next_token_loss(eqx.combine(params, static)(tokens[:, :-1]),
                            tokens)

  tx = taco_optax.taco(1e-2, weight_dimension_numbers=(
      taco_optax.equinox.dimension_numbers(params)))
  return loss_fn, params, tx



class _EqxModules(eqx.Module):
  """Equinox's own layers: a vmapped eqx.nn.Embedding, tied to the head."""
  embed: eqx.nn.Embedding
  blocks: list

  def __init__(self, key):
    keys = jax.random.split(key, LAYERS + 1)
    self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
    self.blocks = [_EqxBlock(k) for k in keys[1:]]

  def __call__(self, tokens):
    x = jax.vmap(jax.vmap(self.embed))(tokens)
    for block in self.blocks:
      x = eqx.filter_checkpoint(lambda b, h: b(h))(block, x)
    return x @ self.embed.weight.T


def _equinox_modules_case():
  params, static = eqx.partition(_EqxModules(jax.random.key(0)),
                                 eqx.is_inexact_array)

  def loss_fn(params, tokens):
    return _next_token_loss(eqx.combine(params, static)(tokens[:, :-1]),
                            tokens)

  return loss_fn, params, taco_optax.taco(
      1e-2, weight_dimension_numbers=taco_optax.equinox.dimension_numbers(
          params,
          overrides={'blocks/*/[!s]*': taco_optax.TacoDimensionNumbers()}),
      update_scale=taco_optax.equinox.update_scales(params))

CASES = {
    'nnx-list-tied': lambda: _nnx_case(tied=True, scan=False),
    'nnx-list-untied': lambda: _nnx_case(tied=False, scan=False),
    'nnx-scan-tied': lambda: _nnx_case(tied=True, scan=True),
    'nnx-scan-untied': lambda: _nnx_case(tied=False, scan=True),
    'jax-dict-list': lambda: _dict_case(scan=False),
    'jax-dict-scan': lambda: _dict_case(scan=True),
    'linen-remat': lambda: _linen_case(scan=False),
    'linen-scan': lambda: _linen_case(scan=True),
    'equinox': _equinox_case,
    'equinox-modules': _equinox_modules_case,
}


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize('case', tiers.first_fast(
    sorted(CASES), fast=['equinox', 'jax-dict-scan', 'linen-remat',
                         'nnx-list-tied']))
# The step runs slices of the loss's jaxpr; a Jaxpr built without a DebugInfo
# is deprecated (jax-ml/jax#26480), so building one fails here.
@pytest.mark.filterwarnings('error:core.Jaxpr is missing a DebugInfo')
def test_equals_the_plain_optax_path_f32(case):
  loss_fn, params, tx = CASES[case]()
  got = toy_lm.assert_same_runs(
      jax.jit(toy_lm.plain_step(loss_fn, tx)),
      jax.jit(layerwise.train_step(loss_fn, tx)), params, tx,
      [_tokens(step) for step in range(3)])
  # The step moved every TACO matrix: one entry per column at a time.
  moved = [(a != b).sum() for a, b in zip(_leaves(got[0]), _leaves(params))]
  assert all(m > 0 for m in moved), moved


# Where each case's token tables sit among the outer leaves, and their d axis.
TABLES = {
    'nnx-list-tied': ((0,), (0,), 1), 'nnx-scan-tied': ((0,), (0,), 1),
    'nnx-list-untied': ((0,), (1,), 0), 'nnx-scan-untied': ((0,), (1,), 0),
    'jax-dict-list': ((0,), (2,), 1), 'jax-dict-scan': ((0,), (2,), 1),
    'linen-remat': ((0,), (0,), 1), 'linen-scan': ((0,), (0,), 1),
    'equinox': ((0,), (1,), 0),
    'equinox-modules': ((0,), (0,), 1),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_the_token_tables_are_read_as_lookup_and_projection(case):
  # The embedding's row lookup and the head's projection are recognised in
  # the program, so the step never forms the tables' dense gradients.
  loss_fn, params, _ = CASES[case]()
  traced = layerwise.layered_loss_of(loss_fn, params, _tokens())
  embed, head = traced.loss.embed, traced.loss.head
  assert isinstance(embed, layerwise.TableLookup)
  assert isinstance(head, layerwise.TableProjection)
  assert (embed.table, head.table, head.table_axis) == TABLES[case]
  outer, layers = traced.split(params)
  # The recognised pieces compute the loss's own value.
  assert float(traced.loss((outer, layers), _tokens())) == float(
      loss_fn(params, _tokens()))


def test_reads_the_blocks_and_their_parameters():
  loss_fn, params, _ = _dict_case(scan=False)
  traced = layerwise.layered_loss_of(loss_fn, params, _tokens())
  assert traced.num_blocks == LAYERS and not traced.loss.scan_layers
  outer, layers = traced.split(params)
  # The blocks' leaves in order; the embedding, head and final scale outer.
  assert len(layers) == LAYERS and all(len(l) == 6 for l in layers)
  assert len(outer) == 3
  for leaves, block in zip(layers, params['blocks']):
    assert {id(x) for x in leaves} == {id(x) for x in jax.tree.leaves(block)}
  # The loss the LayeredLoss computes is loss_fn's.
  assert float(traced.loss((outer, layers), _tokens())) == pytest.approx(
      float(loss_fn(params, _tokens())), rel=1e-6)
  scanned = layerwise.layered_loss_of(_dict_loss(True), _dict_params(True),
                                      _tokens())
  assert scanned.num_blocks == LAYERS and scanned.loss.scan_layers


def _tx():
  return taco_optax.taco(1e-2)


def _refusal(loss_fn, params):
  step = layerwise.train_step(loss_fn, _tx())
  with pytest.raises(ValueError) as raised:
    jax.eval_shape(step, params, _tx().init(params), _tokens())
  return str(raised.value)


def test_a_loss_without_blocks_is_refused_naming_how_to_mark_them():
  params = _dict_params(scan=False)

  def no_remat(params, tokens):
    x = params['embed'][tokens[:, :-1]]
    for p in params['blocks']:
      x = _dict_block(p, x)
    return _next_token_loss(x @ params['head_t'].T, tokens)

  message = _refusal(no_remat, params)
  for mark in ('jax.checkpoint', 'nnx.remat', 'nn.remat',
               'eqx.filter_checkpoint', 'scan'):
    assert mark in message, (mark, message)
  assert 'jax.jit' not in message


def test_a_jitted_loss_is_read_through_its_jit():
  # jax.jit around the loss (or inside it, as jnp.take is) only groups
  # equations: the trace opens it and finds the same blocks.
  params = _dict_params(scan=False)
  plain = layerwise.layered_loss_of(_dict_loss(False), params, _tokens())
  jitted = layerwise.layered_loss_of(jax.jit(_dict_loss(False)), params,
                                     _tokens())
  assert jitted.num_blocks == plain.num_blocks == LAYERS
  assert [len(x) for x in jitted.split(params)[1]] == [
      len(x) for x in plain.split(params)[1]]


def test_a_parameter_read_by_two_blocks_is_refused_by_name():
  params = _dict_params(scan=False)
  params['blocks'][1]['up'] = params['blocks'][0]['up']

  def shared(params, tokens):
    x = params['embed'][tokens[:, :-1]]
    blocks = params['blocks']
    x = jax.checkpoint(_dict_block)(blocks[0], x)
    x = jax.checkpoint(_dict_block)(dict(blocks[1], up=blocks[0]['up']), x)
    return _next_token_loss(x @ params['head_t'].T, tokens)

  message = _refusal(shared, params)
  assert "['blocks'][0]['up']" in message and 'its own' in message, message


def test_a_connection_that_skips_blocks_is_refused():
  params = _dict_params(scan=False)

  def skipping(params, tokens):
    x = previous = params['embed'][tokens[:, :-1]]
    for p in params['blocks']:
      x, previous = jax.checkpoint(
          lambda p, h, s: _dict_block(p, h) + s)(p, x, previous), x
    return _next_token_loss(x @ params['head_t'].T, tokens)

  message = _refusal(skipping, params)
  assert 'not handed to the next block alone' in message or (
      'skips blocks' in message), message


def test_the_head_recomputes_what_it_reads_before_the_blocks():
  # The head adds the embedding back (a skip around every block): it is
  # recomputed from the outer parameters, the step still the optax path's.
  params, tx = _dict_params(scan=False), _tx()

  def skip_to_head(params, tokens):
    x0 = x = params['embed'][tokens[:, :-1]]
    for p in params['blocks']:
      x = jax.checkpoint(_dict_block)(p, x)
    return _next_token_loss((x + x0) @ params['head_t'].T, tokens)

  expected = jax.jit(toy_lm.plain_step(skip_to_head, tx))(
      params, tx.init(params), _tokens())
  got = jax.jit(layerwise.train_step(skip_to_head, tx))(
      params, tx.init(params), _tokens())
  for a, b in zip(_leaves(got), _leaves(expected)):
    np.testing.assert_array_equal(a, b)
  # The head reads the table besides the lookup: read densely, not refused.
  traced = layerwise.layered_loss_of(skip_to_head, params, _tokens())
  assert not isinstance(traced.loss.embed, layerwise.TableLookup)


def test_blocks_of_different_programs_are_refused():
  params = _dict_params(scan=False)

  def mixed(params, tokens):
    x = params['embed'][tokens[:, :-1]]
    for i, p in enumerate(params['blocks']):
      block = _dict_block if i else (lambda p, h: 2 * _dict_block(p, h))
      x = jax.checkpoint(block)(p, x)
    return _next_token_loss(x @ params['head_t'].T, tokens)

  assert 'not the same program' in _refusal(mixed, params)


def test_a_loss_that_is_not_a_scalar_is_refused():
  params = _dict_params(scan=False)
  loss_fn = _dict_loss(scan=False)
  message = _refusal(lambda p, b: jnp.stack([loss_fn(p, b)] * 2), params)
  assert 'one scalar' in message
  with pytest.raises(TypeError, match='loss_fn'):
    layerwise.train_step('loss', _tx())


def _assert_within_float_order(got, expected):
  # Measured: at most one float32 ulp of a leaf's largest entry (a norm
  # scale's 1.19e-7 at 1.02); the bound is two.
  for a, b in zip(_leaves(got), _leaves(expected)):
    bound = 2 * np.finfo(np.float32).eps * max(np.abs(b).max(), 1e-30)
    np.testing.assert_allclose(a, b, rtol=0, atol=bound)


def test_clipping_and_accumulation_take_the_plain_loss():
  loss_fn, params, tx = _dict_case(scan=False)
  # clip_global_norm=c is optax.chain(clip_by_global_norm(c), tx).
  chain = optax.chain(optax.clip_by_global_norm(0.05), tx)
  plain = jax.jit(toy_lm.plain_step(loss_fn, chain))
  lean = jax.jit(layerwise.train_step(loss_fn, tx, clip_global_norm=0.05))
  expected, got = (params, chain.init(params)), (params, tx.init(params))
  for step in range(2):
    *expected, _ = plain(*expected, _tokens(step))
    *got, _ = lean(*got, _tokens(step))
  _assert_within_float_order(got[0], expected[0])
  # accumulation_steps=A is optax.MultiSteps(tx, A) fed the A micro-batches.
  multi = optax.MultiSteps(tx, 2)
  plain = jax.jit(toy_lm.plain_step(loss_fn, multi))
  lean = jax.jit(layerwise.train_step(loss_fn, tx, accumulation_steps=2))
  expected, got = (params, multi.init(params)), (params, tx.init(params))
  for step in range(2):
    micro = jnp.stack([_tokens(10 * step), _tokens(10 * step + 1)])
    for a in range(2):
      *expected, _ = plain(*expected, micro[a])
    *got, _ = lean(*got, micro)
  _assert_within_float_order(got[0], expected[0])
  assert any((a != b).any() for a, b in zip(_leaves(got[0]), _leaves(params)))


def _bf16(tree):
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)


# XLA may keep a 16-bit intermediate in float32 where a fusion allows
# (xla_allow_excess_precision, on by default), and which ones it keeps
# depends on the program: on the default, jax-dict-list's plain path kept
# bf16(2/3) * bf16(0.01) unrounded at one winner, whose stochastic rounding
# then landed one bf16 ulp from the layer-wise step's (1 of 21 leaves, one
# element). Both steps are compiled to round every bf16 value they compute.
_EXACT_BF16 = {'xla_allow_excess_precision': False}


@pytest.mark.parametrize('case', tiers.first_fast(
    ['jax-dict-list', 'jax-dict-scan', 'nnx-list-untied', 'nnx-scan-tied'],
    fast=['jax-dict-list', 'nnx-scan-tied'], jax_versions=['jax-dict-scan']))
def test_equals_the_plain_optax_path_bf16_stochastic_rounding(case, request):
  # 16-bit weights: every update (TACO's winners and Adam's norm scales) is
  # rounded stochastically, its bits keyed by the leaf's index in the user's
  # tree, so the step, which runs on the leaves re-laid as (outer, layers),
  # must draw each leaf's bits by its index in the user's tree.
  if case == 'jax-dict-scan' and (0, 12) <= jax.__version_info__ < (0, 12, 1):
    request.applymarker(pytest.mark.xfail(strict=True, reason=(
        'measured on jax 0.12.0.1 (XLA:CPU): the bf16 gradients of the '
        '(out, in)-stored stacked kernels (out_t, down_t) differ in float '
        'order between the two programs; their float8 histories differ from'
        ' step 0 and one winner of out_t lands elsewhere at step 2 (2 of '
        '768 entries). The hand-split step on the same (outer, layers) pair'
        ' differs from the optax path the same way. Equal on jax 0.10.2 and'
        ' 0.12.1; the (in, out) kernels and nnx-scan are equal on all '
        'three.')))
  loss_fn, params, tx = CASES[case]()
  params = _bf16(params)
  got = toy_lm.assert_same_runs(
      jax.jit(toy_lm.plain_step(loss_fn, tx), compiler_options=_EXACT_BF16),
      jax.jit(layerwise.train_step(loss_fn, tx),
              compiler_options=_EXACT_BF16), params, tx,
      [_tokens(step) for step in range(3)])
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got[0]))
  moved = [(a != b).sum() for a, b in zip(_leaves(got[0]), _leaves(params))]
  assert all(m > 0 for m in moved), moved
