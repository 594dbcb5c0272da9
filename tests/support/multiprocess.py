"""Launches JAX's multi-process runtime on localhost for a test.

Each process gets ``--xla_force_host_platform_device_count`` CPU devices, and
the processes find each other through a coordinator on a free local port
(collectives over gloo). A test names the command once; :func:`launch` starts
one copy per process with ``{port}``, ``{process_id}`` and
``{num_processes}`` filled in, waits for all of them under one hard timeout,
and kills every one of them (their process groups) when the time is up or as
soon as one fails, so that a process blocked in a collective never outlives
the test. A failure shows each process's exit status and the end of its
output.
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional, Sequence

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


class Finished(NamedTuple):
  """One process's outcome."""
  returncode: int
  stdout: str
  stderr: str


def free_port() -> int:
  """A TCP port nothing listens on now (the coordinator binds it next)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.bind(('127.0.0.1', 0))
    return probe.getsockname()[1]


def cpu_env(devices: int, extra: Optional[dict[str, str]] = None
            ) -> dict[str, str]:
  """This process's environment with ``devices`` simulated CPU devices."""
  env = dict(os.environ)
  flags = [flag for flag in env.get('XLA_FLAGS', '').split()
           if 'xla_force_host_platform_device_count' not in flag]
  env['XLA_FLAGS'] = ' '.join(
      flags + [f'--xla_force_host_platform_device_count={devices}'])
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(
      [REPO_ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
  env.update(extra or {})
  return env


def _report(commands, finished: Sequence[Optional[Finished]],
            why: str) -> str:
  parts = [why]
  for process_id, (command, outcome) in enumerate(zip(commands, finished)):
    if outcome is None:
      parts.append(f'--- process {process_id}: no outcome')
      continue
    parts.append(f'--- process {process_id} exited {outcome.returncode}: '
                 f'{" ".join(command)}')
    parts.append('stdout (end):\n' + outcome.stdout[-3000:])
    parts.append('stderr (end):\n' + outcome.stderr[-5000:])
  return '\n'.join(parts)


def _holds(log, text: str) -> bool:
  """Whether ``log`` holds ``text`` so far (``pread``: the process writing
  it shares the file offset, which must not move)."""
  fd = log.fileno()
  return text.encode() in os.pread(fd, os.fstat(fd).st_size, 0)


def _kill(process: subprocess.Popen) -> None:
  if process.poll() is None:
    try:
      os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  process.wait()


def launch(command: Sequence[str], num_processes: int,
           devices_per_process: int, timeout: float, *,
           env: Optional[dict[str, str]] = None,
           expect_success: bool = True,
           signal_when: Optional[tuple[int, str, int]] = None
           ) -> list[Finished]:
  """Runs ``num_processes`` copies of ``command`` and waits for all of them.

  Args:
    command: the argument list; ``{port}``, ``{process_id}`` and
      ``{num_processes}`` in any argument are filled in per process.
    num_processes: how many processes.
    devices_per_process: simulated CPU devices in each.
    timeout: seconds for all of them together; then every process is killed
      and the calling test fails with their output.
    env: extra environment variables (placeholders filled in as in
      ``command``).
    expect_success: fail the calling test (with every process's output)
      unless all exit with 0; a failing process gets the others killed.
    signal_when: ``(process_id, text, signal)``: send ``signal`` to that
      process once its stderr holds ``text``.

  Returns:
    Each process's outcome, by process id.
  """
  port = free_port()
  fill = lambda word, i: (word.replace('{port}', str(port))
                          .replace('{process_id}', str(i))
                          .replace('{num_processes}', str(num_processes)))
  commands = [[fill(word, i) for word in command]
              for i in range(num_processes)]
  logs = [(tempfile.TemporaryFile('w+'), tempfile.TemporaryFile('w+'))
          for _ in commands]
  processes = [subprocess.Popen(
      words, cwd=REPO_ROOT, env=cpu_env(devices_per_process, {
          name: fill(value, i) for name, value in (env or {}).items()}),
      stdout=out, stderr=err, text=True, start_new_session=True)
               for i, (words, (out, err)) in enumerate(zip(commands, logs))]
  deadline = time.monotonic() + timeout
  why = ''
  try:
    while any(p.poll() is None for p in processes):
      failed = [i for i, p in enumerate(processes)
                if p.poll() not in (None, 0)]
      if failed and expect_success:
        why = f'process {failed[0]} failed; the others were killed'
        break
      if signal_when and _holds(logs[signal_when[0]][1], signal_when[1]):
        processes[signal_when[0]].send_signal(signal_when[2])
        signal_when = None
      if time.monotonic() > deadline:
        why = f'timed out after {timeout:.0f} s; every process was killed'
        break
      time.sleep(0.1)
  finally:
    for process in processes:
      _kill(process)
  finished = []
  for process, (out, err) in zip(processes, logs):
    out.seek(0)
    err.seek(0)
    finished.append(Finished(process.returncode, out.read(), err.read()))
    out.close()
    err.close()
  if why or (expect_success and any(f.returncode for f in finished)):
    raise AssertionError(_report(commands, finished, why or 'a process failed'))
  return finished


def python_module(module: str, *args: str) -> list[str]:
  """``python -m module args`` with this interpreter."""
  return [sys.executable, '-m', module, *args]
