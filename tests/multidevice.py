"""Reruns a test file on a simulated multi-device CPU host.

The device count must be requested before JAX starts its backend, so a file
whose tests need a mesh skips them in the one-device suite and reruns itself
in a fresh process with ``--xla_force_host_platform_device_count``.
"""

import os
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
    pytest's stdout; fails the calling test unless every test passed or was
    skipped.
  """
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      f' --xla_force_host_platform_device_count={num_devices}'
                      ).strip()
  env['JAX_PLATFORMS'] = 'cpu'
  result = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-o', 'addopts=', '-p',
       'no:cacheprovider', test_file] + (['-k', select] if select else []),
      env=env, capture_output=True, text=True, timeout=timeout, check=False,
      cwd=_REPO_ROOT)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  return result.stdout
