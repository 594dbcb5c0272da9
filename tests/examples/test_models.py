"""DecoderLM behaviour: shapes, causality, padding, remat/scan, TACO wiring."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as model_lib
import taco_optax
from taco_optax._src.routing import dimension_numbers as _dimension_numbers
from tests.support import tiers

FAMILIES = config_lib.FAMILIES


def _tiny_model(family, *, scan_layers=False, remat=None, seed=0,
                dtype=jnp.float32, **config_overrides):
  config = config_lib.ModelConfig.tiny(family, **config_overrides)
  return model_lib.DecoderLM(config, dtype=dtype, param_dtype=dtype,
                             remat=remat, scan_layers=scan_layers,
                             rngs=nnx.Rngs(seed))


def _tokens(config, batch=2, length=10, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, config.vocab_size, (batch, length)),
                     jnp.int32)


def _stacked_copy(model, **kwargs):
  """A scanned model holding the same weights as the unscanned ``model``."""
  scanned = _tiny_model(model.config.family, scan_layers=True, seed=1,
                        **kwargs)
  per_layer = [nnx.state(block, nnx.Param) for block in model.layers]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
  nnx.update(scanned.layers, stacked)
  for name in ('embed', 'final_norm', 'lm_head', 'positions'):
    if hasattr(model, name):
      nnx.update(getattr(scanned, name),
                 nnx.state(getattr(model, name), nnx.Param))
  return scanned


def _loss(model, tokens, mask):
  logits = model(tokens[:, :-1], mask[:, :-1])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                           tokens[:, 1:])
  weights = mask[:, 1:]
  return (losses * weights).sum() / weights.sum()


@pytest.mark.parametrize('family', tiers.first_fast(FAMILIES))
def test_logits_are_float32_with_vocab_width(family):
  model = _tiny_model(family, dtype=jnp.bfloat16, remat='block')
  tokens = _tokens(model.config)
  logits = model(tokens)
  assert logits.shape == tokens.shape + (model.config.vocab_size,)
  assert logits.dtype == jnp.float32
  assert model.embed.embedding[...].dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(logits)).all()


# Every family's logits equal transformers' causal ones
# (tests/examples/test_loading.py), and Mistral's window is checked below.
def test_causal_future_tokens_do_not_change_past_logits():
  model = _tiny_model('llama')
  tokens = _tokens(model.config, batch=1, length=8)
  changed = tokens.at[0, 5].set((tokens[0, 5] + 1) % model.config.vocab_size)
  before, after = model(tokens), model(changed)
  np.testing.assert_allclose(before[0, :5], after[0, :5], rtol=1e-6,
                             atol=1e-6)
  assert np.abs(before[0, 5:] - after[0, 5:]).max() > 1e-4


@pytest.mark.parametrize('family', tiers.first_fast(FAMILIES))
def test_padding_matches_unpadded_rows(family):
  model = _tiny_model(family)
  tokens = _tokens(model.config, batch=2, length=9)
  mask = jnp.array([[True] * 9, [True] * 6 + [False] * 3])
  # Padding ids must not matter either.
  padded = tokens.at[1, 6:].set(0)
  logits = model(padded, mask)
  alone = model(tokens[1:, :6])
  np.testing.assert_allclose(logits[1, :6], alone[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits[0], model(tokens[:1])[0], rtol=1e-5,
                             atol=1e-5)
  # Left padding works too: positions count real tokens only.
  left = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), tokens[1:, :6]], 1)
  left_mask = jnp.array([[False] * 3 + [True] * 6])
  np.testing.assert_allclose(model(left, left_mask)[0, 3:], alone[0],
                             rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_how_far_back_a_query_sees():
  model = _tiny_model('mistral', sliding_window=3)
  tokens = _tokens(model.config, batch=1, length=8)
  changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % model.config.vocab_size)
  difference = np.abs(model(tokens) - model(changed))[0].max(axis=-1)
  # Two layers of window 3 reach 2 * (3 - 1) = 4 positions ahead.
  assert (difference[:5] > 1e-5).all()
  np.testing.assert_allclose(difference[5:], 0.0, atol=1e-6)


@pytest.mark.long
def test_remat_and_scan_give_the_same_logits_and_gradients():
  # GPT-NeoX: fused QKV, partial rotary and parallel residual under scan.
  # test_loading checks scan + remat logits against transformers for all.
  plain = _tiny_model('gpt_neox', remat=None)
  tokens = _tokens(plain.config, length=9)
  mask = jnp.array([[True] * 9, [True] * 7 + [False] * 2])
  variants = {
      'plain': plain,
      'remat_dots': model_lib.DecoderLM(
          plain.config, dtype=jnp.float32, param_dtype=jnp.float32,
          remat='block', remat_policy='dots_saveable', rngs=nnx.Rngs(0)),
      'scan_remat': _stacked_copy(plain, remat='block'),
  }
  results = {}
  for name, model in variants.items():
    loss, grads = nnx.jit(nnx.value_and_grad(_loss))(model, tokens, mask)
    if name.startswith('scan'):
      grads = grads['layers']
    else:
      per_layer = [grads['layers'][i] for i in range(plain.config.num_layers)]
      grads = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    results[name] = (loss, model(tokens, mask), nnx.to_pure_dict(grads))
  reference = results.pop('plain')
  for name, result in results.items():
    np.testing.assert_allclose(result[0], reference[0], rtol=1e-5,
                               err_msg=name)
    np.testing.assert_allclose(result[1], reference[1], rtol=1e-5,
                               atol=1e-5, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-4, atol=1e-6, err_msg=name), result[2], reference[2])


def test_rejects_unknown_remat_settings():
  config = config_lib.ModelConfig.tiny('llama')
  with pytest.raises(ValueError, match='remat must be'):
    model_lib.DecoderLM(config, remat='layer')
  with pytest.raises(ValueError, match='remat_policy'):
    model_lib.DecoderLM(config, remat_policy='save_everything_please')


@pytest.mark.parametrize('family', FAMILIES)
def test_parameter_count_matches_config(family):
  for overrides in ({}, {'tie_word_embeddings': False}):
    model = _tiny_model(family, **overrides)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == config_lib.num_parameters(model.config)


def _named_leaves(tree):
  is_leaf = lambda x: x is None or isinstance(
      x, taco_optax.TacoDimensionNumbers)
  return {'/'.join(model_lib.path_names(path)): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(
              tree, is_leaf=is_leaf)}


@pytest.mark.parametrize('scan_layers', [False, True])
@pytest.mark.parametrize('family', FAMILIES)
def test_taco_dimension_numbers_cover_every_matrix(family, scan_layers):
  model = _tiny_model(family, scan_layers=scan_layers,
                      tie_word_embeddings=False)
  params = nnx.state(model, nnx.Param)
  dims = _named_leaves(model_lib.taco_dimension_numbers(params))
  scales = _named_leaves(model_lib.taco_update_scale(params))
  shapes = {name: leaf.shape
            for name, leaf in _named_leaves(nnx.to_pure_dict(params)).items()}
  assert dims.keys() == shapes.keys() == scales.keys()
  for name, shape in shapes.items():
    layer_axes = 1 if scan_layers and name.startswith('layers/') else 0
    leaf = name.rsplit('/', 1)[-1]
    if leaf in ('scale', 'bias'):
      assert dims[name] is None, name
    elif leaf == 'embedding':
      # (rows, d): the rows (vocabulary or positions) are TACO's m.
      assert dims[name] == taco_optax.TacoDimensionNumbers(1, 0), name
    elif '/qkv/' in name:
      assert shape[layer_axes + 1] == 3
      assert dims[name] == taco_optax.TacoDimensionNumbers(
          layer_axes, layer_axes + 2), name
    else:
      assert leaf == 'kernel'
      assert dims[name] == taco_optax.TacoDimensionNumbers(
          layer_axes, layer_axes + 1), name
    assert scales[name] == (1.0 if name == 'embed/embedding' else None), name
  assert ('layers/attn/qkv/kernel' in dims or 'layers/0/attn/qkv/kernel'
          in dims) == (family == 'gpt_neox')


@pytest.mark.parametrize('family,scan_layers', tiers.first_fast([
    ('gpt_neox', True), ('opt', False)]))
def test_one_taco_step_moves_one_weight_per_column(family, scan_layers):
  model = _tiny_model(family, scan_layers=scan_layers,
                      tie_word_embeddings=False)
  learning_rate = 1e-2
  tx = taco_optax.taco(learning_rate, k=4,
                       weight_dimension_numbers=model_lib.taco_dimension_numbers,
                       update_scale=model_lib.taco_update_scale)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  tokens = _tokens(model.config, length=12)
  mask = jnp.ones(tokens.shape, bool)

  @nnx.jit
  def train_step(model, optimizer, tokens, mask):
    loss, grads = nnx.value_and_grad(_loss)(model, tokens, mask)
    optimizer.update(model, grads)
    return loss, grads

  before = nnx.to_pure_dict(nnx.clone(nnx.state(model, nnx.Param)))
  first_loss, grads = train_step(model, optimizer, tokens, mask)
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert float(_loss(model, tokens, mask)) < float(first_loss)

  dims = _named_leaves(model_lib.taco_dimension_numbers(
      nnx.state(model, nnx.Param)))
  old, new = _named_leaves(before), _named_leaves(after)
  gradients = _named_leaves(nnx.to_pure_dict(grads))
  for name, dim_nums in dims.items():
    if dim_nums is None:
      continue
    layout = _dimension_numbers.matrix_layout(old[name].shape, dim_nums)
    # One weight moves in every column whose gradient is not all zero (a
    # ReLU unit that never fires, a token absent from the batch: none).
    live_columns = int(
        (layout.to_rows(np.asarray(gradients[name])) != 0).any(axis=1).sum())
    assert live_columns > layout.n // 2, name
    steps = np.abs(np.asarray(new[name]) - np.asarray(old[name]))
    moved = steps[steps > 0]
    assert moved.size == live_columns, name
    scale = 1.0 if name == 'embed/embedding' else layout.m / layout.n
    np.testing.assert_allclose(moved, learning_rate * scale, rtol=1e-3,
                               err_msg=name)
