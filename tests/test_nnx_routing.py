"""taco_optax.nnx.dimension_numbers: TACO's axes read from NNX models.

tunix models are imported lazily: importing ``tunix.models`` turns
``flax_always_shard_variable`` off for the whole process, so the flag is
restored here after every construction.
"""

import contextlib
import fnmatch

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
import taco_optax
from taco_optax._src.routing import dimension_numbers as _dimension_numbers
from taco_optax.nnx import dimension_numbers
from taco_optax.nnx import update_scales
from tests.support import tiers

DN = taco_optax.TacoDimensionNumbers

# What each einsum of tunix's models contracts, by hand from its string.
KNOWN_EINSUMS = {
    'BTD,DNH->BTNH': DN(0, (1, 2)),   # q: (D, N, H), contracts D
    'BSD,DKH->BSKH': DN(0, (1, 2)),   # k, v
    'BTNH,NHD->BTD': DN((0, 1), 2),   # o: (N, H, D), contracts N, H
    'BTD,DV->BTV': DN(0, 1),          # lm_head
    'BTD,NDH->BTNH': DN(1, (0, 2)),   # Gemma q: (N, D, H)
    'BTD,SNDH->SBTNH': DN(2, (1, 3)),  # Gemma fused qkv: S is Q/K/V
    'BSD,CKDH->CBSKH': DN(2, (1, 3)),  # Gemma fused kv: C is K/V
}


@contextlib.contextmanager
def _tunix_flag_kept():
  before = flax.config.flax_always_shard_variable
  try:
    yield
  finally:
    flax.config.update('flax_always_shard_variable', before)


def _tunix_model(family, **sizes):
  """A tiny tunix model (f32), its kernels re-initialised at random."""
  with _tunix_flag_kept():
    module = pytest.importorskip(f'tunix.models.{family}.model')
    flax.config.update('flax_always_shard_variable', False)
    shape = dict(num_layers=2, embed_dim=16, hidden_dim=32, num_heads=4,
                 head_dim=8, num_kv_heads=2)
    shape.update(sizes)
    if family == 'gemma3':
      config = module.ModelConfig(num_embed=shape.pop('vocab_size', 64),
                                  sliding_window_size=4,
                                  param_dtype=jnp.float32, **shape)
      model = module.Gemma3(config, rngs=nnx.Rngs(0))
    else:
      config = module.ModelConfig(vocab_size=shape.pop('vocab_size', 64),
                                  rope_theta=10_000, norm_eps=1e-6, **shape)
      cls = module.Qwen3 if family == 'qwen3' else module.Llama3
      model = cls(config, rngs=nnx.Rngs(0))
  _randomise(model)
  return model


def _randomise(model):
  # Some tunix kernels start at zero (weights are meant to be loaded).
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  nnx.update(model, treedef.unflatten([
      0.3 * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
      for k, x in zip(keys, leaves)]))


TUNIX = [('qwen3', {}), ('llama3', {}), ('gemma3', {}),
         ('gemma3', {'num_kv_heads': 4})]  # fused qkv_einsum
TUNIX_IDS = ['qwen3', 'llama3', 'gemma3', 'gemma3-fused-qkv']


def _flat(tree):
  return dict(nnx.to_flat_state(tree)) if isinstance(tree, nnx.State) else {
      p: v for p, v in tree}


def _einsum_modules(model):
  return [(path, module) for path, module in nnx.iter_graph(model)
          if isinstance(getattr(module, 'einsum_str', None), str)]


@pytest.mark.parametrize('family,sizes', tiers.first_fast(TUNIX), ids=TUNIX_IDS)
def test_every_tunix_matrix_goes_to_taco(family, sizes):
  model = _tunix_model(family, **sizes)
  dims = _flat(dimension_numbers(model))
  params = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert dims.keys() == {path for path, _ in params}
  for path, variable in params:
    assert (dims[path] is None) == (variable.ndim < 2), (path, dims[path])
  einsums = _einsum_modules(model)
  assert len(einsums) >= 4  # attention einsums of two layers
  for path, module in einsums:
    weight = tuple(path) + ('w',)
    assert dims[weight] == KNOWN_EINSUMS[module.einsum_str], path
  tx = taco_optax.taco(1e-3, k=4, weight_dimension_numbers=(
      dimension_numbers(model)), update_scale=update_scales(model))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  report = taco_optax.routing_report(tx, nnx.state(model, nnx.Param))
  assert {row.path for row in report.rows if row.route == 'taco'} == {
      '/'.join(map(str, path)) for path, v in params if v.ndim >= 2}
  assert int(optimizer.step[...]) == 0


def _column_gradients_are_input_slices(einsum_str, weight, dims):
  """One token's weight gradient, as TACO's rows, is ``x_j * g`` per column.

  For ``y = einsum(einsum_str, x, w)`` and one token, row ``j`` of each
  matrix (the paper's column ``j``) must be input feature ``x_j`` times the
  matrix's output cotangent: the rows are exactly the reduction-axis slices.
  """
  spec = einsum_str.replace('...', '')
  lhs, rhs = spec.split('->')[0].split(',')
  sizes = dict(zip(rhs, weight.shape))
  x = jax.random.normal(jax.random.key(2),
                        tuple(sizes.get(c, 1) for c in lhs))
  y, vjp = jax.vjp(lambda w: jnp.einsum(spec, x, w), weight)
  g = jax.random.normal(jax.random.key(3), y.shape)
  (grad,) = vjp(g)
  layout = _dimension_numbers.matrix_layout(weight.shape, dims)
  rows = np.asarray(layout.to_rows(grad)).reshape(layout.num_matrices,
                                                  layout.n, layout.m)
  features = np.asarray(x).reshape(-1)
  assert features.size == layout.n
  outputs = rows[:, :1, :] / features[0]
  np.testing.assert_allclose(rows, features[None, :, None] * outputs,
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.sort(outputs.reshape(-1)),
                             np.sort(np.asarray(g).reshape(-1)), rtol=1e-4,
                             atol=1e-6)


@pytest.mark.parametrize('family,sizes', TUNIX, ids=TUNIX_IDS)
def test_tunix_columns_are_the_reduction_slices(family, sizes):
  model = _tunix_model(family, **sizes)
  dims = _flat(dimension_numbers(model))
  for path, module in _einsum_modules(model):
    _column_gradients_are_input_slices(
        module.einsum_str, module.w.get_value(), dims[tuple(path) + ('w',)])


def test_a_wrong_contraction_fails_the_slice_check():
  weight = jax.random.normal(jax.random.key(0), (4, 8, 16))  # (N, H, D)
  with pytest.raises(AssertionError):
    _column_gradients_are_input_slices('BTNH,NHD->BTD', weight,
                                       DN((0,), (1, 2)))


def _state_bytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.long
def test_tunix_qwen3_state_is_much_smaller_than_adamw():
  model = _tunix_model('qwen3', embed_dim=64, hidden_dim=128, num_heads=8,
                       head_dim=16, num_kv_heads=4, vocab_size=256)
  params = nnx.state(model, nnx.Param)
  routed = taco_optax.taco(1e-3, weight_dimension_numbers=(
      dimension_numbers(model)), update_scale=update_scales(model))
  default = taco_optax.taco(1e-3)
  adamw = _state_bytes(jax.eval_shape(optax.adamw(1e-3).init, params))
  routed_bytes = _state_bytes(jax.eval_shape(routed.init, params))
  default_bytes = _state_bytes(jax.eval_shape(default.init, params))
  # Measured: AdamW 1,051,652 B; the default routing 463,692 B (2.3x: the
  # attention einsums go to Adam); routed from the model 106,764 B (9.9x;
  # the issue found 7.5x with hand-written dimension numbers).
  assert adamw / routed_bytes > 7.5
  assert adamw / default_bytes < 3
  assert default_bytes / routed_bytes > 3
  report = taco_optax.routing_report(routed, params)
  assert report.state_bytes == routed_bytes
  assert report.adamw_state_bytes == adamw


def _example_model(family, scan_layers):
  config = config_lib.ModelConfig.tiny(family, tie_word_embeddings=False)
  return decoder_lib.DecoderLM(config, dtype=jnp.float32,
                               param_dtype=jnp.float32, remat=None,
                               scan_layers=scan_layers, rngs=nnx.Rngs(0))


@pytest.mark.parametrize('scan_layers', [False, True])
@pytest.mark.parametrize('family', config_lib.FAMILIES)
def test_example_models_route_as_their_own_rule(family, scan_layers):
  model = _example_model(family, scan_layers)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  shapes = _flat(jax.tree.map(jnp.shape, params))
  axes = lambda dims: {
      path: d if d is None else _dimension_numbers.normalize_axes(
          shapes[path], d) for path, d in _flat(dims).items()}
  assert axes(dimension_numbers(model)) == axes(
      decoder_lib.taco_dimension_numbers(params))
  scales = _flat(update_scales(model))
  expected = _flat(decoder_lib.taco_update_scale(params))
  # The example scales only the token table by 1; update_scales every table.
  positions = ('positions', 'embedding')
  assert (scales.pop(positions, None), expected.pop(positions, None)) in (
      (None, None), (1.0, None))
  assert scales == expected


def test_linear_general_lora_and_stacked_layers():
  class Net(nnx.Module):

    def __init__(self, rngs):
      self.general = nnx.LinearGeneral((2, 3), (4, 5), axis=(-2, -1),
                                       batch_axis={0: 6}, rngs=rngs)
      self.lora = nnx.LoRALinear(3, 5, lora_rank=2, rngs=rngs)
      self.stacked = nnx.vmap(lambda r: nnx.Linear(3, 7, rngs=r))(
          nnx.Rngs(0).split(4))
      self.embed = nnx.Embed(11, 3, rngs=rngs)

  model = Net(nnx.Rngs(0))
  dims = _flat(dimension_numbers(model))
  assert dims[('general', 'kernel')] == DN((1, 2), (3, 4))
  assert dims[('general', 'bias')] is None  # rank 3 (6, 4, 5), a bias
  assert dims[('lora', 'kernel')] == DN(0, 1)
  assert dims[('lora', 'lora', 'lora_a')] == DN(0, 1)
  assert dims[('lora', 'lora', 'lora_b')] == DN(0, 1)
  assert dims[('stacked', 'kernel')] == DN(1, 2)
  assert dims[('embed', 'embedding')] == DN(1, 0)
  lora_dims = _flat(dimension_numbers(model, nnx.LoRAParam))
  assert set(lora_dims) == {('lora', 'lora', 'lora_a'),
                            ('lora', 'lora', 'lora_b')}
  tx = taco_optax.taco(1e-2, k=2, weight_dimension_numbers=(
      dimension_numbers(model, nnx.LoRAParam)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
  x = jnp.ones((2, 3))
  grads = nnx.grad(lambda m: m.lora(x).sum(),
                   argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
  before = model.lora.lora.lora_b.get_value()  # (2, 5); lora_b starts at 0
  optimizer.update(model, grads)
  moved = model.lora.lora.lora_b.get_value() != before
  assert int(moved.sum()) == 2  # one weight in each of lora_b's 2 columns


class _Experts(nnx.Module):

  def __init__(self, rngs):
    self.router = nnx.Linear(4, 3, rngs=rngs)
    self.up = nnx.Param(jnp.ones((3, 4, 8)))
    self.down = nnx.Param(jnp.ones((3, 8, 4)))


class _Outer(nnx.Module):

  def __init__(self, rngs):
    self.einsum_str = 'BT,NH->BTNH'  # no contraction: ambiguous
    self.w = nnx.Param(jnp.ones((2, 3)))


def test_unknown_rank3_and_ambiguous_einsums_are_refused_once():
  model = nnx.List([_Experts(nnx.Rngs(0)), _Outer(nnx.Rngs(0))])
  with pytest.raises(ValueError) as refusal:
    dimension_numbers(model)
  message = str(refusal.value)
  assert 'cannot tell the TACO axes of 3 parameter(s)' in message
  for name in ('0/up: shape (3, 4, 8)', '0/down', '1/w', 'no reduction axis',
               'overrides='):
    assert name in message, name
  dims = dimension_numbers(model, overrides={
      '*/up': DN(1, 2), '*/down': DN(1, 2), '1/w': None})
  assert _flat(dims)[(0, 'up')] == DN(1, 2)
  assert _flat(dims)[(1, 'w')] is None
  assert _flat(dims)[(0, 'router', 'kernel')] == DN(0, 1)
  with pytest.raises(ValueError, match=r"match no parameter: \['\*/typo'\]"):
    dimension_numbers(model, overrides={
        '*/up': DN(1, 2), '*/down': DN(1, 2), '1/w': None, '*/typo': None})


def test_tunix_moe_experts_need_overrides():
  model = _tunix_model('qwen3', num_layers=1, num_experts=2,
                       num_experts_per_tok=1)
  with pytest.raises(ValueError, match='layers/0/mlp/gate_proj'):
    dimension_numbers(model)
  experts = {'layers/*/mlp/gate_proj': DN(1, 2),
             'layers/*/mlp/up_proj': DN(1, 2),
             'layers/*/mlp/down_proj': DN(1, 2)}
  dims = _flat(dimension_numbers(model, overrides=experts))
  assert all(dims[p] == DN(1, 2) for p in dims
             if any(fnmatch.fnmatchcase('/'.join(map(str, p)), pattern)
                    for pattern in experts))


def _lm_loss(model, tokens):
  batch, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)),
                          (batch, length, length))
  logits, _ = model(tokens, positions, None, mask)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], tokens[:, 1:]).mean()


def _step_moves_one_weight_per_column(model, wrt, dims, steps=2):
  """``steps`` nnx.Optimizer steps; each moves one weight per column."""
  tx = taco_optax.taco(1e-2, k=4, weight_dimension_numbers=dims)
  optimizer = nnx.Optimizer(model, tx, wrt=wrt)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)))
  flat_dims = _flat(dims)
  checked = 0
  for _ in range(steps):
    grads = nnx.grad(_lm_loss, argnums=nnx.DiffState(0, wrt))(model, tokens)
    before = _flat(nnx.as_pure(nnx.state(model, wrt)))
    optimizer.update(model, grads)
    after = _flat(nnx.as_pure(nnx.state(model, wrt)))
    for path, grad in _flat(nnx.as_pure(grads)).items():
      if flat_dims[path] is None:
        continue
      layout = _dimension_numbers.matrix_layout(grad.shape, flat_dims[path])
      moved = np.asarray(layout.to_rows(after[path] != before[path]))
      live = np.asarray(layout.to_rows(grad != 0)).any(axis=1)
      np.testing.assert_array_equal(moved.sum(axis=1), live.astype(int),
                                    err_msg=str(path))
      checked += int(live.sum())
  assert checked > 0


@pytest.mark.long
@pytest.mark.parametrize('family,sizes', TUNIX, ids=TUNIX_IDS)
def test_one_tunix_step_moves_one_weight_per_column(family, sizes):
  model = _tunix_model(family, **sizes)
  _step_moves_one_weight_per_column(model, nnx.Param,
                                    dimension_numbers(model), steps=1)


@pytest.mark.long
def test_qwix_lora_factors_of_einsum_kernels():
  qwix = pytest.importorskip('qwix')
  model = _tunix_model('qwen3')
  with _tunix_flag_kept():
    flax.config.update('flax_always_shard_variable', False)
    model = qwix.apply_lora_to_model(
        model, qwix.LoraProvider(
            module_path='.*q_proj|.*o_proj|.*down_proj|lm_head', rank=3,
            alpha=2.0), rngs=nnx.Rngs(1), **model.get_model_input())
  dims = _flat(dimension_numbers(model, nnx.LoRAParam))
  attn = ('layers', 0, 'attn')
  expected = {
      attn + ('q_proj', 'w_lora_a'): DN(0, 1),           # (D, r)
      attn + ('q_proj', 'w_lora_b'): DN(0, (1, 2)),      # (r, N, H)
      attn + ('o_proj', 'w_lora_a'): DN((0, 1), 2),      # (N, H, r)
      attn + ('o_proj', 'w_lora_b'): DN(0, 1),           # (r, D)
      ('layers', 0, 'mlp', 'down_proj', 'kernel_lora_a'): DN(0, 1),
      ('lm_head', 'w_lora_b'): DN(0, 1)}
  for path, value in expected.items():
    assert dims[path] == value, path
  assert len(dims) == 14 and None not in dims.values()
  _step_moves_one_weight_per_column(
      model, nnx.LoRAParam, dimension_numbers(model, nnx.LoRAParam))


def test_tunix_models_leave_the_flax_flag_as_it_was():
  before = flax.config.flax_always_shard_variable
  _tunix_model('llama3', num_layers=1)
  assert flax.config.flax_always_shard_variable == before


class _Block(nnx.Module):

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.dense = nnx.Linear(6, 4, rngs=rngs)
    self.norm = nnx.LayerNorm(4, rngs=rngs)


@pytest.mark.parametrize('which', ['taco', 'scale_by_taco'])
def test_nnx_optimizer_state_has_no_variable_around_a_placeholder(which):
  """nnx.Optimizer hands init the model's Variables: the masked leaves of
  each branch are placeholders in place of the Variable, not inside one
  (tunix 0.1.8 reads the dtype of every optimizer-state Variable), and the
  state's arrays are those of init on the bare arrays."""
  model = _Block()
  tx = (taco_optax.taco(1e-2) if which == 'taco' else optax.chain(
      taco_optax.scale_by_taco(weight_dimension_numbers=lambda p: jax.tree.map(
          lambda x: taco_optax.TacoDimensionNumbers() if x.ndim == 2
          else None, p)), optax.scale(-1e-2)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  boxed = jax.tree.leaves(nnx.state(optimizer, nnx.optimizer.OptState),
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert boxed and all(hasattr(v.get_value(), 'dtype') for v in boxed), [
      type(v.get_value()).__name__ for v in boxed]
  bare = tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))
  state = nnx.as_pure(optimizer.opt_state)
  assert jax.tree.structure(state) == jax.tree.structure(bare)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(bare),
                       strict=True):
    np.testing.assert_array_equal(got, want)
  grads = nnx.grad(lambda m: jnp.sum(m.norm(m.dense(jnp.ones((2, 6))))))(
      model)
  optimizer.update(model, grads)  # and it steps
