"""Shared test helpers."""

import os

import hypothesis
import pytest

from tests import tiers

hypothesis.settings.register_profile(
    'ci', max_examples=30, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.register_profile(
    'dev', max_examples=15, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile('ci' if os.environ.get('CI') else 'dev')

# A script for GPU sessions (benchmarks/gpu_kernel.sh), not a test module:
# importing it runs the check.
collect_ignore = ['gpu_kernel_check.py']


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """The long tier's cases of the fast tier's matrices (``tests/tiers.py``),
  marked before ``-m`` selects."""
  del config
  for item in tiers.long_cases(items):
    item.add_marker(pytest.mark.long)
