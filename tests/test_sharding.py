"""TACO on a simulated 8-device CPU mesh: exactness, shardings, collectives.

The mesh tests need 8 host devices, which must be requested before JAX starts
its backend. With ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` they
run in this process; otherwise ``tests/test_multidevice.py`` reruns them in a
fresh process with that flag (the rest of the suite keeps its one device).
"""


import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax import TacoDimensionNumbers as Dims
from taco_optax._src import kernels
from taco_optax._src.layerwise import weight_update as _leaf_update
from taco_optax._src.layerwise import winners as _winners
from taco_optax._src.routing.dimension_numbers import normalize_axes
from taco_optax._src.sharding import mesh as _mesh
from taco_optax._src.transform import parts as _alias
from taco_optax._src.transform import plan as _leaf
from tests.support import layerwise_case
from tests.support import mesh_layered
from tests.support import multidevice
from tests.support.bitwise import assert_bitwise_equal
from tests.support.explicit_mesh_cases import LAYOUTS
from tests.support.explicit_mesh_cases import make_mesh
from tests.support.explicit_mesh_cases import normalized
from tests.support.explicit_mesh_cases import place
from tests.support.explicit_mesh_cases import sharding_specs
from tests.support.explicit_mesh_cases import specs
from tests.support.explicit_mesh_cases import tied_gradients
from tests.support.hlo_collectives import collectives
from tests.support.hlo_collectives import gathered_bytes

NUM_DEVICES = 8
needs_mesh = multidevice.needs_devices(NUM_DEVICES)


# The sharding rule itself needs no devices.


@pytest.mark.parametrize('shape, spec, dims, values_spec, exponents_spec', [
    ((64, 32), P('fsdp', 'tensor'), Dims(), P(None, 'fsdp'), P('fsdp')),
    ((64, 32), P(None, 'tensor'), Dims(), P(None, None), P(None)),
    ((64, 32), P(('fsdp', 'tensor'), None), Dims(), P(None, ('fsdp', 'tensor')),
     P(('fsdp', 'tensor'))),
    ((32, 64), P('tensor', 'fsdp'), Dims(1, 0), P(None, 'fsdp'), P('fsdp')),
    ((2, 16, 24), P('fsdp', None, 'tensor'), Dims(1, 2),
     P('fsdp', None, None), P('fsdp', None)),
    ((16, 4, 8), P('fsdp', 'tensor'), Dims(0, (1, 2)), P(None, 'fsdp'),
     P('fsdp')),
    ((4, 8, 16), P('fsdp', None, 'tensor'), Dims((0, 1), 2), P(None, 'fsdp'),
     P('fsdp')),
])
def test_state_specs_follow_batch_and_reduction_axes(shape, spec, dims,
                                                     values_spec,
                                                     exponents_spec):
  shards = _mesh.leaf_sharding(shape, spec, normalize_axes(shape, dims),
                               {'fsdp': 2, 'tensor': 4})
  assert shards.values_spec == values_spec
  assert shards.exponents_spec == exponents_spec


def test_state_specs_reject_unshardable_layouts():
  mesh_shape = {'fsdp': 2, 'tensor': 4}
  with pytest.raises(ValueError, match='not divisible'):
    _mesh.leaf_sharding((64, 30), P(None, 'tensor'),
                        normalize_axes((64, 30), Dims()), mesh_shape)
  with pytest.raises(ValueError, match='first reduction axis'):
    _mesh.leaf_sharding((4, 8, 16), P(None, 'fsdp', None),
                        normalize_axes((4, 8, 16), Dims((0, 1), 2)),
                        mesh_shape)


# Mesh tests.

@needs_mesh
@pytest.mark.parametrize('k', [4, 16])
def test_sharded_updates_and_states_equal_single_device_bitwise(k):
  names = list(LAYOUTS)
  dims = {name: LAYOUTS[name][2] for name in names}
  tx = taco_optax.scale_by_taco(k=k, mu=0.9, weight_dimension_numbers=dims)
  update = jax.jit(tx.update)
  params = {name: jnp.zeros(LAYOUTS[name][0]) for name in names}
  state = tx.init(params)
  expected = []
  for step in range(3):
    updates, state = update(tied_gradients(step, names), state)
    expected.append((updates, state))
  mesh = make_mesh()
  with jax.set_mesh(mesh):
    state = tx.init(place(params, mesh))
    for step in range(3):
      updates, state = update(place(tied_gradients(step, names), mesh), state)
      assert_bitwise_equal((updates, state), expected[step])
      for name in names:
        assert specs(updates[name]) == normalized(LAYOUTS[name][1],
                                                  updates[name].ndim)


@needs_mesh
def test_stochastic_rounding_on_mesh_equals_single_device_bitwise():
  # bf16 weights of every layout (and a bias for the Adam branch) at a rate
  # whose steps are mostly below half an ulp: the random bits decide.
  names = list(LAYOUTS)
  dims = {name: LAYOUTS[name][2] for name in names}
  dims['bias'] = None
  keys = iter(jax.random.split(jax.random.key(3), len(names)))
  params = {name: (0.02 * jax.random.normal(next(keys), LAYOUTS[name][0])
                   ).astype(jnp.bfloat16) for name in names}
  params['bias'] = jnp.ones((32,), jnp.bfloat16)
  grads = lambda step: dict(
      jax.tree.map(lambda g: g.astype(jnp.bfloat16),
                   tied_gradients(step, names)),
      bias=jnp.full((32,), (-1.0) ** step, jnp.bfloat16))
  tx = taco_optax.taco(3e-5, k=4, weight_dimension_numbers=dims,
                       adam_learning_rate=1e-3)

  @jax.jit
  def step(p, state, g):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  def run(p, put=lambda tree: tree):
    state = tx.init(p)
    for i in range(3):
      p, state = step(p, state, put(grads(i)))
    return p, state

  expected = run(params)
  mesh = make_mesh()
  with jax.set_mesh(mesh):
    put = lambda tree: dict(place(tree, mesh, names), bias=jax.device_put(
        tree['bias'], NamedSharding(mesh, P('tensor'))))
    got = run(put(params), put)
  assert_bitwise_equal(got, expected)
  moved = lambda tree: sum(int(np.sum(np.asarray(tree[n] != params[n])))
                           for n in params)
  assert moved(expected[0]) > 0


@needs_mesh
def test_state_shardings_stable_across_init_update_and_jit():
  names = list(LAYOUTS)
  dims = {name: LAYOUTS[name][2] for name in names}
  tx = taco_optax.scale_by_taco(k=4, weight_dimension_numbers=dims)
  mesh = make_mesh()
  with jax.set_mesh(mesh):
    params = place({n: jnp.ones(LAYOUTS[n][0]) for n in names}, mesh)
    eager_state = tx.init(params)
    expected = sharding_specs(taco_optax.state_shardings(tx, params),
                              eager_state)
    shards = {n: _mesh.leaf_sharding(
        LAYOUTS[n][0], LAYOUTS[n][1], normalize_axes(LAYOUTS[n][0], dims[n]),
        {'fsdp': 2, 'tensor': 4}) for n in names}
    assert expected.values == {
        n: normalized(s.values_spec, eager_state.values[n].ndim)
        for n, s in shards.items()}
    assert expected.exponents == {
        n: normalized(s.exponents_spec, eager_state.exponents[n].ndim)
        for n, s in shards.items()}
    jit_state = jax.jit(tx.init)(params)
    grads = place(tied_gradients(0, names), mesh)
    update = jax.jit(tx.update)
    _, jit_updated = update(grads, jit_state)
    _, jit_updated_twice = update(grads, jit_updated)
    for state in (eager_state, jit_state, jit_updated, jit_updated_twice):
      assert specs(state) == expected
    # Op-by-op updates are slow on CPU: check them on one leaf.
    one = lambda tree: {'both': tree['both']}
    tx_one = taco_optax.scale_by_taco(k=4, weight_dimension_numbers=one(dims))
    _, eager_updated = tx_one.update(one(grads), tx_one.init(one(params)))
    assert specs(eager_updated) == jax.tree.map(
        one, expected, is_leaf=lambda x: isinstance(x, dict))


@needs_mesh
def test_taco_alias_train_step_on_mesh_matches_single_device():
  """The full optax path (partition + AdamW) in a jitted train step."""
  mesh = make_mesh()
  layouts = {'w1': P('fsdp', 'tensor'), 'b1': P('tensor'),
             'w2': P('tensor', 'fsdp'), 'b2': P()}
  keys = jax.random.split(jax.random.key(0), 4)
  params = {'w1': jax.random.normal(keys[0], (16, 32)) * 0.3,
            'b1': jnp.zeros((32,)),
            'w2': jax.random.normal(keys[1], (32, 8)) * 0.3,
            'b2': jnp.zeros((8,))}
  inputs = jax.random.normal(keys[2], (12, 16))
  targets = jax.random.normal(keys[3], (12, 8))

  def loss(p):
    hidden = jnp.tanh(mesh_layered.matmul(inputs, p['w1']) + p['b1'])
    return jnp.mean(
        (mesh_layered.matmul(hidden, p['w2']) + p['b2'] - targets) ** 2)

  tx = taco_optax.taco(learning_rate=1e-2, k=4)

  @jax.jit
  def train_step(p, state):
    updates, state = tx.update(jax.grad(loss)(p), state, p)
    return optax.apply_updates(p, updates), state

  def run(p):
    state = tx.init(p)
    for _ in range(4):
      p, state = train_step(p, state)
    return p, state

  expected_params, expected_state = run(params)
  with jax.set_mesh(mesh):
    sharded = {n: jax.device_put(x, NamedSharding(mesh, layouts[n]))
               for n, x in params.items()}
    got_params, got_state = run(sharded)
    assert specs(got_params) == {n: normalized(layouts[n], x.ndim)
                                 for n, x in params.items()}
    assert specs(got_state) == sharding_specs(
        taco_optax.state_shardings(tx, sharded), got_state)
  # Sharded matmuls sum in another order, so gradients may differ in the last
  # bit; TACO's winners, and hence the signs it applies, must not.
  chex_close = lambda a, b: np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5,
      atol=1e-6)
  jax.tree.map(chex_close, got_params, expected_params)
  taco_state = lambda s: s.inner_states['taco'].inner_state[0]
  assert_bitwise_equal(taco_state(got_state).indices,
                       taco_state(expected_state).indices)


@needs_mesh
def test_auto_mesh_uses_state_shardings_for_init():
  """With Auto axes JAX does not track shardings: state_shardings does."""
  mesh = make_mesh(explicit=False)
  names = ['fsdp', 'tp', 'both', 'scanned']
  dims = {name: LAYOUTS[name][2] for name in names}
  tx = taco_optax.scale_by_taco(k=4, weight_dimension_numbers=dims)
  params = place({n: jnp.ones(LAYOUTS[n][0]) for n in names}, mesh)
  shardings = taco_optax.state_shardings(tx, params)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  assert specs(state) == sharding_specs(shardings, state)
  assert specs(state.values['both']) == ((), ('fsdp',))
  # XLA's own partitioning of the unmodified step is exact here too.
  grads = tied_gradients(0, names)
  expected = jax.jit(tx.update)(grads, tx.init(grads))
  got = jax.jit(tx.update, out_shardings=(
      {n: NamedSharding(mesh, LAYOUTS[n][1]) for n in names}, shardings))(
          place(grads, mesh), state)
  assert_bitwise_equal(got, expected)


@needs_mesh
def test_array_hyperparameters_and_nonfinite_gradient_on_mesh():
  tx = optax.inject_hyperparams(taco_optax.scale_by_taco, static_args=('k',))(
      k=4, mu=0.9, update_scale=0.5)
  mesh = make_mesh()
  grads = tied_gradients(0, ['both'])
  expected_updates, expected_state = jax.jit(tx.update)(grads, tx.init(grads))
  with jax.set_mesh(mesh):
    state = tx.init(place(grads, mesh))
    updates, state = jax.jit(tx.update)(place(grads, mesh), state)
    assert_bitwise_equal((updates, state), (expected_updates, expected_state))
    # One NaN on one device: every device must keep its history.
    bad = grads['both'].at[40, 30].set(jnp.nan)
    bad_updates, bad_state = jax.jit(tx.update)(place({'both': bad}, mesh),
                                                state)
  assert np.isnan(np.asarray(bad_updates['both'])).all()
  assert_bitwise_equal(bad_state.inner_state, state.inner_state)


@needs_mesh
def test_output_sharded_update_gathers_candidates_not_the_gradient():
  n, m, k, tensor = 256, 1024, 16, 8
  mesh = jax.make_mesh((1, tensor), ('fsdp', 'tensor'))
  tx = taco_optax.scale_by_taco(k=k)
  with jax.set_mesh(mesh):
    grad = jax.device_put(jnp.ones((n, m)),
                          NamedSharding(mesh, P(None, 'tensor')))
    state = tx.init({'w': grad})
    hlo = jax.jit(tx.update).lower({'w': grad}, state).compile().as_text()
  found = collectives(hlo)
  ops = {op for op, _ in found}
  assert 'all-gather' in ops, found
  # Each device's all-gather results: k candidates of each of its
  # `tensor` shards for every column, as f32 values and s32 indices.
  candidates = n * k * tensor * (4 + 4)
  assert gathered_bytes(hlo) == candidates, found
  dense = n * m * 4
  assert all(nbytes < dense // 4 for _, nbytes in found), found


@needs_mesh
def test_communication_volume_against_gathering_the_gradient(capsys):
  """Measures the bytes the TP update moves (reported, and bounded)."""
  n, m, k, tensor = 1024, 4096, 16, 8
  mesh = jax.make_mesh((1, tensor), ('fsdp', 'tensor'))
  tx = taco_optax.scale_by_taco(k=k)
  with jax.set_mesh(mesh):
    grad = jax.ShapeDtypeStruct((n, m), jnp.float32,
                                sharding=NamedSharding(mesh, P(None,
                                                               'tensor')))
    state = jax.eval_shape(tx.init, {'w': grad})
    sharded_hlo = jax.jit(tx.update).lower({'w': grad},
                                           state).compile().as_text()
    gather = jax.jit(lambda g: jax.sharding.reshard(g, P()))
    dense_hlo = gather.lower(grad).compile().as_text()
  # For comparison: XLA's own partitioning of the same step on an Auto mesh.
  auto_mesh = jax.make_mesh((1, tensor), ('fsdp', 'tensor'),
                            axis_types=(AxisType.Auto, AxisType.Auto))
  auto_grad = jax.ShapeDtypeStruct(
      (n, m), jnp.float32,
      sharding=NamedSharding(auto_mesh, P(None, 'tensor')))
  auto_shardings = taco_optax.state_shardings(tx, {'w': auto_grad})
  auto_state = jax.tree.map(
      lambda sh, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      auto_shardings, jax.eval_shape(tx.init, {'w': auto_grad}))
  auto_hlo = jax.jit(
      tx.update, out_shardings=({'w': auto_grad.sharding}, auto_shardings)
  ).lower({'w': auto_grad}, auto_state).compile().as_text()
  candidate_bytes = gathered_bytes(sharded_hlo)
  dense_bytes = gathered_bytes(dense_hlo)
  received = lambda total: total * (tensor - 1) // tensor
  with capsys.disabled():
    print(f'\n[communication] n={n} m={m} k={k} tensor={tensor}: per device '
          f'all-gather result {candidate_bytes} B (receives '
          f'{received(candidate_bytes)} B) for the merged top-k vs '
          f'{dense_bytes} B (receives {received(dense_bytes)} B) to gather '
          f'the dense gradient: {dense_bytes / candidate_bytes:.1f}x less. '
          f'XLA on an Auto mesh: {gathered_bytes(auto_hlo)} B all-gathered, '
          f'collectives {collectives(auto_hlo)}')
  assert dense_bytes == n * m * 4
  assert candidate_bytes == n * k * tensor * 8
  assert dense_bytes / candidate_bytes == m * 4 / (k * tensor * 8)


@needs_mesh
@pytest.mark.jax_versions
@pytest.mark.parametrize('explicit,error,message', [
    # jax checks the spec's rank against the value's: an assert on jax 0.10,
    # a ValueError on jax 0.12.
    (True, (AssertionError, ValueError), r"^\(1, P\('fsdp', 'tensor'\)\)|"
     r"Length of sharding.spec \(2\) must be equal to aval's ndim \(1\)"),
    (False, ValueError, 'is only valid for values of rank at least 2, but '
     'was applied to a value of rank 1'),
])
def test_nnx_optimizer_state_gets_taco_shardings(explicit, error, message):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  mesh = make_mesh(explicit)
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(),
                               ('fsdp', 'tensor'))
  bias_init = nnx.with_partitioning(nnx.initializers.zeros_init(),
                                    ('tensor',))

  with jax.set_mesh(mesh):
    model = nnx.Linear(16, 32, kernel_init=init, bias_init=bias_init,
                       rngs=nnx.Rngs(0))
    tx = taco_optax.taco(learning_rate=1e-2, k=4)
    # Without the helper nnx copies the kernel's ('fsdp', 'tensor') onto the
    # rank-1 exponents and fails to place them.
    with pytest.raises(error, match=message):
      nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer = nnx.Optimizer(model, taco_optax.nnx.for_nnx_optimizer(tx),
                              wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, inputs):
      grads = nnx.grad(lambda m: jnp.mean(m(inputs) ** 2))(model)
      optimizer.update(model, grads)

    train_step(model, optimizer, jnp.ones((4, 16)))

  taco_state = optimizer.opt_state.inner_states['taco'].inner_state[0]
  adam_state = optimizer.opt_state.inner_states['adam'].inner_state[0]
  for name, variable, spec in [
      ('values', taco_state.values['kernel'], P(None, 'fsdp')),
      ('indices', taco_state.indices['kernel'], P(None, 'fsdp')),
      ('exponents', taco_state.exponents['kernel'], P('fsdp')),
      ('adam mu', adam_state.mu['bias'], P('tensor'))]:
    value = variable.get_value()
    assert specs(value) == normalized(spec, value.ndim), name
    assert normalized(P(*variable.get_metadata('out_sharding')),
                      value.ndim) == normalized(spec, value.ndim), name
  assert specs(model.kernel.get_value()) == (('fsdp',), ('tensor',))


# The layer-wise train step on a mesh.

@needs_mesh
@pytest.mark.parametrize('scan_layers, update_topk, chunked, layouts, dtype', [
    (False, 1, False, tuple(mesh_layered.LAYERWISE_LAYOUTS), jnp.float32),
    (True, 2, False, tuple(mesh_layered.LAYERWISE_LAYOUTS), jnp.float32),
    (False, 2, True, ('both',), jnp.float32),
    # bf16 weights: stochastic rounding draws the same bits per device.
    (True, 1, False, tuple(mesh_layered.LAYERWISE_LAYOUTS), jnp.bfloat16),
    (False, 1, True, ('both',), jnp.bfloat16)])
def test_layerwise_step_on_mesh_equals_single_device(
    scan_layers, update_topk, chunked, layouts, dtype):
  # chunked: every unrolled matrix through the column-block scan.
  train = layerwise_case.train(
      mesh_layered.layered_loss(scan_layers), learning_rate=1e-2, k=4, mu=0.9,
      update_topk=update_topk,
      weight_dimension_numbers=mesh_layered.layered_dims,
      adam_learning_rate=1e-3, column_block_elements=64 if chunked else None)
  run = mesh_layered.three_steps(train)

  start = jax.tree.map(lambda x: x.astype(dtype),
                       mesh_layered.layered_params(scan_layers))
  expected = run(start)
  # In bf16 the gradients themselves are bf16 sums that the sharded matmuls
  # reorder: the FP8 history may then differ in a value (not in which rows
  # it keeps, nor in the weights the stochastic rounding writes).
  def group(path):
    name = jax.tree_util.keystr(path)
    if "'b_up'" in name:
      return 'adam'
    return 'history' if dtype != jnp.float32 and '.values' in name else 'exact'

  split = lambda tree: [
      [x for path, x in jax.tree_util.tree_leaves_with_path(tree)
       if group(path) == kind] for kind in ('exact', 'adam', 'history')]
  mesh = make_mesh()
  for layout in layouts:
    with jax.set_mesh(mesh):
      sharded = mesh_layered.place_layered(start, mesh, layout)
      got = run(sharded)
      assert specs(got[0]) == specs(sharded), layout
      assert specs(got[1]) == sharding_specs(
          taco_optax.state_shardings(train.optimizer, sharded), got[1]), layout
    # TACO weights and state (and the step count) bitwise. The AdamW biases'
    # gradients are sums over the batch, which the sharded matmuls reorder:
    # they, and their moments, may differ in the last bits (in bf16 the
    # gradient's sum is itself bf16: a few ulps, 2.3% measured on one
    # moment near 3e-4).
    (got_exact, got_adam, got_history), (expected_exact, expected_adam,
                                         expected_history) = (
        split(got), split(expected))
    assert_bitwise_equal(got_exact, expected_exact)
    rtol = 1e-6 if dtype == jnp.float32 else 2.0 ** -5
    for a, e in zip(got_adam, expected_adam):
      np.testing.assert_allclose(np.asarray(a, np.float32),
                                 np.asarray(e, np.float32), rtol=rtol,
                                 atol=1e-8, err_msg=layout)
    for a, e in zip(got_history, expected_history):
      assert np.mean(np.asarray(a) != np.asarray(e)) <= 0.01, layout
  # The weights did move.
  assert not np.array_equal(expected[0][0]['w_out'], start[0]['w_out'])


@needs_mesh
def test_layerwise_leaf_update_gathers_candidates_not_the_gradient():
  n, m, k, tensor = 256, 1024, 16, 8
  mesh = jax.make_mesh((1, tensor), ('fsdp', 'tensor'))
  tx = taco_optax.taco(1e-3, k=k)
  dims = Dims()
  (plan,) = _leaf.leaf_plans({'w': jnp.zeros((n, m))}, dims, None, 1)
  lr_tx = optax.scale_by_learning_rate(1e-3)
  update = lambda p, g, state, lr: _leaf_update.taco_leaf_update(
      p, g, kernels.History(*state), _winners.WinnerWrite(
          plan=plan, mu=0.95, learning_rate=lr_tx, learning_rate_state=lr,
          block_elements=2**20))
  with jax.set_mesh(mesh):
    weight = jax.ShapeDtypeStruct((n, m), jnp.float32,
                                  sharding=NamedSharding(mesh,
                                                         P(None, 'tensor')))
    state = jax.eval_shape(tx.init, {'w': weight})
    states = _alias.taco_states(state)
    lr_state = states.learning_rate
    leaf_state = tuple(field['w'] for field in states.direction)
    hlo = jax.jit(update).lower(weight, weight, leaf_state,
                                lr_state).compile().as_text()
  found = collectives(hlo)
  # k candidates of each of the `tensor` shards per column (f32 values and
  # s32 indices), and the finiteness flag; the weight is updated in place.
  assert gathered_bytes(hlo) == n * k * tensor * (4 + 4), found
  assert sorted(b for op, b in found if op != 'all-gather') == [4], found
