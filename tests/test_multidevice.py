"""Every test marked ``multidevice.needs_devices``, on 8 simulated devices.

One fresh process runs them (see ``tests/support/multidevice.py``); in a
process that already has 8 devices they run in place and this test is skipped.
They are long tests, selected by this run's ``-m`` as any other: ``python -m
pytest -m long`` reruns them all; CI's floor-stack leg (``-m 'long and
jax_versions'``) the ones marked ``jax_versions``.
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
@pytest.mark.jax_versions
@pytest.mark.skipif(multidevice.has_devices(),
                    reason='the multi-device tests run in this process')
def test_multidevice_tests_pass_on_8_devices(request):
  # This run selected (and skipped, for want of devices) the same tests: the
  # rerun must pass exactly those.
  skipped_here = [item.nodeid for item in request.session.items
                  if item.get_closest_marker(multidevice.MARK)]
  multidevice.rerun_with_devices(multidevice.files_with_multidevice_tests(),
                                 select=request.config.getoption('markexpr'),
                                 expected=skipped_here)
