"""Shared test settings."""

import os

import hypothesis

hypothesis.settings.register_profile(
    'ci', max_examples=30, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.register_profile(
    'dev', max_examples=15, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile('ci' if os.environ.get('CI') else 'dev')

# A script for GPU sessions (benchmarks/gpu_kernel.sh), not a test module:
# importing it runs the check.
collect_ignore = ['support/gpu_kernel_check.py']
