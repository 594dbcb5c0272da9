"""Helpers shared by the tests: cases, checks, launchers and the tiers.

Not test modules (pytest collects none of them); a test imports what it uses,
e.g. ``from tests.support import bitwise``.
"""
