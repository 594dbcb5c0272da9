"""Reruns a test file on a simulated multi-device CPU host.

The device count must be requested before JAX starts its backend, so a file
whose tests need a mesh skips them in the one-device suite and reruns itself
in a fresh process with ``--xla_force_host_platform_device_count``.
"""

import os
import re
import subprocess
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rerun_with_devices(test_file: str, num_devices: int, timeout: int = 900,
                       select: str = '') -> str:
  """Runs pytest on ``test_file`` with ``num_devices`` CPU devices.

  Args:
    test_file: path of the test file.
    num_devices: simulated CPU devices.
    timeout: seconds.
    select: a pytest ``-k`` expression (empty: every test).

  Returns:
    pytest's stdout. Fails the calling test unless pytest exited with 0, ran
    at least one test, none failed or errored, and no test was skipped for
    want of devices (which would mean the device count did not take effect).
  """
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      f' --xla_force_host_platform_device_count={num_devices}'
                      ).strip()
  env['JAX_PLATFORMS'] = 'cpu'
  result = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-rs', '-o', 'addopts=', '-p',
       'no:cacheprovider', test_file] + (['-k', select] if select else []),
      env=env, capture_output=True, text=True, timeout=timeout, check=False,
      cwd=_REPO_ROOT)
  report = result.stdout[-6000:] + result.stderr[-3000:]
  assert result.returncode == 0, report
  counts = summary_counts(result.stdout)
  assert counts.get('passed', 0) >= 1, report
  assert not counts.get('failed') and not counts.get('error'), report
  starved = [line for line in result.stdout.splitlines()
             if line.startswith('SKIPPED') and
             f'needs {num_devices} devices' in line]
  assert not starved, report
  return result.stdout


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


def has_devices(num_devices: int) -> bool:
  """Whether this process already has ``num_devices`` devices."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.device_count() >= num_devices


def needs_devices(num_devices: int):
  """Skips a test in a process with fewer devices (the rerun runs it)."""
  import pytest  # pylint: disable=g-import-not-at-top
  return pytest.mark.skipif(
      not has_devices(num_devices),
      reason=f'needs {num_devices} devices; runs in the subprocess rerun')


def subprocess_suite(test_file: str, num_devices: int, select: str = ''):
  """A test that reruns ``test_file`` on ``num_devices`` simulated devices.

  Assign it to a ``test_...`` name in the test file; it is skipped in the
  rerun itself, where the device-dependent tests run in-process.
  """
  import pytest  # pylint: disable=g-import-not-at-top

  @pytest.mark.skipif(has_devices(num_devices),
                      reason='the multi-device tests run in this process')
  def test_suite_in_subprocess():
    rerun_with_devices(test_file, num_devices, select=select)

  return test_suite_in_subprocess
