"""``python -m examples.finetune`` on 2 processes x 4 CPU devices.

The 4-step run of the tiny model on one 8-device mesh spanning two local
processes (``--coordinator-address``, gloo collectives) against the same run
in one process with 8 devices; and the launches that must be refused with
one line (exit 2) instead of hanging.
"""

from concurrent import futures
import json
import os
import shutil
import signal
import time

import jax
import numpy as np
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import checkpoint
from examples.finetune import flags
from examples.finetune import processes
from examples.finetune import resume
from tests.support import multiprocess
from tests.support import tiny_llama

pytestmark = pytest.mark.long

MESH = 'data=2,fsdp=2,tensor=2'
_TIMEOUT = 420
_LAUNCH = ['--coordinator-address', '127.0.0.1:{port}', '--num-processes',
           '{num_processes}', '--process-id', '{process_id}']


def _args(workspace, output_dir, *extra):
  # --batch-size 4: the batch is split over data x fsdp, so each process
  # feeds its own 2 rows.
  return tiny_llama.text_args(
      workspace, output_dir, '--steps', '4', '--batch-size', '4',
      '--checkpoint-every', '2', *extra)


def _launch(workspace, name, num_processes, *extra, expect_success=True):
  output_dir = str(workspace['root'] / name)
  command = multiprocess.python_module(
      'examples.finetune', *_args(workspace, output_dir, '--mesh', MESH,
                                  *extra))
  if num_processes > 1:
    command += _LAUNCH
  finished = multiprocess.launch(command, num_processes, 8 // num_processes,
                                 _TIMEOUT, expect_success=expect_success)
  return output_dir, finished


def _final_state(output_dir):
  saved = checkpoint.latest(resume.checkpoint_dir(output_dir))
  assert saved is not None and saved.step == 4, output_dir
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
          jax.tree_util.tree_flatten_with_path(checkpoint.restore(saved))[0]}


def _results(output_dir):
  with open(os.path.join(output_dir, 'results.json')) as f:
    return json.load(f)


@pytest.fixture(scope='module')
def runs(workspace):
  """The 4-step run on 1 process x 8 devices and on 2 processes x 4, with
  checkpoints after steps 2 and 4: ``{name: (output_dir, finished)}``."""
  with futures.ThreadPoolExecutor(2) as pool:  # both at once
    one = pool.submit(_launch, workspace, 'one-process', 1)
    two = pool.submit(_launch, workspace, 'two-processes', 2)
    return {'one': one.result(), 'two': two.result()}


# jax 0.12 keys the compilation cache per process (CHANGELOG.md): the cold
# runs and the warm resume on 2 processes run on both of CI's stacks.
@pytest.mark.jax_versions
def test_two_processes_match_one_process(runs):
  (one_dir, _), (two_dir, (leader, other)) = runs['one'], runs['two']
  expected, got = _results(one_dir), _results(two_dir)
  assert (expected['process_count'], got['process_count']) == (1, 2)
  # The loss is a float sum over the batch's devices: gloo's all-reduce
  # across processes adds in another order (measured: 1 of 4 losses off by
  # 9e-8 relative).
  np.testing.assert_allclose(got['losses'], expected['losses'], rtol=1e-6)
  assert got['evals'] == expected['evals']
  assert got['before'] == expected['before']
  assert got['after'] == expected['after']
  assert len(got['process_peak_rss_bytes_per_process']) == 2
  # jax 0.12 keys the compilation cache per process: the two-process runs
  # compile (else the resumes below, warm, hang at their first step).
  per_process_keys = jax.__version_info__ >= (0, 12)
  assert (got['compilation_cache']['directory'] is None) == per_process_keys
  assert expected['compilation_cache']['directory'] is not None
  assert ('compilation cache off' in leader.stdout) == per_process_keys
  assert all(rss > 0 for rss in got['process_peak_rss_bytes_per_process'])
  # Process 0 alone prints: progress, the summary (every process's peak
  # RSS in it) and where the results are.
  assert 'held-out accuracy before' in leader.stdout
  assert '(process 1)' in leader.stdout and 'results:' in leader.stdout
  assert 'held-out' not in other.stdout + other.stderr
  assert 'results:' not in other.stdout
  # The final checkpoint, written by both processes: TACO's state and every
  # weight byte for byte; the AdamW moments of the norm scales (gradients
  # summed over the batch's devices) to the last bits.
  _assert_same_state(_final_state(two_dir), _final_state(one_dir))
  # The model is exported once, by process 0 after every process took part
  # in gathering the split arrays: the one-process run's bytes, and no
  # half-written folder beside it.
  for name in ('model.safetensors', 'config.json', 'tokenizer.json'):
    with open(os.path.join(two_dir, 'model', name), 'rb') as have, open(
        os.path.join(one_dir, 'model', name), 'rb') as want:
      assert have.read() == want.read(), name
  assert sorted(os.listdir(two_dir)) == ['checkpoints', 'model',
                                         'results.json']


def test_the_mesh_run_matches_one_device(workspace, runs):
  """The default run on the mesh, one process: the same run on one device
  (in this process) up to the sharded sums' order."""
  one_device = str(workspace['root'] / 'one-device')
  assert cli.main(_args(workspace, one_device)) == 0
  (mesh_dir, _) = runs['one']
  expected, got = _results(one_device), _results(mesh_dir)
  assert len(got['losses']) == 4
  np.testing.assert_allclose(got['losses'], expected['losses'], rtol=1e-5)
  assert got['optimizer_state_bytes'] == expected['optimizer_state_bytes']
  tiny_llama.assert_state_equal_up_to_sum_order(_final_state(mesh_dir),
                                                _final_state(one_device))


def _assert_same_state(have, want, summed_exactly=False):
  """Every array byte for byte, but the AdamW moments (of the norm scales,
  whose gradients are float sums over the batch's devices) unless
  ``summed_exactly``: those to the last bits."""
  assert have.keys() == want.keys()
  summed = [name for name in want if "['adam']" in name and (
      "['mu']" in name or "['nu']" in name)]
  assert summed
  for name in want:
    assert (have[name].dtype, have[name].shape) == (want[name].dtype,
                                                    want[name].shape), name
    if name in summed and not summed_exactly:
      np.testing.assert_allclose(have[name], want[name], rtol=1e-5,
                                 atol=1e-9, err_msg=name)
    else:
      assert have[name].tobytes() == want[name].tobytes(), name


def _crashed_after_step_2(workspace, run_dir, name):
  """A copy of ``run_dir`` as a run that died after step 2's checkpoint."""
  copy = str(workspace['root'] / name)
  shutil.copytree(run_dir, copy)
  os.remove(os.path.join(copy, 'results.json'))
  shutil.rmtree(os.path.join(resume.checkpoint_dir(copy), 'step_00000004'))
  return copy


@pytest.mark.parametrize('source, num_processes', [
    pytest.param('two', 2, marks=pytest.mark.jax_versions), ('two', 1),
    ('one', 2)])
def test_resume_across_processes(workspace, runs, source, num_processes):
  """Each process reads its own shards back: a 2-process checkpoint resumed
  on 2 processes is the uninterrupted run bit for bit; on another topology
  (1 process x 8 devices, and back), the same mesh, it is that run up to the
  gradient sums' order."""
  run_dir = runs[source][0]
  resumed = _crashed_after_step_2(
      workspace, run_dir, f'{source}-resumed-on-{num_processes}')
  command = multiprocess.python_module('examples.finetune', *_args(
      workspace, resumed, '--mesh', MESH, '--resume'))
  if num_processes > 1:
    command += _LAUNCH
  multiprocess.launch(command, num_processes, 8 // num_processes, _TIMEOUT)
  expected, got = _results(run_dir), _results(resumed)
  assert got['resumed_from_step'] == 2
  assert got['process_count'] == num_processes
  same_topology = num_processes == (2 if source == 'two' else 1)
  if same_topology:
    assert got['losses'] == expected['losses']
  np.testing.assert_allclose(got['losses'], expected['losses'], rtol=1e-6)
  assert got['evals'] == expected['evals']
  _assert_same_state(_final_state(resumed), _final_state(run_dir),
                     summed_exactly=same_topology)


def _one_error_line(finished: multiprocess.Finished) -> str:
  errors = [line for line in finished.stderr.splitlines()
            if line.startswith('error:')]
  assert finished.returncode == 2, finished
  assert len(errors) == 1, finished.stderr[-3000:]
  return errors[0]


def test_mesh_not_matching_the_processes_devices(workspace):
  _, finished = _launch(workspace, 'bad-mesh', 2, '--mesh', 'data=2',
                        expect_success=False)
  for process in finished:
    line = _one_error_line(process)
    assert "--mesh 'data=2' has 2 devices but JAX sees 8 (2 processes x 4)" in (
        line), line


@pytest.mark.parametrize('extra, message', [
    (['--process-id', '2', '--num-processes', '2'],
     '--process-id 2 must be below --num-processes 2'),
    (['--num-processes', '2'], '--coordinator-address, --process-id missing'),
    (['--coordinator-address', 'localhost', '--num-processes', '2',
      '--process-id', '1'], "expected HOST:PORT"),
    (['--coordinator-address', '127.0.0.1:1', '--num-processes', '2',
      '--process-id', '0'], 'several processes need --mesh'),
])
def test_careless_launch_is_one_line(workspace, capsys, extra, message):
  extra = [word.replace('127.0.0.1:1', f'127.0.0.1:{multiprocess.free_port()}')
           for word in extra]
  args = _args(workspace, str(workspace['root'] / 'careless'), *extra)
  assert cli.main(args) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and message in err, err
  assert len(err.splitlines()) == 1, err


def test_a_coordinator_that_never_answers(workspace, capsys):
  port = multiprocess.free_port()
  args = _args(workspace, str(workspace['root'] / 'alone'), '--mesh', MESH,
               '--coordinator-address', f'127.0.0.1:{port}',
               '--num-processes', '2', '--process-id', '1',
               '--initialization-timeout', '2')
  began = time.monotonic()
  assert cli.main(args) == 2
  assert time.monotonic() - began < 30
  err = capsys.readouterr().err.strip()
  assert err == (f'error: --coordinator-address 127.0.0.1:{port}: no '
                 'coordinator answered within --initialization-timeout 2 s '
                 '(start process 0 there, or check the address)'), err
  assert not os.path.exists(workspace['root'] / 'alone')


def test_a_signal_to_one_process_stops_both_after_the_same_step(workspace):
  """SIGTERM reaches process 1 alone (paused after step 1): both processes
  save step 1's checkpoint together and exit 143."""
  output_dir = str(workspace['root'] / 'signalled')
  command = multiprocess.python_module('examples.finetune', *_args(
      workspace, output_dir, '--mesh', MESH)) + _LAUNCH
  # Process i pauses after step i: only process 1 does (steps start at 1).
  finished = multiprocess.launch(
      command, 2, 4, _TIMEOUT, expect_success=False,
      env={resume.PAUSE_AFTER_STEP_ENV: '{process_id}'},
      signal_when=(1, 'paused after step 1', signal.SIGTERM))
  assert [f.returncode for f in finished] == [143, 143], finished
  assert 'interrupted at step 1/4' in finished[0].stdout
  saved = checkpoint.latest(resume.checkpoint_dir(output_dir))
  assert saved is not None and saved.step == 1
  assert checkpoint.complete_steps(resume.checkpoint_dir(output_dir)) == [1]


def test_a_checkpoint_missing_a_process_shards_is_refused(workspace, runs):
  """Each process wrote its own shards (``ocdbt.process_N``) under one
  commit; without process 1's the checkpoint is refused by name."""
  copy = str(workspace['root'] / 'missing-shards')
  shutil.copytree(runs['two'][0], copy)
  step = os.path.join(resume.checkpoint_dir(copy), 'step_00000004')
  state = os.path.join(step, 'state')
  assert {'ocdbt.process_0', 'ocdbt.process_1'} <= set(os.listdir(state))
  shutil.rmtree(os.path.join(state, 'ocdbt.process_1'))
  before = sorted(os.listdir(step))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r'is corrupt: missing files \[.state/ocdbt'
                           r'\.process_1/'):
    checkpoint.latest(resume.checkpoint_dir(copy))
  assert sorted(os.listdir(step)) == before  # nothing written


@pytest.mark.parametrize('environment, several', [
    ({'SLURM_NTASKS': '2', 'SLURM_PROCID': '0'}, True),
    ({'SLURM_NTASKS': '2'}, False),  # a bare salloc: no task of srun
    ({'SLURM_NTASKS': '1', 'SLURM_PROCID': '0'}, False),
    ({'OMPI_COMM_WORLD_SIZE': '4', 'OMPI_MCA_orte_hnp_uri': 'x'}, True),
    ({'TPU_WORKER_HOSTNAMES': 'host-0,host-1'}, True),
    ({'TPU_WORKER_HOSTNAMES': 'host-0'}, False),
])
def test_a_launcher_of_several_processes_needs_a_mesh(
    workspace, monkeypatch, environment, several):
  """Where JAX's cluster detection applies, a run without --mesh is refused
  before anything starts (each process would train its own copy)."""
  for name in ('SLURM_NTASKS', 'SLURM_PROCID', 'OMPI_COMM_WORLD_SIZE',
               'OMPI_MCA_orte_hnp_uri', 'TPU_PROCESS_ADDRESSES',
               'TPU_WORKER_HOSTNAMES'):
    monkeypatch.delenv(name, raising=False)
  for name, value in environment.items():
    monkeypatch.setenv(name, value)
  config = flags.from_command_line(_args(workspace, str(workspace['root'])))
  if several:
    with pytest.raises(flags.FinetuneError,
                       match='several processes need --mesh'):
      processes.check_flags(config)
  else:
    processes.check_flags(config)
