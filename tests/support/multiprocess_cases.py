"""One process of a multi-process TACO run.

``python -m tests.support.multiprocess_cases CASE[,CASE...] OUT_DIR
[--coordinator HOST:PORT --num-processes N --process-id I]`` joins JAX's
multi-process runtime (gloo collectives on CPU) when given a coordinator,
builds the cases' 8-device meshes over every process's devices, runs each
CASE's steps in turn and has process 0 write every resulting array, gathered
whole (``process_allgather``), to ``OUT_DIR/CASE.npz`` with ``CASE.json``
(each array's dtype, shape, sharding spec and whether it spans processes).
Run once on 1 process x 8 devices and once on 2 processes x 4 devices, the
two files must agree byte for byte (``tests/test_multiprocess.py``). The
cases are the one-process mesh tests' (``tests/test_sharding.py``,
``tests/test_auto_mesh.py``, ``tests/support/mesh_layered.py``), reused.
"""

import argparse
import json
import os
import sys

import numpy as np

# The meshes: 8 devices as fsdp=2 x tensor=4. 'fsdp_across': the fsdp axis
# runs across processes (process 0 holds fsdp row 0); 'tensor_across': each
# tensor group holds devices of both processes, so the merged top-k's
# candidates cross processes.
MESHES = ('fsdp_across', 'tensor_across')
# What crossing processes adds to a case is the transport: each path runs
# across processes once per mesh it can tell apart. Every combination of
# layout, mesh, axis type and kernel is compared with one device in one
# process by the 8-device tests (tests/test_sharding.py,
# tests/test_auto_mesh.py), whose cases these are.


def make_mesh(kind: str, explicit: bool):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top
  # jax.devices() lists process 0's devices first, then process 1's: with
  # one process the same positions hold the same device ids' roles.
  devices = np.array(jax.devices()).reshape(2, 2, 2)  # (process, a, b)
  if kind == 'fsdp_across':
    grid = devices.reshape(2, 4)
  else:
    grid = devices.transpose(1, 0, 2).reshape(2, 4)
  axis_type = AxisType.Explicit if explicit else AxisType.Auto
  return jax.sharding.Mesh(grid, ('fsdp', 'tensor'),
                           axis_types=(axis_type, axis_type))


def _optax_case():
  """``scale_by_taco`` (explicit meshes, both) and ``taco`` with AdamW (the
  mesh where the top-k's candidates cross processes), 3 steps each."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import taco_optax  # pylint: disable=g-import-not-at-top
  from tests.support import explicit_mesh_cases as cases  # pylint: disable=g-import-not-at-top

  names = list(cases.LAYOUTS)
  dims = {n: cases.LAYOUTS[n][2] for n in names}
  params = {n: 0.1 * jax.random.normal(jax.random.key(i), cases.LAYOUTS[n][0])
            for i, n in enumerate(names)}
  results = {}
  for kind in MESHES:
    mesh = make_mesh(kind, explicit=True)
    with jax.set_mesh(mesh):
      tx = taco_optax.scale_by_taco(k=4, mu=0.9, weight_dimension_numbers=dims)
      placed = cases.place(params, mesh)
      state = tx.init(placed)
      expected_specs = cases.sharding_specs(
          taco_optax.state_shardings(tx, placed), state)
      update = jax.jit(tx.update)
      for step in range(3):
        updates, state = update(cases.place(cases.tied_gradients(step, names),
                                            mesh), state)
        results[f'{kind}/scale_by_taco/{step}'] = (updates, state)
        if cases.specs(state) != expected_specs:
          raise AssertionError(f'state_shardings disagree with the state: '
                               f'{cases.specs(state)} vs {expected_specs}')
      if kind != 'tensor_across':
        continue
      alias = taco_optax.taco(1e-2, k=4, mu=0.9, weight_dimension_numbers=dims,
                              adam_learning_rate=1e-3)

      @jax.jit
      def train(p, s, g, alias=alias):
        updates, s = alias.update(g, s, p)
        return optax.apply_updates(p, updates), s

      current, alias_state = placed, alias.init(placed)
      for step in range(3):
        current, alias_state = train(current, alias_state, cases.place(
            cases.tied_gradients(step, names), mesh))
      results[f'{kind}/taco'] = (current, alias_state)
  return results


def put_global(tree, shardings):
  """``tree``'s arrays (the same on every process) placed on ``shardings``.

  ``jax.device_put`` checks that a value is the same on every process with
  ``==``, which refuses any array holding a NaN; here each process hands in
  its own devices' blocks.
  """
  import jax  # pylint: disable=g-import-not-at-top

  def put(x, sharding):
    whole = np.asarray(x)
    return jax.make_array_from_callback(whole.shape, sharding,
                                        lambda index: whole[index])
  return jax.tree.map(put, tree, shardings)


def _auto_case():
  """The Auto-mesh rule (``_auto_partition``), C++ kernel and reference, on
  the mesh where the top-k's candidates cross processes."""
  import taco_optax  # pylint: disable=g-import-not-at-top
  from tests.support import auto_mesh_cases as cases  # pylint: disable=g-import-not-at-top

  names = list(cases.LAYOUTS)
  results = {}
  for kernel in ('cpu', 'reference'):
    os.environ['TACO_OPTAX_KERNEL'] = kernel
    for kind in ('tensor_across',):
      tx = taco_optax.taco(
          1e-2, k=4, mu=0.9,
          weight_dimension_numbers={n: cases.LAYOUTS[n][2] for n in names})
      results[f'{kind}/{kernel}'] = cases.run_steps(
          tx, names, make_mesh(kind, explicit=False), put_global)
  return results


# (scan_layers, mesh, explicit axes): each choice of the three once, in two
# runs of the layer-wise step (the 8-device tests compare every pair in one
# process).
LAYERWISE_RUNS = ((False, 'fsdp_across', True), (True, 'tensor_across', False))


def _layerwise_case():
  """``layerwise.train_step``: stacked and unrolled, explicit and Auto."""
  import contextlib  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  # pylint: disable-next=g-import-not-at-top
  from tests.support import layerwise_case

  # pylint: disable-next=g-import-not-at-top
  from tests.support import mesh_layered

  results = {}
  inputs = [jax.random.normal(jax.random.key(10 + i), (8, 16))
            for i in range(3)]
  for scan_layers, kind, explicit in LAYERWISE_RUNS:
    train = layerwise_case.train(
        mesh_layered.layered_loss(scan_layers), learning_rate=1e-2, k=4,
        mu=0.9,
        weight_dimension_numbers=mesh_layered.layered_dims,
        adam_learning_rate=1e-3)
    params = mesh_layered.layered_params(scan_layers)
    mesh = make_mesh(kind, explicit)
    with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
      params = mesh_layered.place_layered(params, mesh, 'both')
      state = train.optimizer.init(params)
      step = jax.jit(train.step)
      for x in inputs:
        params, state, loss = step(params, state, x)
    axes = 'explicit' if explicit else 'auto'
    results[f'{kind}/{axes}/scan={scan_layers}'] = (params, state, loss)
  return results


CASES = {'optax': _optax_case, 'auto': _auto_case,
         'layerwise': _layerwise_case}


def _saved(results):
  """Every leaf gathered whole: ``({path: bytes-view array}, {path: info})``."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  arrays, info = {}, {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(results)[0]:
    name = jax.tree_util.keystr(path)
    whole = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    sharding = leaf.sharding
    info[name] = {
        'dtype': whole.dtype.name, 'shape': list(whole.shape),
        'spec': str(getattr(sharding, 'spec', None)),
        'spans_processes': not leaf.is_fully_addressable,
    }
    arrays[name] = whole.reshape(-1).view(np.uint8)
  return arrays, info


def main(argv=None) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument('cases', help='comma-separated names of CASES')
  parser.add_argument('out_dir')
  parser.add_argument('--coordinator')
  parser.add_argument('--num-processes', type=int, default=1)
  parser.add_argument('--process-id', type=int, default=0)
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  if args.coordinator:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(args.coordinator,
                               num_processes=args.num_processes,
                               process_id=args.process_id)
  if jax.device_count() != 8:
    raise SystemExit(f'needs 8 devices in all, got {jax.device_count()}')
  for case in args.cases.split(','):
    arrays, info = _saved(CASES[case]())
    if jax.process_index() == 0:
      os.makedirs(args.out_dir, exist_ok=True)
      np.savez(os.path.join(args.out_dir, f'{case}.npz'), **arrays)
      with open(os.path.join(args.out_dir, f'{case}.json'), 'w') as f:
        json.dump({'process_count': jax.process_count(), 'leaves': info}, f)
  return 0


if __name__ == '__main__':
  sys.exit(main())
