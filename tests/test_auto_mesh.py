"""TACO on an 8-device CPU mesh with Auto axes: exact, and no gathered gradient.

With :attr:`AxisType.Auto` axes XLA partitions the update itself; the column
step's partitioning rule (``_auto_partition``) keeps each device on its own
block. The tests run in a subprocess with 8 simulated devices (see
``tests/support/multidevice.py``).
"""

import re

import jax
from jax._src import compilation_cache as jax_compilation_cache  # pylint: disable=g-bad-import-order
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import taco_optax
from taco_optax import TacoDimensionNumbers as Dims
from taco_optax._src.sharding import auto_partition as _auto_partition
from tests.support import mesh_layered
from tests.support import multidevice
from tests.support.auto_mesh_cases import LAYOUTS
from tests.support.auto_mesh_cases import auto_mesh
from tests.support.auto_mesh_cases import run_steps
from tests.support.auto_mesh_cases import tied_gradients
from tests.support.bitwise import assert_bitwise_equal
from tests.support.explicit_mesh_cases import specs
from tests.support.hlo_collectives import collectives
from tests.support.hlo_collectives import gathered_bytes

NUM_DEVICES = 8
needs_mesh = multidevice.needs_devices(NUM_DEVICES)

@needs_mesh
@pytest.mark.parametrize('kernel, k', [('cpu', 4), ('reference', 4),
                                       ('cpu', 16), ('reference', 16)])
def test_taco_on_auto_mesh_equals_single_device_bitwise(monkeypatch, kernel,
                                                        k):
  monkeypatch.setenv('TACO_OPTAX_KERNEL', kernel)
  names = list(LAYOUTS)
  tx = taco_optax.taco(
      1e-2, k=k, mu=0.9,
      weight_dimension_numbers={n: LAYOUTS[n][2] for n in names})
  expected = run_steps(tx, names)
  got = run_steps(tx, names, auto_mesh())
  for step, (got_step, expected_step) in enumerate(zip(got, expected)):
    assert_bitwise_equal(got_step, expected_step)
    for name in names:
      assert got_step[0][name].sharding.spec == LAYOUTS[name][1], (step, name)
  # The NaN step kept every history and gave NaN updates.
  taco_state = lambda s: s.inner_states['taco'].inner_state[0]
  assert_bitwise_equal(taco_state(got[2][1]), taco_state(got[1][1]))
  assert np.isnan(np.asarray(got[2][0]['both'])).all()


@needs_mesh
@pytest.mark.parametrize('kernel', ['auto', 'reference'])
def test_taco_under_set_mesh_equals_single_device_bitwise(monkeypatch, kernel):
  """The same with the Auto mesh also set as the context mesh."""
  monkeypatch.setenv('TACO_OPTAX_KERNEL', kernel)
  names = ['tp', 'fsdp', 'both', 'scanned']
  tx = taco_optax.taco(
      1e-2, k=4, mu=0.9,
      weight_dimension_numbers={n: LAYOUTS[n][2] for n in names})
  expected = run_steps(tx, names)
  mesh = auto_mesh()
  with jax.set_mesh(mesh):
    got = run_steps(tx, names, mesh)
  assert_bitwise_equal(got, expected)


@needs_mesh
@pytest.mark.parametrize('kernel', ['cpu', 'reference'])
def test_array_mu_on_auto_mesh_equals_single_device_bitwise(monkeypatch,
                                                            kernel):
  """``mu`` from inject_hyperparams enters the op as a replicated array."""
  monkeypatch.setenv('TACO_OPTAX_KERNEL', kernel)
  names = ['tp', 'fsdp', 'both']
  tx = optax.inject_hyperparams(taco_optax.scale_by_taco, static_args=('k',))(
      k=4, mu=0.9)
  assert_bitwise_equal(run_steps(tx, names, auto_mesh()),
                       run_steps(tx, names))


@needs_mesh
@pytest.mark.parametrize('kernel', ['cpu', 'reference'])
def test_vmapped_update_equals_each_entry(monkeypatch, kernel):
  """Under vmap (no partitioning rule applies) each entry is one leaf."""
  monkeypatch.setenv('TACO_OPTAX_KERNEL', kernel)
  names = ['tp', 'scanned']
  tx = taco_optax.scale_by_taco(
      k=4, mu=0.9, weight_dimension_numbers={n: LAYOUTS[n][2] for n in names})
  entries = [tied_gradients(step, names, nan=step == 1) for step in range(3)]
  states = [tx.init(grads) for grads in entries]
  expected = [jax.jit(tx.update)(grads, state)
              for grads, state in zip(entries, states)]
  stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  got = jax.jit(jax.vmap(tx.update))(stack(entries), stack(states))
  assert_bitwise_equal(got, stack(expected))


def gathered_elements(hlo_text):
  """Element counts of every all-gather result in compiled HLO text."""
  counts = []
  for line in hlo_text.splitlines():
    match = re.search(r'= \(?([^=]*?)\)? all-gather(?:-start)?\(', line)
    if match:
      counts.append(sum(
          int(np.prod([int(d) for d in dims.split(',') if d]))
          for dims in re.findall(r'\w+\[([\d,]*)\]', match.group(1))))
  return counts


# (shape, spec, dims, row shards, candidate shards); 256 rows of 512.
HLO_CASES = {
    'tp': ((256, 512), P(None, 'tensor'), Dims(), 1, 4),
    'tp_over_all': ((256, 512), P(None, ('fsdp', 'tensor')), Dims(), 1, 8),
    'both': ((256, 512), P('fsdp', 'tensor'), Dims(), 2, 4),
    'fsdp': ((256, 512), P('fsdp', None), Dims(), 2, 1),
    'scanned_tp': ((2, 128, 512), P(None, None, 'tensor'), Dims(1, 2), 1, 4),
    'scanned_layers': ((2, 128, 512), P('fsdp', None, 'tensor'), Dims(1, 2),
                       2, 4),
}


@needs_mesh
@pytest.mark.parametrize('case', list(HLO_CASES))
@pytest.mark.parametrize('kernel, context_mesh', [
    ('cpu', False), ('reference', False), ('auto', True)])
def test_auto_mesh_update_gathers_candidates_not_the_gradient(
    monkeypatch, case, kernel, context_mesh):
  monkeypatch.setenv('TACO_OPTAX_KERNEL', kernel)
  # XLA calls the partitioning rule only when it compiles: a program the
  # run's persistent compilation cache holds (the same HLO from another case
  # or file) would be loaded without calling it, and nothing be recorded.
  # jax decides once per process whether that cache is used (an earlier
  # test that set a cache folder turns it on for good: the flag
  # jax_enable_compilation_cache is not read again), so the test answers that
  # question itself, and drops the executables held in memory.
  monkeypatch.setattr(jax_compilation_cache, 'is_cache_used',
                      lambda backend: False)
  jax.clear_caches()
  shape, spec, dims, row_shards, candidate_shards = HLO_CASES[case]
  k = 16
  rows = int(np.prod(shape[:-1]))
  splits = []
  per_device_step = _auto_partition._per_device_step

  def record(local_step, update_topk, mesh, row_axes, candidate_axes, *args):
    splits.append((row_axes, candidate_axes))
    return per_device_step(local_step, update_topk, mesh, row_axes,
                           candidate_axes, *args)

  monkeypatch.setattr(_auto_partition, '_per_device_step', record)
  # Fresh ops: XLA calls the partitioning rule when it compiles, and the
  # persistent compilation cache would serve a program compiled with the same
  # op before (another kernel's test with the same rows) without calling it.
  monkeypatch.setattr(_auto_partition, '_ops', {})
  mesh = auto_mesh()
  tx = taco_optax.scale_by_taco(k=k, weight_dimension_numbers=dims)
  grad = jax.ShapeDtypeStruct(shape, jnp.float32,
                              sharding=NamedSharding(mesh, spec))
  state_shardings = taco_optax.state_shardings(tx, {'w': grad})
  state = jax.tree.map(
      lambda sharding, x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                               sharding=sharding),
      state_shardings, jax.eval_shape(tx.init, {'w': grad}))
  update = jax.jit(tx.update, out_shardings=({'w': grad.sharding},
                                             state_shardings))
  if context_mesh:
    with jax.set_mesh(mesh):
      hlo = update.lower({'w': grad}, state).compile().as_text()
  else:
    hlo = update.lower({'w': grad}, state).compile().as_text()
  found = collectives(hlo)
  if candidate_shards == 1:
    assert gathered_bytes(hlo) == 0, found
  else:
    # k f32 values and k s32 indices of every shard for this device's rows.
    assert gathered_bytes(hlo) == (
        rows // row_shards) * k * candidate_shards * (4 + 4), found
  assert max(gathered_elements(hlo), default=0) <= k * rows * candidate_shards
  # Besides the candidates, only the finiteness flag crosses devices.
  assert [b for op, b in found if op != 'all-gather'] == [4], found
  # The op got the rows split as the parameter is: no resharding before it.
  size = lambda axes: int(np.prod([dict(zip(mesh.axis_names,
                                            mesh.axis_sizes))[a]
                                   for a in axes]))
  assert [(size(r), size(c)) for r, c in splits] == [
      (row_shards, candidate_shards)], splits


@needs_mesh
@pytest.mark.parametrize('scan_layers', [False, True])
@pytest.mark.parametrize('layout', ['both', 'tp'])
def test_layerwise_step_on_auto_mesh_equals_single_device(scan_layers,
                                                          layout):
  """``layerwise.train_step`` with Auto axes: XLA partitions the step, the
  column step's rule keeps each device on its block."""
  from tests.support import layerwise_case  # pylint: disable=g-import-not-at-top
  train = layerwise_case.train(
      mesh_layered.layered_loss(scan_layers), learning_rate=1e-2, k=4, mu=0.9,
      weight_dimension_numbers=mesh_layered.layered_dims,
      adam_learning_rate=1e-3)
  run = mesh_layered.three_steps(train)

  start = mesh_layered.layered_params(scan_layers)
  expected = run(start)
  sharded = mesh_layered.place_layered(start, auto_mesh(), layout)
  got = run(sharded)
  assert specs(got[0]) == specs(sharded)
  # TACO's weights and state bitwise; the AdamW biases' gradients are batch
  # sums that the partitioned matmuls reorder (last bits only).
  adam = lambda path: "'b_up'" in jax.tree_util.keystr(path)
  split = lambda tree, want: [
      x for path, x in jax.tree_util.tree_leaves_with_path(tree)
      if adam(path) == want]
  assert_bitwise_equal(split(got, False), split(expected, False))
  for have, want in zip(split(got, True), split(expected, True)):
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-6,
                               atol=1e-8)
  assert not np.array_equal(expected[0][0]['w_out'], start[0]['w_out'])
