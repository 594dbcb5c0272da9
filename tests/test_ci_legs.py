"""``.ci/legs.sh``: CI's legs report their time, and a failure its own leg.

``.ci/run`` sources it; these run small bash scripts that source it the same
way (``set -euo pipefail``), on fake interpreters where it looks for Python.
"""

import os
import pathlib
import re
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEGS = ROOT / '.ci' / 'legs.sh'


def _bash(script: str, path: str | None = None) -> subprocess.CompletedProcess:
  env = {'HOME': os.environ.get('HOME', '/tmp'),
         'PATH': path if path is not None else os.environ['PATH']}
  return subprocess.run(
      ['/bin/bash', '-c', f'set -euo pipefail\n. {LEGS}\n{script}'],
      capture_output=True, text=True, env=env, timeout=60, check=False)


def test_each_leg_is_timed_and_a_failure_names_its_leg_and_code():
  result = _bash('leg first\ntrue\nleg second\n(exit 7)\nleg third\ntrue\n')
  assert result.returncode == 7
  assert re.search(r'^===== leg: first passed in \d+ s$', result.stdout,
                   re.M), result.stdout
  assert '===== leg: second\n' in result.stdout
  assert 'second passed' not in result.stdout
  assert 'third' not in result.stdout + result.stderr
  assert re.search(r"^!!!!! CI FAILED in leg 'second' with exit code 7 "
                   r'after \d+ s !!!!!$', result.stderr, re.M), result.stderr


def test_a_passing_run_says_nothing_of_failure():
  result = _bash('leg only\ntrue\nleg_end\n')
  assert result.returncode == 0
  assert 'only passed in' in result.stdout
  assert 'FAILED' not in result.stderr


def test_background_work_is_waited_for_and_stopped_by_a_failure(tmp_path):
  log = tmp_path / 'background.log'
  waited = _bash(f"in_background {log} bash -c 'echo working; exit 5'\n"
                 'code=0\nwait "$ci_last_background" || code=$?\n'
                 'echo "code $code"\n')
  assert waited.stdout.strip() == 'code 5', waited
  assert log.read_text() == 'working\n'
  # A leg that fails stops the background's whole process group: the
  # command and what it started (the sleep, in a group of its own only by
  # inheritance).
  sleeper = tmp_path / 'sleeper.pid'
  failed = _bash(f"in_background {log} bash -c 'sleep 60 & "
                 f"echo $! > {sleeper}; wait'\n"
                 'echo "$ci_last_background"\n'
                 f'until [ -s {sleeper} ]; do sleep 0.05; done\n'
                 'leg lint\n(exit 3)\n')
  assert failed.returncode == 3, failed
  pids = [int(failed.stdout.split()[0]), int(sleeper.read_text())]
  for _ in range(50):
    running = [pid for pid in pids if _is_running(pid)]
    if not running:
      break
    time.sleep(0.1)
  assert not running, f'{running} outlived the failed run'


def _state(pid: int) -> str | None:
  """``pid``'s state letter from /proc (``Z``: a zombie); None: gone."""
  try:
    stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
  except FileNotFoundError:
    return None
  # The state follows the command's name, which is in parentheses.
  return stat.rsplit(')', 1)[1].split()[0]


def _is_running(pid: int) -> bool:
  """Whether ``pid`` runs: a zombie does not (an init that does not reap,
  as in some CI containers, keeps the killed as zombies)."""
  return _state(pid) not in (None, 'Z', 'X')


def test_a_zombie_is_not_running_and_a_sleeper_is():
  sleeper = subprocess.Popen(['sleep', '60'])
  exited = subprocess.Popen(['true'])
  try:
    assert _is_running(sleeper.pid)
    for _ in range(50):  # until it has exited, unreaped: a zombie
      if _state(exited.pid) == 'Z':
        break
      time.sleep(0.1)
    assert not _is_running(exited.pid)
  finally:
    sleeper.kill()
    sleeper.wait()
    exited.wait()
  assert not _is_running(exited.pid)  # reaped: gone


def _fake_python(folder: pathlib.Path, name: str, is_312_or_newer: bool):
  """A ``name`` in ``folder`` answering the version check as told."""
  folder.mkdir(exist_ok=True)
  fake = folder / name
  fake.write_text(f'#!/bin/sh\nexit {0 if is_312_or_newer else 1}\n')
  fake.chmod(0o755)
  return fake


@pytest.mark.parametrize('fakes, expected', [
    ({'python3.13': True}, 'python3.13'),
    ({'python3.13': False, 'python3.12': True}, 'python3.12'),
    # A pyenv shim whose version is not installed fails the check.
    ({'python3.13': False}, None),
    ({}, None),
])
def test_newest_python_is_a_working_312_or_newer(tmp_path, fakes, expected):
  for name, works in fakes.items():
    _fake_python(tmp_path / 'bin', name, works)
  # Only the fakes and the shell's tools (no pyenv, no other Python).
  tools = tmp_path / 'tools'
  tools.mkdir()
  for tool in ('ls', 'sort', 'date'):
    (tools / tool).symlink_to(subprocess.run(
        ['/bin/bash', '-c', f'command -v {tool}'], capture_output=True,
        text=True, check=True).stdout.strip())
  result = _bash('if found=$(newest_python); then echo "found $found"; '
                 'else echo none; fi',
                 path=f'{tmp_path / "bin"}:{tools}')
  assert result.returncode == 0, result.stderr
  if expected is None:
    assert result.stdout.strip() == 'none'
  else:
    assert result.stdout.strip() == f'found {tmp_path / "bin" / expected}'


def test_ci_run_sources_the_legs_and_names_the_missing_newest_stack():
  run = (ROOT / '.ci' / 'run').read_text()
  assert '. .ci/legs.sh' in run
  # Without a 3.12+ interpreter the floor stack's legs still pass, and the
  # run says loudly what did not run.
  assert 'NO PYTHON 3.12+ INTERPRETER ON THIS MACHINE' in run
  # ruff and mypy come before any tests.
  legs = re.findall(r'^leg "?([^"\n]+)', run, re.M)
  assert legs[:3] == ['install', 'lint', 'fast (Python 3.11)'], legs
  # The release watch is never selected.
  assert 'upstream' not in re.sub(r'#.*|-m .not upstream.', '', run)
