"""Runs the multi-device tests on a simulated 8-device CPU host.

The device count must be requested before JAX starts its backend, so a test
that needs a mesh is marked with :func:`needs_devices`: it is in the long
tier, a one-device run skips it, and ``tests/test_multidevice.py`` reruns the
marked tests of every file that the run's ``-m`` selects, in one fresh
process with ``--xla_force_host_platform_device_count=8`` (one start of JAX
and one compilation of each shared program for all of them, not one per
file).
"""

from collections.abc import Collection
import os
import pathlib
import re
import subprocess
import sys

_REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
# Every multi-device test runs on this many simulated devices.
NUM_DEVICES = 8
MARK = 'multidevice'


def rerun_with_devices(test_files: list[str], select: str = 'long',
                       expected: Collection[str] = (),
                       timeout: int = 1500) -> str:
  """Runs the tests marked :func:`needs_devices` in ``test_files``.

  Args:
    test_files: paths of the test files, relative to the repository root.
    select: a pytest ``-m`` expression; the tests it selects among the marked
      ones run (every marked test is ``long``: ``'long'`` selects them all).
    expected: the ids of the tests that must pass (those the calling run
      selected and skipped); empty: not known (the calling run did not
      collect their files).
    timeout: seconds.

  Returns:
    pytest's stdout (``-rA``: a line per test). Fails the calling test unless
    pytest exited with 0, ``select`` chose at least one test, every test it
    chose passed (none failed, errored, was skipped or xfailed: a test
    skipped for want of devices would mean the device count did not take
    effect) and, where ``expected`` is given, those are the tests it ran.
  """
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      f' --xla_force_host_platform_device_count={NUM_DEVICES}'
                      ).strip()
  env['JAX_PLATFORMS'] = 'cpu'
  result = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-rA', '-o', 'addopts=', '-p',
       'no:cacheprovider', '-m', f'{MARK} and ({select})', *test_files],
      env=env, capture_output=True, text=True, timeout=timeout, check=False,
      cwd=_REPO_ROOT)
  report = result.stdout[-6000:] + result.stderr[-3000:]
  assert result.returncode == 0, report
  counts = summary_counts(result.stdout)
  assert counts.get('passed'), report
  assert set(counts) <= {'passed', 'deselected', 'warning'}, report
  passed = {line.removeprefix('PASSED ') for line in
            result.stdout.splitlines() if line.startswith('PASSED ')}
  if expected:
    assert passed == set(expected), (sorted(set(expected) ^ passed), report)
  starved = [line for line in result.stdout.splitlines()
             if line.startswith('SKIPPED') and
             f'needs {NUM_DEVICES} devices' in line]
  assert not starved, report
  return result.stdout


def files_with_multidevice_tests() -> list[str]:
  """The test files that mark a test with :func:`needs_devices`."""
  root = pathlib.Path(_REPO_ROOT)
  return sorted(str(path.relative_to(root))
                for path in (root / 'tests').rglob('test_*.py')
                if 'multidevice.needs_devices(' in path.read_text())


def summary_counts(stdout: str) -> dict[str, int]:
  """The outcome counts of pytest's last summary line, e.g. ``{'passed': 3}``.

  Plural forms are folded (``errors`` -> ``error``, ``warnings`` ->
  ``warning``).
  """
  lines = [line for line in stdout.splitlines() if line.strip()]
  last = lines[-1] if lines else ''
  counts = {}
  for number, outcome in re.findall(
      r'(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|'
      r'warnings?)', last):
    counts[outcome.rstrip('s')] = int(number)
  return counts


def has_devices(num_devices: int = NUM_DEVICES) -> bool:
  """Whether this process already has ``num_devices`` devices."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.device_count() >= num_devices


def needs_devices(num_devices: int = NUM_DEVICES):
  """Marks a test ``long`` and for the 8-device rerun; skips it with fewer
  devices."""
  import pytest  # pylint: disable=g-import-not-at-top
  if num_devices != NUM_DEVICES:
    raise ValueError(f'the multi-device rerun has {NUM_DEVICES} devices, '
                     f'not {num_devices}')
  skip = pytest.mark.skipif(
      not has_devices(num_devices),
      reason=f'needs {num_devices} devices; runs in the subprocess rerun')
  return lambda test: pytest.mark.long(getattr(pytest.mark, MARK)(skip(test)))
