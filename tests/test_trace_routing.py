"""trace_dimension_numbers: TACO's axes read from the jaxpr of any JAX model.

Three parts: the einsum behaviour the trace reads (the jaxpr internals
themselves are pinned in ``tests/test_jaxpr_internals.py``); hand-written
expectations on small plain-jax models, a few checked on one ``taco`` update
itself; and the same tree as the module-reading helpers (NNX on every tunix
model and the example's five families, Linen, Equinox). Nothing here compiles
but the few update checks: ``make_jaxpr`` only.
"""

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import taco_optax
from taco_optax._src.routing import ToAdam
from taco_optax._src.routing import source_of
from taco_optax._src.routing import trace_dimension_numbers
from taco_optax._src.routing import trace_walk
from tests.support import jaxpr_cases
from tests.support.routing_checks import assert_adam_dense
from tests.support.routing_checks import assert_one_per_input

DN = taco_optax.TacoDimensionNumbers
LR = 1e-2
X = jnp.ones((2, 4))


def _normal(shape, seed=0):
  # Host numpy: jax.random would compile per shape, for nothing.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                     jnp.float32)


def _rows(report):
  return {row.path: row for row in report.rows}


def _dims(fn, params, *args, **kwargs):
  """path -> entry of the traced tree (and the report)."""
  dims, report = trace_dimension_numbers(fn, params, *args, **kwargs)
  # Every entry is decided dims or ToAdam (None nodes are a tree's empties).
  leaves = jax.tree.leaves(dims, is_leaf=lambda x: isinstance(x, DN))
  assert leaves == [row.entry for row in report.rows]
  return {row.path: _plain(row.entry) for row in report.rows}, report


def _plain(entry):
  """An entry as its meaning: ``None`` for a ``ToAdam``."""
  return None if isinstance(entry, ToAdam) else entry


def _one_update(fn, params, *args, loss=None):
  """One traced-and-routed ``taco`` step under the gradient of ``loss``."""
  dims, report = trace_dimension_numbers(fn, params, *args)
  tx = taco_optax.taco(LR, weight_dimension_numbers=dims,
                       update_scale=report.update_scales())
  loss = loss or (lambda p: jnp.sum(jnp.sin(fn(p, *args))))

  @jax.jit
  def step(params):
    return tx.update(jax.grad(loss)(params), tx.init(params), params)[0]

  return step(params)


# --- (a) jaxpr behaviour the trace relies on (the adapter over jaxpr internals
# is pinned in tests/test_jaxpr_internals.py) ---------------------------------


_eqns = jaxpr_cases.eqns
_shard_map = jaxpr_cases.shard_map
_custom_vjp = jaxpr_cases.custom_vjp
_custom_jvp = jaxpr_cases.custom_jvp


def test_einsum_emits_a_transpose_after_its_dot_general():
  # The q, k, v = out rule reads the transpose that follows the product.
  eqns = _eqns(lambda x, w: jnp.einsum('BTD,SNDH->SBTNH', x, w),
               jnp.ones((2, 5, 4)), jnp.ones((3, 2, 4, 6)))
  assert [e.primitive.name for e in eqns] == ['dot_general', 'transpose']
  assert eqns[1].invars[0] is eqns[0].outvars[0]


def test_ragged_dot_and_opaque_kernels_keep_their_names():
  ragged, = _eqns(lambda x, w, g: jax.lax.ragged_dot(x, w, g),
                  jnp.ones((6, 4)), jnp.ones((2, 4, 5)),
                  jnp.array([3, 3], jnp.int32))
  numbers = ragged.params['ragged_dot_dimension_numbers']
  assert ragged.primitive.name == 'ragged_dot_general'
  assert numbers.rhs_group_dimensions == (0,)
  assert numbers.dot_dimension_numbers == (((1,), (1,)), ((), ()))
  conv, = _eqns(lambda x, k: jax.lax.conv_general_dilated(x, k, (1,), 'SAME'),
                jnp.ones((1, 2, 8)), jnp.ones((3, 2, 3)))
  assert conv.primitive.name in trace_walk.CONVOLUTIONS
  assert _opaque_eqn(_pallas).primitive.name in trace_walk.OPAQUE
  assert _opaque_eqn(_ffi).primitive.name in trace_walk.OPAQUE


def _pallas(p, x):
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  def kernel(x_ref, w_ref, out_ref):
    out_ref[...] = x_ref[...] @ w_ref[...]

  return pl.pallas_call(kernel, interpret=True, out_shape=(
      jax.ShapeDtypeStruct((2, 3), jnp.float32)))(x, p['w'])


def _ffi(p, x):
  return jax.ffi.ffi_call('taco_test_matmul', jax.ShapeDtypeStruct(
      (2, 3), jnp.float32))(x, p['w'])


def _opaque_eqn(fn):
  return _eqns(fn, {'w': jnp.ones((4, 3))}, X)[-1]


# --- (b) small plain-jax models, axes by hand -------------------------------


def _mlp(p, x):
  return jnp.tanh(x @ p['w1'] + p['b1']) @ p['w2']


def test_mlp_kernels_move_one_weight_per_input():
  params = {'w1': _normal((4, 6)), 'b1': _normal((6,)), 'w2': _normal((6, 3))}
  dims, report = _dims(_mlp, params, X)
  assert dims == {'b1': None, 'w1': DN(0, 1), 'w2': DN(0, 1)}
  assert source_of(dims['w1']).startswith('trace: dot_general contracts')
  update = _one_update(_mlp, params, _normal((5, 4), 1))
  assert_one_per_input(update['w1'], 0, 1, LR, name='w1')
  assert_one_per_input(update['w2'], 0, 1, LR, name='w2')
  assert_adam_dense(update['b1'], name='b1')
  assert report['b1'].how == 'rank 1'


def test_a_transposed_kernel_is_read_as_out_in():
  params = {'w': _normal((3, 4))}  # (out, in), as PyTorch stores it
  fn = lambda p, x: x @ p['w'].T
  assert _dims(fn, params, X)[0] == {'w': DN(1, 0)}
  assert_one_per_input(_one_update(fn, params, X)['w'], 1, 0, LR)


def _attention(p, x):
  q = jnp.einsum('BTD,DNH->BTNH', x, p['q'])
  return jnp.einsum('BTNH,NHD->BTD', jnp.tanh(q), p['o'])


def test_einsum_attention_kernels():
  params = {'q': _normal((4, 2, 3)), 'o': _normal((2, 3, 4))}
  x = _normal((2, 5, 4))
  assert _dims(_attention, params, x)[0] == {'q': DN(0, (1, 2)),
                                              'o': DN((0, 1), 2)}
  update = _one_update(_attention, params, x)
  assert_one_per_input(update['q'], 0, (1, 2), LR, name='q')
  assert_one_per_input(update['o'], (0, 1), 2, LR, name='o')


def test_fused_qkv_axis_in_front_of_the_inputs_is_a_batch_axis():
  fn = lambda p, x: jnp.einsum('BTD,SNDH->SBTNH', x, p['qkv'])
  dims, report = _dims(fn, {'qkv': jnp.ones((3, 2, 4, 5))}, jnp.ones((2, 7, 4)))
  assert dims == {'qkv': DN(2, (1, 3))}  # as taco_optax.nnx reads the einsum
  assert 'q, k, v = out' in report['qkv'].how


def test_scanned_stack_has_its_layer_axis_as_a_batch_axis():
  params = {'stack': _normal((3, 4, 4)) / 2}
  fn = lambda p, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x,
                                 p['stack'])[0]
  dims, report = _dims(fn, params, X)
  assert dims == {'stack': DN(1, 2)}
  assert 'batch axes (0,)' in report['stack'].how
  assert_one_per_input(_one_update(fn, params, _normal((2, 4)))['stack'],
                       1, 2, LR)


@pytest.mark.parametrize('wrap', [jax.checkpoint, jax.jit, _custom_vjp,
                                  _custom_jvp, _shard_map],
                         ids=['remat', 'jit', 'custom_vjp', 'custom_jvp',
                              'shard_map'])
def test_wrapped_layers_are_read_inside(wrap):
  layer = wrap(lambda w, x: x @ w.T)
  fn = lambda p, x: layer(p['w'], x)
  assert _dims(fn, {'w': jnp.ones((3, 4))}, X)[0] == {'w': DN(1, 0)}


def test_fsdp_all_gather_inside_shard_map_keeps_the_axes():
  mesh = jax.make_mesh((1,), ('d',))
  shard = jax.sharding.NamedSharding(mesh, P('d'))
  for tiled in (True, False):
    gather = lambda w: jax.lax.all_gather(w, 'd', axis=0, tiled=tiled)
    layer = jax.shard_map(
        lambda w, x: x @ (gather(w) if tiled else gather(w)[0]), mesh=mesh,
        in_specs=(P('d'), P()), out_specs=P(), check_vma=False)
    params = {'w': jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=shard)}
    dims, _ = _dims(lambda p, x: layer(p['w'], x), params, X)
    assert dims == {'w': DN(0, 1)}, tiled


def test_rows_picked_at_a_traced_index_are_a_table_unless_multiplied():
  one_token = lambda p, token, h: p['table'][token] + h  # dynamic_slice
  dims, report = _dims(one_token, {'table': jnp.ones((10, 4))},
                       jnp.array(3), jnp.ones(4))
  assert dims == {'table': DN(1, 0)} and report['table'].decision == 'table'

  def layers(p, x):  # a stacked kernel indexed by the loop counter
    return jax.lax.fori_loop(0, jnp.int32(x.sum()), lambda i, h: jnp.tanh(
        h @ p['stack'][i % 3]), x)

  dims, report = _dims(layers, {'stack': jnp.ones((3, 4, 4))}, X)
  assert dims == {'stack': DN(1, 2)} and report['stack'].decision == 'taco'


def test_weights_concatenated_at_run_time_are_each_read():
  fused = lambda p, x: x @ jnp.concatenate([p['q'], p['k']], axis=1)
  assert _dims(fused, {'q': jnp.ones((4, 3)), 'k': jnp.ones((4, 2))}, X)[0] == {
      'k': DN(0, 1), 'q': DN(0, 1)}


def test_cond_and_while_uses():
  params = {'w': jnp.ones((4, 4)), 'v': jnp.ones((4, 4))}

  def fn(p, x):
    x = jax.lax.cond(x.sum() > 0, lambda x: x @ p['w'], lambda x: x, x)
    return jax.lax.while_loop(lambda c: c[1].sum() < 9.0,
                              lambda c: (c[0], c[1] @ c[0].T), (p['v'], x))[1]

  assert _dims(fn, params, X)[0] == {'v': DN(1, 0), 'w': DN(0, 1)}


def test_returned_views_are_followed_out_of_calls():
  fn = lambda p, x: x @ jax.jit(lambda w: w.T.astype(jnp.bfloat16))(p['w'])
  assert _dims(fn, {'w': jnp.ones((3, 4))}, X.astype(jnp.bfloat16))[0] == {
      'w': DN(1, 0)}


def test_reshapes_merge_and_split_axes():
  merged = lambda p, x: (x @ p['qkv'].reshape(4, 6), jnp.ones((2, 6)) @ (
      p['o'].reshape(6, 4)))
  dims, _ = _dims(merged, {'qkv': jnp.ones((4, 2, 3)),
                           'o': jnp.ones((2, 3, 4))}, X)
  assert dims == {'qkv': DN(0, (1, 2)), 'o': DN((0, 1), 2)}
  # Splitting (d, 3f) into (d, 3, f) puts the 3 in front: axis 1 then has
  # two roles (batch and output).
  split = lambda p, x: jnp.einsum('bd,dsf->sbf', x, p['w'].reshape(4, 3, 2))
  dims, report = _dims(split, {'w': jnp.ones((4, 6))}, X)
  assert dims == {'w': None} and report['w'].decision == 'ambiguous'
  assert 'two roles' in report['w'].how


def _language_model(p, ids):
  hidden = jnp.tanh(p['embed'][ids] @ p['proj'])
  return hidden @ p['embed'].T  # tied logits


def test_tied_table_has_vocabulary_rows_at_scale_one():
  params = {'embed': _normal((11, 4)), 'proj': _normal((4, 4))}
  ids = jnp.array([[1, 2, 3, 5]])
  dims, report = _dims(_language_model, params, ids)
  assert dims == {'embed': DN(1, 0), 'proj': DN(0, 1)}
  assert report['embed'].decision == 'table'
  assert 'tied table' in report['embed'].how
  assert report.update_scales() == {'embed': 1.0, 'proj': None}
  update = _one_update(_language_model, params, ids)
  assert_one_per_input(update['embed'], 1, 0, LR, scale=1.0, name='embed')
  take = lambda p, ids: jnp.take(p['embed'], ids, axis=0)
  assert _dims(take, {'embed': params['embed']}, ids)[0] == {
      'embed': DN(1, 0)}


def test_lora_product_is_ambiguous_until_overridden():
  fn = lambda p, x: x @ (p['w'] + p['a'] @ p['b'])
  params = {'w': jnp.ones((4, 3)), 'a': jnp.ones((4, 2)), 'b': jnp.ones((2, 3))}
  dims, report = _dims(fn, params, X)
  assert dims == {'w': DN(0, 1), 'a': None, 'b': None}
  assert report.ambiguous == ('a', 'b')
  assert 'weight-times-weight product (with b)' in report['a'].how
  assert 'unless an override' in str(report)
  dims, report = _dims(fn, params, X, overrides={'[ab]': DN(0, 1)})
  assert dims == {'w': DN(0, 1), 'a': DN(0, 1), 'b': DN(0, 1)}
  assert report['a'].decision == 'override'


def test_two_orientations_and_opaque_kernels_are_ambiguous():
  both = lambda p, x: (x @ p['w']) + (x @ p['w'].T)
  dims, report = _dims(both, {'w': jnp.ones((4, 4))}, X)
  assert dims == {'w': None}
  assert 'two orientations' in report['w'].how
  for fn, name in ((_pallas, 'pallas_call'), (_ffi, 'ffi_call')):
    dims, report = _dims(fn, {'w': jnp.ones((4, 3))}, X)
    assert dims == {'w': None} and report.ambiguous == ('w',)
    assert f'opaque kernel ({name})' in report['w'].how


def test_convolutions_biases_and_vectors_go_to_adam():
  def fn(p, x):
    y = jax.lax.conv_general_dilated(x, p['conv'], (1,), 'SAME')  # (1, 4, 8)
    y = y.reshape(1, 2, 2, 8) + p['bias'][None, :, :, None]
    return y * p['scale'] + p['count'].sum().astype(jnp.float32)

  params = {'conv': _normal((4, 2, 3)), 'bias': _normal((2, 2)),
            'scale': jnp.ones(8), 'count': jnp.ones((2, 2), jnp.int32)}
  dims, report = _dims(fn, params, _normal((1, 2, 8)))
  assert dims == {'conv': None, 'bias': None, 'scale': None, 'count': None}
  assert report['conv'].how == 'a convolution: no TACO rule'
  assert report['bias'].how == 'used only elementwise or reduced (add)'
  assert report['count'].how == 'int32, not floating point'
  assert report.ambiguous == ()


def test_weight_norm_direction_is_the_matrix_its_magnitudes_are_not():
  def fn(p, x):
    v = p['v']  # (out, in), with magnitudes g (out, 1)
    return x @ (p['g'] * v / jnp.linalg.norm(v, axis=1, keepdims=True)).T

  params = {'v': _normal((3, 4)), 'g': jnp.ones((3, 1))}
  dims, report = _dims(fn, params, X)
  assert dims == {'v': DN(1, 0), 'g': None}
  assert report['g'].decision == 'adam'


def test_ragged_dot_experts_are_matrices_per_expert():
  fn = lambda p, x: jax.lax.ragged_dot(x, p['experts'], jnp.array([1, 1]))
  dims, _ = _dims(fn, {'experts': jnp.ones((2, 4, 5))}, X)
  assert dims == {'experts': DN(1, 2)}


def test_report_prints_a_row_per_leaf_and_feeds_routing_report():
  params = {'w1': jnp.ones((4, 6)), 'b1': jnp.ones(6), 'w2': jnp.ones((6, 3))}
  dims, report = trace_dimension_numbers(_mlp, params, X)
  text = str(report)
  assert text.splitlines()[0] == (
      'trace_dimension_numbers: 3 leaves, 2 to TACO, 0 ambiguous (sent to '
      'Adam unless overridden)')
  assert all(path in text for path in ('w1', 'b1', 'w2'))
  routed = taco_optax.routing_report(
      taco_optax.taco(LR, weight_dimension_numbers=dims), params)
  why = {row.path: row.why for row in routed.rows}
  assert 'trace: dot_general contracts axes (0,)' in why['w1']
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        params)
  assert trace_dimension_numbers(
      _mlp, shapes, jax.ShapeDtypeStruct((2, 4), jnp.float32))[0] == dims


# --- (c) the same tree as the module-reading helpers ------------------------


def _differences(traced, expected):
  """path -> (traced, expected) where the two path -> entry dicts differ."""
  return {path: (traced.get(path), expected.get(path))
          for path in sorted(set(traced) | set(expected))
          if _plain(traced.get(path)) != _plain(expected.get(path))}


@contextlib.contextmanager
def _tunix_flag_kept():
  flax = pytest.importorskip('flax')
  before = flax.config.flax_always_shard_variable
  try:
    flax.config.update('flax_always_shard_variable', False)
    yield
  finally:
    flax.config.update('flax_always_shard_variable', before)


_TUNIX_SHAPE = dict(num_layers=2, embed_dim=16, hidden_dim=32, num_heads=4,
                    head_dim=8, num_kv_heads=2)


def _tunix_config(module, family, sizes):
  shape = dict(_TUNIX_SHAPE, **sizes)
  if family == 'gemma':
    return module.ModelConfig(
        num_embed=64, final_logit_softcap=None, use_post_attn_norm=True,
        use_post_ffw_norm=True, sliding_window_size=4,
        attention_types=(module.AttentionType.GLOBAL,
                         module.AttentionType.LOCAL_SLIDING), **shape)
  if family in ('gemma3', 'gemma4'):
    return module.ModelConfig(num_embed=64, sliding_window_size=4, **shape)
  return module.ModelConfig(vocab_size=64, rope_theta=10_000, norm_eps=1e-6,
                            **shape)


_TUNIX_CLASSES = {'gemma': 'Gemma', 'gemma3': 'Gemma3', 'gemma4': 'Gemma4',
                  'llama3': 'Llama3', 'qwen2': 'Qwen2', 'qwen3': 'Qwen3'}


def _tunix_traced(family, sizes, overrides=None):
  """A tiny abstract tunix model: NNX's and the traced path -> entry."""
  nnx = pytest.importorskip('flax.nnx')
  with _tunix_flag_kept():
    module = pytest.importorskip(f'tunix.models.{family}.model')
    config = _tunix_config(module, family, sizes)
    cls = getattr(module, _TUNIX_CLASSES[family])
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def forward(params, tokens, positions, mask):
      return nnx.merge(graphdef, params, rest)(tokens, positions, None,
                                               mask)[0]

    traced, report = _dims(
        forward, params, jax.ShapeDtypeStruct((2, 8), jnp.int32),
        jax.ShapeDtypeStruct((2, 8), jnp.int32),
        jax.ShapeDtypeStruct((2, 8, 8), jnp.bool_))
  nnx_dims = taco_optax.nnx.dimension_numbers(model, overrides=overrides)
  expected = {'/'.join(map(str, path)): entry
              for path, entry in nnx.to_flat_state(nnx_dims)}
  return traced, expected, report


TUNIX = {
    'qwen3': ('qwen3', {}), 'qwen3-tied': ('qwen3', {
        'use_tied_embedding': True}),
    'llama3': ('llama3', {}), 'llama3-tied': ('llama3', {
        'weight_tying': True}),
    'qwen2': ('qwen2', {}), 'gemma': ('gemma', {}),
    'gemma-fused-qkv': ('gemma', {'num_kv_heads': 4}),
    'gemma3': ('gemma3', {}), 'gemma3-fused-qkv': ('gemma3', {
        'num_kv_heads': 4}),
    'gemma4': ('gemma4', {})}


@pytest.mark.parametrize('name', list(TUNIX))
def test_every_tunix_model_routes_as_taco_optax_nnx(name):
  traced, expected, report = _tunix_traced(*TUNIX[name])
  assert _differences(traced, expected) == {}, str(report)
  assert report.ambiguous == ()


def test_tunix_moe_experts_are_read_where_nnx_needs_overrides():
  experts = {f'layers/*/mlp/{name}': DN(1, 2)
             for name in ('gate_proj', 'up_proj', 'down_proj')}
  traced, expected, report = _tunix_traced(
      'qwen3', dict(num_layers=1, num_experts=2, num_experts_per_tok=1),
      overrides=experts)
  assert _differences(traced, expected) == {}, str(report)
  assert 'batch axes (0,)' in report['layers/0/mlp/gate_proj'].how


def test_gemma4_moe_experts_are_read_where_nnx_needs_overrides():
  experts = {'layers/*/moe/gating_einsum': DN(3, (1, 2)),  # (E, 2, H, D)
             'layers/*/moe/linear': DN(1, 2)}             # (E, H, D)
  traced, expected, report = _tunix_traced('gemma4', dict(
      num_layers=1, enable_moe=True, num_experts=2, num_experts_per_tok=1,
      expert_dim=8, moe_dense_hidden_dim=16), overrides=experts)
  assert _differences(traced, expected) == {}, str(report)
  assert 'ragged_dot contracts' in report['layers/0/moe/linear'].how


def _example_traced(family, scan_layers, tied):
  nnx = pytest.importorskip('flax.nnx')
  from examples.finetune.model import config as config_lib  # pylint: disable=import-outside-toplevel
  from examples.finetune.model import decoder as decoder_lib  # pylint: disable=import-outside-toplevel
  config = config_lib.ModelConfig.tiny(family, tie_word_embeddings=tied)
  model = nnx.eval_shape(lambda: decoder_lib.DecoderLM(
      config, dtype=jnp.float32, param_dtype=jnp.float32, remat='block',
      scan_layers=scan_layers, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  forward = lambda params, ids, mask: nnx.merge(graphdef, params, rest)(
      ids, mask)
  traced, report = _dims(forward, params,
                         jax.ShapeDtypeStruct((2, 8), jnp.int32),
                         jax.ShapeDtypeStruct((2, 8), jnp.bool_))
  flat = lambda state: {'/'.join(map(str, path)): entry
                        for path, entry in nnx.to_flat_state(state)}
  scales = dict(zip([row.path for row in report.rows], jax.tree.leaves(
      report.update_scales(), is_leaf=lambda x: x is None)))
  return (traced, flat(taco_optax.nnx.dimension_numbers(model)), scales,
          flat(taco_optax.nnx.update_scales(model)), report)


EXAMPLE_FAMILIES = ('llama', 'mistral', 'qwen3', 'opt', 'gpt_neox')


@pytest.mark.parametrize('tied', [False, True], ids=['untied', 'tied'])
@pytest.mark.parametrize('scan_layers', [False, True], ids=['list', 'scan'])
@pytest.mark.parametrize('family', EXAMPLE_FAMILIES)
def test_example_families_route_as_taco_optax_nnx(family, scan_layers, tied):
  traced, expected, scales, expected_scales, report = _example_traced(
      family, scan_layers, tied)
  assert _differences(traced, expected) == {}, str(report)
  assert _differences(scales, expected_scales) == {}, str(report)
  assert report.ambiguous == ()


def test_example_families_are_all_compared():
  from examples.finetune.model import config as config_lib  # pylint: disable=import-outside-toplevel
  assert tuple(config_lib.FAMILIES) == EXAMPLE_FAMILIES


def _entries(tree):
  """path -> entry of a dimension-numbers tree (entries kept whole)."""
  is_entry = lambda x: x is None or isinstance(x, (DN, ToAdam))
  return {taco_optax._src.routing.path_name(path): entry
          for path, entry in jax.tree_util.tree_flatten_with_path(
              tree, is_leaf=is_entry)[0]}


def _linen_models():
  nn = pytest.importorskip('flax.linen')

  class Mlp(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(jnp.tanh(nn.Dense(12)(x)))

  class Attention(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.LayerNorm()(x)
      q, k, v = (nn.DenseGeneral((2, 3), name=n)(x) for n in 'qkv')
      weights = jax.nn.softmax(jnp.einsum('btnh,bsnh->bnts', q, k), axis=-1)
      mixed = jnp.einsum('bnts,bsnh->btnh', weights, v)
      heads = nn.Einsum((2, 3, 8), 'btnh,nhd->btd', name='out')(mixed)
      return nn.DenseGeneral(8, axis=(-2, -1), name='o2')(q) + heads

  from tests.support.linen_models import LanguageModel  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x, _):
      heads = nn.DenseGeneral((2, 3), name='heads')(nn.LayerNorm()(x))
      return x + nn.remat(nn.Dense)(4)(x) + heads.sum(axis=(-2, -1))[
          ..., None], None

  def stack(axis):
    return nn.scan(Block, variable_axes={'params': axis},
                   split_rngs={'params': True}, length=3)()

  return {'mlp': (Mlp(), jnp.ones((5, 6))),
          'attention': (Attention(), jnp.ones((1, 4, 8))),
          'untied': (LanguageModel(False), jnp.array([[1, 2, 3]])),
          'tied': (LanguageModel(True), jnp.array([[1, 2, 3]])),
          'scan-axis-0': (stack(0), jnp.ones((2, 4)), None),
          'scan-axis-1': (stack(1), jnp.ones((2, 4)), None)}


@pytest.mark.parametrize('name', ['mlp', 'attention', 'untied', 'tied',
                                  'scan-axis-0', 'scan-axis-1'])
def test_linen_models_route_as_taco_optax_linen(name):
  linen = pytest.importorskip('taco_optax.linen')
  nn = pytest.importorskip('flax.linen')
  module, *args = _linen_models()[name]
  params = nn.meta.unbox(jax.eval_shape(module.init, jax.random.key(0),
                                        *args)['params'])
  apply = lambda params, *args: module.apply({'params': params}, *args)
  traced, report = _dims(apply, params, *args)
  expected = _entries(linen.dimension_numbers(module, *args))
  assert _differences(traced, expected) == {}, str(report)
  assert _differences(_entries(report.update_scales()), _entries(
      linen.update_scales(module, *args))) == {}


def test_a_matrix_without_a_linen_rule_is_read_from_its_use():
  # taco_optax.linen sends a raw self.param matrix to Adam (no module rule);
  # the trace sees x @ mix and routes it: the one difference on purpose.
  nn = pytest.importorskip('flax.linen')

  class Custom(nn.Module):

    @nn.compact
    def __call__(self, x):
      return x @ self.param('mix', nn.initializers.lecun_normal(), (4, 5))

  params = jax.eval_shape(Custom().init, jax.random.key(0), X)['params']
  apply = lambda params, x: Custom().apply({'params': params}, x)
  assert _dims(apply, params, X)[0] == {'mix': DN(0, 1)}


def _equinox_models():
  eqx = pytest.importorskip('equinox')
  keys = jax.random.split(jax.random.key(0), 8)

  def block(tokens, embed, attn, norm, head):
    h = jax.vmap(embed)(tokens)
    h = h + attn(h, h, h)
    return jax.vmap(head)(jax.vmap(norm)(h))

  stacked = eqx.filter_vmap(lambda key: eqx.nn.Linear(8, 4, key=key))(
      jax.random.split(keys[5], 3))
  table = eqx.nn.Embedding(20, 8, key=keys[6])
  head = eqx.nn.Linear(8, 20, use_bias=False, key=keys[7])
  tied = eqx.nn.Shared((table, head), where=lambda p: p[1].weight,
                       get=lambda p: p[0].weight)
  conv = (eqx.nn.Conv2d(3, 4, kernel_size=3, key=keys[3]),
          eqx.nn.Linear(4, 2, key=keys[4]))
  return {
      'linear': (eqx.nn.Linear(6, 3, key=keys[0]), lambda m, x: m(x),
                 jnp.ones(6)),
      'mlp': (eqx.nn.MLP(8, 4, width_size=16, depth=1, key=keys[1]),
              lambda m, x: m(x), jnp.ones(8)),
      'block': ((eqx.nn.Embedding(50, 16, key=keys[0]),
                 eqx.nn.MultiheadAttention(2, 16, qk_size=4, vo_size=4,
                                           key=keys[1]),
                 eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 50, key=keys[2])),
                lambda m, t: block(t, *m), jnp.arange(10)),
      'stacked': (stacked, lambda m, xs: jax.vmap(lambda l, x: l(x))(m, xs),
                  jnp.ones((3, 8))),
      'gru': (eqx.nn.GRUCell(16, 8, key=keys[3]),
              lambda m, x: m(x, jnp.ones(8)), jnp.ones(16)),
      'tied': (tied, lambda m, ids: jax.vmap(m()[1])(jax.vmap(m()[0])(ids)),
               jnp.arange(5)),
      'weight-norm': (eqx.nn.WeightNorm(eqx.nn.Linear(8, 4, key=keys[4])),
                      lambda m, x: m(x), jnp.ones(8)),
      'conv': (conv, lambda m, x: m[1](m[0](x).mean(axis=(1, 2))),
               jnp.ones((3, 6, 6)))}


@pytest.mark.parametrize('name', ['linear', 'mlp', 'block', 'stacked', 'gru',
                                  'tied', 'weight-norm', 'conv'])
def test_equinox_models_route_as_taco_optax_equinox(name):
  eqx = pytest.importorskip('equinox')
  taco_eqx = pytest.importorskip('taco_optax.equinox')
  model, call, x = _equinox_models()[name]
  params, static = eqx.partition(model, eqx.is_inexact_array)
  traced, report = _dims(
      lambda params, x: call(eqx.combine(params, static), x), params, x)
  expected = {path: entry for path, entry in _entries(
      taco_eqx.dimension_numbers(model)).items()
              if path in traced or entry is not None}  # not a static field
  if name == 'gru':
    # A GRU's gates are fused: weight_ih (3 hidden, in) is split into its
    # three gates after the matmul, which the tracer flags (a fused
    # projection, to Adam unless overridden); the helper keeps one matrix.
    assert set(report.ambiguous) == {'weight_ih', 'weight_hh'}, str(report)
    assert 'into 3 pieces (a fused projection' in str(report)
    traced = {p: e for p, e in traced.items() if p not in report.ambiguous}
    expected = {p: e for p, e in expected.items()
                if p not in report.ambiguous}
  assert _differences(traced, expected) == {}, str(report)


def test_layers_vmapped_over_one_shared_input_read_as_one_matrix():
  # vmap of stacked layers over the same x: jax writes one dot_general
  # whose free axes are the layers' and the outputs' (an ensemble is one
  # (layers * out, in) matrix); taco_optax.equinox keeps a matrix per layer.
  fn = lambda p, x: jax.vmap(lambda w: w @ x)(p['w'])
  dims, _ = _dims(fn, {'w': jnp.ones((3, 4, 8))}, jnp.ones(8))
  assert dims == {'w': DN(2, (0, 1))}


# --- (d) bad input: one clear error, naming the path ------------------------


def test_an_unused_matrix_is_refused_by_path():
  params = {'w1': jnp.ones((4, 6)), 'b1': jnp.ones(6), 'w2': jnp.ones((6, 3)),
            'extra': {'kernel': jnp.ones((3, 3))}, 'unused_bias': jnp.ones(3)}
  with pytest.raises(ValueError) as error:
    trace_dimension_numbers(_mlp, params, X)
  message = str(error.value)
  assert 'fn never uses 1 matrix parameter(s)' in message
  assert 'extra/kernel: shape (3, 3)' in message and 'unused' not in message
  assert 'overrides=' in message
  dims, _ = trace_dimension_numbers(_mlp, params, X,
                                    overrides={'extra/*': DN(0, 1)})
  assert dims['extra']['kernel'] == DN(0, 1)


def test_a_function_that_does_not_trace_is_named_with_its_error():
  fn = lambda p, x: x @ p['w'] if x.sum() > 0 else x  # Python branch on data
  with pytest.raises(ValueError, match='could not trace fn') as error:
    trace_dimension_numbers(fn, {'w': jnp.ones((4, 4))}, X)
  assert isinstance(error.value.__cause__, jax.errors.TracerBoolConversionError)


def test_mismatched_params_name_the_leaf_and_the_tree():
  with pytest.raises(ValueError) as error:
    trace_dimension_numbers(_mlp, {'w1': jnp.ones((4, 6)), 'b1': jnp.ones(6),
                                   'w2': jnp.ones((5, 3))}, X)
  message = str(error.value)
  assert 'dot_general requires contracting dimensions' in message
  assert 'The failing line holds parameter(s) w2 (5, 3).' in message
  assert 'params has 3 leaves: b1, w1, w2.' in message
  missing = r"KeyError: 'w2'(.|\n)*leaves: b1, w1\."
  with pytest.raises(ValueError, match=missing):
    trace_dimension_numbers(_mlp, {'w1': jnp.ones((4, 6)),
                                   'b1': jnp.ones(6)}, X)


def test_overrides_must_match_and_fit():
  params = {'w1': jnp.ones((4, 6)), 'b1': jnp.ones(6), 'w2': jnp.ones((6, 3))}
  with pytest.raises(ValueError, match=r"match no parameter: \['w3'\]"):
    trace_dimension_numbers(_mlp, params, X, overrides={'w3': None})
  with pytest.raises(ValueError, match='override .w2. for w2: output_axis=2'):
    trace_dimension_numbers(_mlp, params, X, overrides={'w2': DN(0, 2)})
  dims, report = trace_dimension_numbers(_mlp, params, X,
                                         overrides={'w2': None})
  assert isinstance(dims['w2'], ToAdam)  # equal to None, with its reason
  assert source_of(dims['w2']) == "override 'w2'"
  assert report['w2'].decision == 'override'
