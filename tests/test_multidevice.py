"""Every test marked ``multidevice.needs_devices``, on 8 simulated devices.

One fresh process runs them all (see ``tests/support/multidevice.py``); in a
process that already has 8 devices they run in place and this test is skipped.
"""

import pytest

from tests.support import multidevice


def test_the_rerun_finds_the_mesh_test_files():
  files = multidevice.files_with_multidevice_tests()
  for name in ('tests/test_sharding.py', 'tests/test_auto_mesh.py',
               'tests/test_checkpoint.py', 'tests/examples/test_mesh.py',
               'tests/examples/test_memory_mesh.py'):
    assert name in files, files


@pytest.mark.long
@pytest.mark.skipif(multidevice.has_devices(),
                    reason='the multi-device tests run in this process')
def test_multidevice_tests_pass_on_8_devices():
  multidevice.rerun_with_devices(multidevice.files_with_multidevice_tests())
