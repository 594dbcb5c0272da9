"""taco_optax.equinox: TACO's axes read from real Equinox models.

Each test builds a small model, routes it, runs one ``taco`` update and
checks the update itself against axes written here by hand (Equinox stores
a linear weight as ``(out, in)``: the input features are axis 1).
"""

import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax._src.routing import ToAdam
from taco_optax._src.routing import source_of
from tests.support.routing_checks import assert_adam_dense
from tests.support.routing_checks import assert_one_per_input

eqx = pytest.importorskip('equinox')
taco_eqx = importlib.import_module('taco_optax.equinox')

DN = taco_optax.TacoDimensionNumbers
LR = 1e-2


def _keys(n, seed=0):
  return jax.random.split(jax.random.key(seed), n)


def _params(model):
  return eqx.filter(model, eqx.is_inexact_array)


def _random_grads(params, seed=1):
  rng = np.random.default_rng(seed)  # numpy: no program to compile
  return jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)


def _update(tx, params, grads=None):
  """One step's updates (random normal gradients unless given); one jit
  compiles faster than the update's many eager ops."""
  grads = _random_grads(params) if grads is None else grads
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  return updates


def _routed_update(model, grads=None, overrides=None):
  """One ``taco`` step on ``model`` routed by the helper."""
  tx = taco_optax.taco(
      LR, weight_dimension_numbers=taco_eqx.dimension_numbers(
          model, overrides=overrides),
      update_scale=taco_eqx.update_scales(model))
  return _update(tx, _params(model), grads)


def test_linear_64_32_moves_one_weight_per_input_feature():
  model = eqx.nn.Linear(64, 32, key=jax.random.key(0))  # weight (32, 64)
  dims = taco_eqx.dimension_numbers(model)
  assert dims.weight == DN(reduction_axis=1, output_axis=0)
  assert isinstance(dims.bias, ToAdam)
  assert source_of(dims.weight) == 'eqx.nn.Linear weight (out, in)'
  assert source_of(dims.bias) == 'eqx.nn.Linear bias'
  updates = _routed_update(model)
  assert_one_per_input(updates.weight, reduction=1, output=0,
                       learning_rate=LR, name='weight')  # |u| = lr * 32 / 64
  assert np.count_nonzero(np.asarray(updates.weight)) == 64
  assert_adam_dense(updates.bias, name='bias')


def test_flax_axes_would_move_one_weight_per_output():
  # The trap: taco's default reads a rank-2 leaf as Flax (in, out);
  # on Equinox modules it now refuses, naming this helper.
  model = eqx.nn.Linear(64, 32, key=jax.random.key(0))
  params = _params(model)
  with pytest.raises(ValueError,
                     match=r'taco_optax\.equinox\.dimension_numbers\(model\)'):
    taco_optax.taco(LR).init(params)
  flax_axes = jax.tree.map(lambda x: DN() if x.ndim == 2 else None, params)
  updates = _update(taco_optax.taco(LR, weight_dimension_numbers=flax_axes),
                    params)
  assert np.count_nonzero(np.asarray(updates.weight)) == 32


def test_mlp_with_gradients_of_a_real_loss():
  model = eqx.nn.MLP(8, 4, width_size=16, depth=1, key=jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (5, 8))
  y = jax.random.normal(jax.random.key(2), (5, 4))

  @eqx.filter_jit
  @eqx.filter_grad
  def grads(model):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)

  updates = _routed_update(model, grads(model))
  assert updates.layers[0].weight.shape == (16, 8)
  assert_one_per_input(updates.layers[0].weight, 1, 0, LR, name='layers/0')
  assert_one_per_input(updates.layers[1].weight, 1, 0, LR, name='layers/1')
  assert_adam_dense(updates.layers[0].bias, name='layers/0/bias')
  assert_adam_dense(updates.layers[1].bias, name='layers/1/bias')


class _Block(eqx.Module):
  """A tiny transformer block: table, attention, norm, vocabulary head."""
  embed: eqx.nn.Embedding
  attn: eqx.nn.MultiheadAttention
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, 3)
    self.embed = eqx.nn.Embedding(50, 16, key=keys[0])  # (vocab, d)
    self.attn = eqx.nn.MultiheadAttention(
        num_heads=2, query_size=16, qk_size=4, vo_size=4, key=keys[1])
    self.norm = eqx.nn.LayerNorm(16)
    self.head = eqx.nn.Linear(16, 50, key=keys[2])

  def __call__(self, tokens):
    h = jax.vmap(self.embed)(tokens)
    h = h + self.attn(h, h, h)
    return jax.vmap(self.head)(jax.vmap(self.norm)(h))


def _block_loss(model, tokens):
  logits = model(tokens[:-1])
  return -jnp.mean(jnp.take_along_axis(
      jax.nn.log_softmax(logits), tokens[1:, None], axis=-1))


def test_transformer_block_routes_each_module_by_its_layout():
  model = _Block(jax.random.key(0))
  tokens = jnp.arange(0, 50, 3)  # 17 distinct tokens
  grads = eqx.filter_jit(eqx.filter_grad(_block_loss))(model, tokens)
  updates = _routed_update(model, grads)
  # Only the looked-up rows have a gradient; still one row per feature,
  # moved by the table's scale 1, not m / n = 50 / 16.
  assert_one_per_input(updates.embed.weight, 1, 0, LR, scale=1.0,
                       name='embed')
  rows = np.flatnonzero(np.abs(np.asarray(updates.embed.weight)).sum(1))
  assert set(rows) <= set(np.asarray(tokens[:-1]).tolist())
  for name in ('query_proj', 'key_proj', 'value_proj', 'output_proj'):
    weight = getattr(updates.attn, name).weight  # (8, 16); output (16, 8)
    assert_one_per_input(weight, 1, 0, LR, name=name)
  assert_one_per_input(updates.head.weight, 1, 0, LR, name='head')
  for name, update in (('norm/weight', updates.norm.weight),
                       ('norm/bias', updates.norm.bias),
                       ('head/bias', updates.head.bias)):
    assert_adam_dense(update, name=name)


def test_update_scales_give_tables_scale_one():
  model = _Block(jax.random.key(0))
  scales = taco_eqx.update_scales(model)
  assert scales.embed.weight == 1.0
  assert scales.head.weight is None and scales.attn.query_proj.weight is None
  is_none = lambda x: x is None
  assert jax.tree.structure(scales, is_leaf=is_none) == jax.tree.structure(
      _params(model), is_leaf=is_none)


def _stacked_linear(stack):
  """``Linear(8, 4)`` layers made by one ``eqx.filter_vmap`` per axis."""
  make = lambda key: eqx.nn.Linear(8, 4, key=key)  # weight (4, 8)
  for _ in stack:
    make = eqx.filter_vmap(make)
  return make(jax.random.split(jax.random.key(0), np.prod(stack)).reshape(
      stack))


def test_filter_vmap_stacked_layers_are_batch_axes():
  nested = _stacked_linear((2, 3))
  model = {'layers': jax.tree.map(lambda x: x[0], nested), 'nested': nested}
  assert model['layers'].weight.shape == (3, 4, 8)
  assert model['nested'].weight.shape == (2, 3, 4, 8)
  dims = taco_eqx.dimension_numbers(model)
  assert dims['layers'].weight == DN(2, 1)
  assert source_of(dims['nested'].weight).endswith(
      'stacked: batch axis (0, 1)')
  updates = _routed_update(model)
  assert_one_per_input(updates['layers'].weight, reduction=2, output=1,
                       learning_rate=LR, name='layers/weight')
  assert_one_per_input(updates['nested'].weight, reduction=3, output=2,
                       learning_rate=LR, name='nested/weight')
  assert_adam_dense(updates['layers'].bias, name='layers/bias')
  assert_adam_dense(updates['nested'].bias, name='nested/bias')


def test_gru_cell_weights_are_out_in_matrices():
  model = eqx.nn.GRUCell(16, 8, key=jax.random.key(0))
  updates = _routed_update(model)
  assert_one_per_input(updates.weight_ih, 1, 0, LR, name='weight_ih')
  assert_one_per_input(updates.weight_hh, 1, 0, LR, name='weight_hh')
  assert_adam_dense(updates.bias, name='bias')


def test_tied_and_weight_normed_layers_route_by_their_inner_modules():
  keys = _keys(3)
  table = eqx.nn.Embedding(20, 8, key=keys[0])
  head = eqx.nn.Linear(8, 20, use_bias=False, key=keys[1])
  tied = eqx.nn.Shared((table, head), where=lambda p: p[1].weight,
                       get=lambda p: p[0].weight)
  dims = taco_eqx.dimension_numbers(tied)  # one array: the table
  assert dims.pytree[0].weight == DN(1, 0)
  assert taco_eqx.update_scales(tied).pytree[0].weight == 1.0
  normed = eqx.nn.WeightNorm(eqx.nn.Linear(8, 4, key=keys[2]))
  dims = taco_eqx.dimension_numbers(normed)
  assert dims.layer.weight == DN(1, 0)  # the direction v, (out, in)
  assert source_of(dims.g) == 'eqx.nn.WeightNorm g'  # (out, 1) magnitudes


class _ConvNet(eqx.Module):
  conv: eqx.nn.Conv2d
  out: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(3, 4, kernel_size=3, key=keys[0])
    self.out = eqx.nn.Linear(4, 2, key=keys[1])


def test_convolutions_go_to_adam_saying_why():
  model = _ConvNet(jax.random.key(0))
  dims = taco_eqx.dimension_numbers(model)
  assert isinstance(dims.conv.weight, ToAdam)
  reason = source_of(dims.conv.weight)
  assert 'eqx.nn.Conv2d' in reason and 'conv/weight' in reason, reason
  assert 'convolution' in reason
  updates = _routed_update(model)
  assert_adam_dense(updates.conv.weight, name='conv/weight')
  assert_one_per_input(updates.out.weight, 1, 0, LR, name='out')
  params = _params(model)
  report = taco_optax.routing_report(
      taco_optax.taco(LR, weight_dimension_numbers=dims), params)
  row, = [r for r in report.rows if r.path == 'conv/weight']
  assert row.route == 'adam' and 'Conv2d' in row.why, row


class _WithTable(eqx.Module):
  pos: jax.Array  # a matrix of a module without a rule
  proj: eqx.nn.Linear

  def __init__(self, key):
    self.pos = jax.random.normal(key, (6, 8))
    self.proj = eqx.nn.Linear(8, 4, key=key)


def test_unknown_matrices_go_to_adam_with_a_warning(caplog):
  model = _WithTable(jax.random.key(0))
  with caplog.at_level(logging.WARNING, logger='taco_optax'):
    dims = taco_eqx.dimension_numbers(model)
  assert isinstance(dims.pos, ToAdam)
  assert '_WithTable pos: no TACO rule' in source_of(dims.pos)
  assert '1 parameter(s) of rank >= 2 go to Adam' in caplog.text
  assert ': pos.' in caplog.text and 'overrides=' in caplog.text
  updates = _routed_update(model)
  assert_adam_dense(updates.pos, name='pos')


def test_overrides_route_by_path_pattern():
  model = _WithTable(jax.random.key(0))
  dims = taco_eqx.dimension_numbers(
      model, overrides={'pos': DN(1, 0), 'proj/*': None})
  assert dims.pos == DN(1, 0) and "override 'pos'" in source_of(dims.pos)
  assert isinstance(dims.proj.weight, ToAdam)
  updates = _routed_update(model, overrides={'pos': DN(1, 0)})
  assert_one_per_input(updates.pos, reduction=1, output=0, learning_rate=LR,
                       name='pos')


def test_an_override_that_matches_nothing_is_refused():
  model = eqx.nn.Linear(4, 3, key=jax.random.key(0))
  with pytest.raises(ValueError,
                     match=r"match no parameter: \['layers/\*/weight'\]"):
    taco_eqx.dimension_numbers(
        model, overrides={'weight': None, 'layers/*/weight': DN(1, 0)})


def test_a_weight_not_of_its_declared_shape_is_refused():
  model = eqx.nn.Linear(4, 3, key=jax.random.key(0))
  wrong = eqx.tree_at(lambda m: m.weight, model, jnp.ones((4, 3)))
  with pytest.raises(ValueError, match=r'(?s)1 parameter\(s\).*weight: shape '
                     r'\(4, 3\), but eqx.nn.Linear declares its weight as '
                     r'\(3, 4\)'):
    taco_eqx.dimension_numbers(wrong)
  dims = taco_eqx.dimension_numbers(wrong, overrides={'weight': DN(0, 1)})
  assert dims.weight == DN(0, 1)


def test_scalar_linear_and_integer_arrays_are_not_taco_matrices():
  model = [eqx.nn.Linear('scalar', 5, key=jax.random.key(0)),
           eqx.nn.Linear(5, 'scalar', key=jax.random.key(1)),
           jnp.arange(6).reshape(2, 3)]
  dims = taco_eqx.dimension_numbers(model, filter_spec=eqx.is_array)
  assert isinstance(dims[0].weight, ToAdam)
  assert isinstance(dims[1].weight, ToAdam)
  assert 'scalar' in source_of(dims[0].weight)
  assert isinstance(dims[2], ToAdam) and 'int' in source_of(dims[2])
  assert taco_eqx.dimension_numbers(model)[2] is None  # filtered out


def test_an_eqx_tree_of_dimension_numbers_is_taken_as_a_tree():
  # The tree is an eqx.nn.Linear, hence callable; taco once called it as a
  # function of the params (TypeError: unsupported operand type(s) for @).
  model = eqx.nn.Linear(8, 4, key=jax.random.key(0))
  dims = taco_eqx.dimension_numbers(model)
  assert callable(dims)
  params = _params(model)
  updates = _update(taco_optax.taco(LR, weight_dimension_numbers=dims),
                    params)
  assert_one_per_input(updates.weight, 1, 0, LR)
  injected = optax.inject_hyperparams(
      taco_optax.taco,
      static_args=('k', 'weight_dimension_numbers', 'update_scale'))(
          LR, weight_dimension_numbers=dims,
          update_scale=taco_eqx.update_scales(model))
  updates = _update(injected, params)
  assert_one_per_input(updates.weight, 1, 0, LR, name='injected')


def test_routing_report_names_each_rule():
  model = _Block(jax.random.key(0))
  params = _params(model)
  tx = taco_optax.taco(LR, weight_dimension_numbers=(
      taco_eqx.dimension_numbers(model)),
                       update_scale=taco_eqx.update_scales(model))
  rows = {row.path: row for row in taco_optax.routing_report(tx,
                                                             params).rows}
  assert {p for p, r in rows.items() if r.route == 'taco'} == {
      'embed/weight', 'attn/query_proj/weight', 'attn/key_proj/weight',
      'attn/value_proj/weight', 'attn/output_proj/weight', 'head/weight'}
  assert 'vocabulary rows' in rows['embed/weight'].why
  assert 'eqx.nn.Linear weight (out, in)' in rows['head/weight'].why
