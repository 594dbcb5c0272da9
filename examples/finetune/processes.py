"""More than one process: JAX's multi-controller runtime for the example.

One process runs per host (or, on one machine, per group of devices); all of
them run the same program on one mesh over every process's devices. The
processes find each other through ``jax.distributed.initialize``: with
``--coordinator-address HOST:PORT --num-processes N --process-id I`` given on
each, or, without them, from a cluster JAX detects by itself (a SLURM job
step or Open MPI launch of several tasks, a multi-host TPU slice). Process 0
alone prints and writes ``results.json``; every process writes its own shards
of a checkpoint.

A careless launch is refused with one line before anything waits on another
process: a process id outside ``[0, N)``, a partial set of the three flags,
several processes without ``--mesh``; and a process other than 0 waits at
most ``--initialization-timeout`` seconds for the coordinator to accept a
connection (JAX itself would abort the process with a stack trace).
"""

import os
import socket
import time
from typing import Optional

import jax
import numpy as np

from examples.finetune import flags as flags_lib

# (size variable, a variable only the launched tasks have): a launcher that
# started several processes of one job, as jax.distributed.initialize() finds
# them (SLURM_PROCID is set inside `srun` only, not in a bare `salloc`).
_CLUSTER_SIZES = (('SLURM_NTASKS', 'SLURM_PROCID'),
                  ('OMPI_COMM_WORLD_SIZE', 'OMPI_MCA_orte_hnp_uri'))
_TPU_HOSTS = ('TPU_PROCESS_ADDRESSES', 'TPU_WORKER_HOSTNAMES')  # GKE's


def _detected_cluster() -> Optional[str]:
  """The launcher whose several processes this is one of, if any."""
  for size, task in _CLUSTER_SIZES:
    value = os.environ.get(size, '1').strip()
    if value.isdigit() and int(value) > 1 and task in os.environ:
      return f'{size}={value}'
  for name in _TPU_HOSTS:
    if ',' in os.environ.get(name, ''):
      return f'{name} (a multi-host TPU slice)'
  return None


def _split_address(address: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(':')
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise flags_lib.FinetuneError(
        f'--coordinator-address {address!r}: expected HOST:PORT, e.g. '
        '10.0.0.1:1234')
  return host.strip('[]'), int(port)


def _wait_for_coordinator(address: str, timeout: float) -> None:
  """Returns once ``address`` accepts a TCP connection, else refuses."""
  host, port = _split_address(address)
  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host, port), timeout=1.0):
        return
    except OSError:
      if time.monotonic() >= deadline:
        raise flags_lib.FinetuneError(
            f'--coordinator-address {address}: no coordinator answered within '
            f'--initialization-timeout {timeout:g} s (start process 0 there, '
            'or check the address)') from None
      time.sleep(0.2)


def check_flags(config: flags_lib.RunConfig) -> None:
  """Refuses an inconsistent set of the launch flags (nothing started yet).
  """
  given = {name: getattr(config, name) for name in
           ('coordinator_address', 'num_processes', 'process_id')}
  if None not in (config.num_processes, config.process_id) and (
      config.process_id >= config.num_processes):
    raise flags_lib.FinetuneError(
        f'--process-id {config.process_id} must be below --num-processes '
        f'{config.num_processes} (ids are 0 to {config.num_processes - 1})')
  if any(value is not None for value in given.values()):
    missing = [flags_lib.flag(name) for name, value in given.items()
               if value is None]
    if missing:
      raise flags_lib.FinetuneError(
          '--coordinator-address, --num-processes and --process-id go '
          f'together: {", ".join(missing)} missing')
    _split_address(config.coordinator_address)
  several = (config.num_processes or 1) > 1 or _detected_cluster()
  if several and not config.mesh:
    raise flags_lib.FinetuneError(
        'several processes need --mesh over all their devices (e.g. '
        '--mesh data=2 for 2 processes of 1 device): without one each would '
        'train its own copy')


def initialize(config: flags_lib.RunConfig) -> None:
  """Joins the processes of this run, if it has several (else nothing).

  Must run before JAX starts its backend (the first array or device query).

  Raises:
    flags.FinetuneError: :func:`check_flags`'s refusals, or no coordinator
      answering within ``--initialization-timeout`` seconds.
  """
  check_flags(config)
  if jax.distributed.is_initialized():
    return
  timeout = config.initialization_timeout
  if config.coordinator_address is not None:
    if config.num_processes == 1:
      return
    if config.process_id > 0:
      _wait_for_coordinator(config.coordinator_address, timeout)
    _cpu_collectives_over_gloo()
    jax.distributed.initialize(config.coordinator_address,
                               num_processes=config.num_processes,
                               process_id=config.process_id,
                               initialization_timeout=int(timeout))
  elif _detected_cluster():
    _cpu_collectives_over_gloo()
    try:
      jax.distributed.initialize(initialization_timeout=int(timeout))
    except ValueError as e:  # the launcher's variables are incomplete
      raise flags_lib.FinetuneError(
          f'{_detected_cluster()} says several processes, but JAX found no '
          f'coordinator ({e}); pass --coordinator-address, --num-processes '
          'and --process-id') from e


def _cpu_collectives_over_gloo() -> None:
  """CPU devices of different processes talk over gloo (GPUs and TPUs have
  their own collectives; the setting does not touch them)."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')


def is_leader() -> bool:
  """Whether this is process 0, the one that prints and writes results."""
  return jax.process_index() == 0


def same_on_every_process(text: str) -> str:
  """Process 0's ``text`` on every process (one process: ``text``)."""
  if jax.process_count() == 1:
    return text
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  encoded = text.encode()
  size = int(np.max(multihost_utils.process_allgather(
      np.array(len(encoded), np.int32))))
  buffer = np.zeros(size, np.uint8)
  buffer[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  shared = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
  return bytes(shared).rstrip(b'\0').decode()


def per_process(value: int) -> list[int]:
  """``value`` (an integer >= 0 below 2**60) of every process, by index."""
  if jax.process_count() == 1:
    return [int(value)]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  # JAX's default integers are 32-bit: two 30-bit halves.
  halves = np.array(divmod(int(value), 1 << 30), np.int32)
  gathered = np.asarray(multihost_utils.process_allgather(halves))
  return [int(high) << 30 | int(low)
          for high, low in gathered.reshape(-1, 2)]


def barrier(name: str) -> None:
  """Waits until every process reaches ``barrier(name)`` (one: returns)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)
