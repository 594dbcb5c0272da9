"""TACO on JAX's multi-process runtime: 2 processes x 4 CPU devices.

The cases of ``tests/support/multiprocess_cases.py`` run in two launches of
fresh processes, each running every case in turn: once on 1 process with 8
devices, once on 2 processes with 4 devices each
(``jax.distributed`` on localhost, gloo collectives), the same 8-device meshes
in both (the fsdp axis across processes, or every tensor group across
processes). Every parameter, update and state array, gathered whole, must be
the same bytes, with the same sharding; in the 2-process run every one of
them spans both processes.
"""

from concurrent import futures
import json
import os

import numpy as np
import pytest

from tests.support import multiprocess

pytestmark = pytest.mark.long

_CASES = ('optax', 'auto', 'layerwise')
# Seconds for one launch (all its processes, every case in turn); the cases
# take 10-90 s each here.
_TIMEOUT = 900


def _launch(out_dir: str, num_processes: int) -> None:
  command = multiprocess.python_module('tests.support.multiprocess_cases',
                                       ','.join(_CASES), out_dir)
  if num_processes > 1:
    command += ['--coordinator', '127.0.0.1:{port}', '--num-processes',
                '{num_processes}', '--process-id', '{process_id}']
  multiprocess.launch(command, num_processes, 8 // num_processes, _TIMEOUT)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Every case on 1 process x 8 devices and on 2 x 4: one launch each.

  Both launches at once (3 processes, each mostly compiling); the processes
  run every case in turn, so each pays JAX's start and the runtime's set-up
  once.
  """
  out = {name: str(tmp_path_factory.mktemp(name)) for name in ('one', 'two')}
  with futures.ThreadPoolExecutor(2) as pool:
    for launched in [pool.submit(_launch, out['one'], 1),
                     pool.submit(_launch, out['two'], 2)]:
      launched.result()
  return out


def _results(out_dir: str, case: str, num_processes: int
             ) -> tuple[dict, dict]:
  with open(os.path.join(out_dir, f'{case}.json')) as f:
    info = json.load(f)
  assert info['process_count'] == num_processes
  with np.load(os.path.join(out_dir, f'{case}.npz')) as arrays:
    return dict(arrays), info['leaves']


def _summed_across_devices(case: str, name: str) -> bool:
  """Leaves that are float sums over the batch's devices, in another order.

  In the layer-wise step the AdamW biases' gradients (and the loss) are sums
  over the batch split across devices: gloo's all-reduce across processes
  adds the partial sums in another order than XLA's in-process one, so they
  and the Adam moments built from them may differ in the last bits
  (measured: at most 4e-7 of the leaf's largest value). TACO's weights and
  state never depend on such a sum's order.
  """
  return case == 'layerwise' and ("['b_up']" in name or name.endswith('[2]'))


def _as_stored(raw: np.ndarray, info: dict) -> np.ndarray:
  return raw.view(np.dtype(info['dtype'])).reshape(info['shape'])


@pytest.mark.parametrize('case', _CASES)
def test_two_processes_equal_one_process_bitwise(runs, case):
  one_arrays, one_info = _results(runs['one'], case, 1)
  two_arrays, two_info = _results(runs['two'], case, 2)
  assert two_info.keys() == one_info.keys()
  assert len(two_info) > 20, sorted(two_info)
  for name, one in one_info.items():
    two = two_info[name]
    assert (two['dtype'], two['shape'], two['spec']) == (
        one['dtype'], one['shape'], one['spec']), name
    assert two['spans_processes'] and not one['spans_processes'], name
  exact = [name for name in one_arrays
           if not _summed_across_devices(case, name)]
  differing = [name for name in exact
               if not np.array_equal(two_arrays[name], one_arrays[name])]
  assert not differing, differing
  summed = [name for name in one_arrays if name not in exact]
  # 1 run of each layer layout: the unrolled biases, their mu and nu (2
  # each) and the loss, the stacked ones (1 each) and the loss.
  assert len(summed) == (0 if case != 'layerwise' else 7 + 4)
  for name in summed:
    want = _as_stored(one_arrays[name], one_info[name])
    have = _as_stored(two_arrays[name], two_info[name])
    np.testing.assert_allclose(have, want, rtol=0,
                               atol=1e-6 * np.max(np.abs(want)), err_msg=name)
