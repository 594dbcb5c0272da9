"""The long tier is marked at the test, and every split matrix stays fast once.

A parametrised test splits its cases with :func:`tiers.first_fast`: its first
case (or the ones it names) in the fast tier, the others marked ``long``.
"""

import pathlib

import pytest

from tests.support import tiers

TESTS = pathlib.Path(__file__).resolve().parent


def _long(case) -> bool:
  return any(mark.name == 'long' for mark in getattr(case, 'marks', ()))


def test_first_case_stays_fast_and_the_others_are_long():
  cases = tiers.first_fast([True, False, None])
  assert cases[0] is True
  assert [_long(case) for case in cases] == [False, True, True]
  assert [case.values for case in cases[1:]] == [(False,), (None,)]


def test_named_cases_stay_fast():
  cases = tiers.first_fast(['adamw', 'lion', 'taco'], fast=['adamw', 'taco'])
  assert [_long(case) for case in cases] == [False, True, False]


def test_a_case_of_several_arguments_is_one_param():
  cases = tiers.first_fast([('llama', False), ('qwen3', True)])
  assert cases[0] == ('llama', False)
  assert cases[1].values == ('qwen3', True) and _long(cases[1])


def test_jax_versions_cases_are_long_and_marked():
  cases = tiers.first_fast(['llama', 'qwen3', 'opt'], jax_versions=['opt'])
  assert cases[0] == 'llama'
  marks = [sorted(mark.name for mark in case.marks) for case in cases[1:]]
  assert marks == [['long'], ['jax_versions', 'long']]


@pytest.mark.parametrize('fast, jax_versions', [(None, ['llama']),
                                                (None, ['mistral'])])
def test_jax_versions_names_long_cases_only(fast, jax_versions):
  with pytest.raises(ValueError, match='fast case|not among'):
    tiers.first_fast(['llama', 'qwen3'], fast=fast, jax_versions=jax_versions)


@pytest.mark.parametrize('fast', [['mistral'], []])
def test_a_fast_case_that_is_not_a_case_is_an_error(fast):
  # A renamed case would otherwise silently leave the fast tier.
  with pytest.raises(ValueError, match='fast cases'):
    tiers.first_fast(['llama', 'qwen3'], fast=fast)


def test_cases_are_marked_long_only_through_first_fast():
  # A hand-written pytest.param(..., marks=pytest.mark.long) could mark every
  # case of a matrix long; first_fast always keeps one in the fast tier.
  # Whole tests are marked with @pytest.mark.long or pytestmark instead.
  found = sorted(
      str(path.relative_to(TESTS)) for path in TESTS.rglob('*.py')
      if path.name not in ('tiers.py', 'test_tiers.py') and
      'marks=pytest.mark.long' in path.read_text().replace(' ', ''))
  assert not found, found
  splits = sum(path.read_text().count('tiers.first_fast(')
               for path in TESTS.rglob('test_*.py')
               if path.name != 'test_tiers.py')
  assert splits > 0


def test_files_scheduled_first_exist_and_have_long_tests(pytestconfig):
  # conftest.py starts these first; a renamed file would silently lose its
  # place and start last, behind every other file.
  root_conftest = str(TESTS.parent / 'conftest.py')
  (conftest,) = [plugin for plugin in pytestconfig.pluginmanager.get_plugins()
                 if getattr(plugin, '__file__', None) == root_conftest]
  assert conftest.SCHEDULED_FIRST
  for name in conftest.SCHEDULED_FIRST:
    text = (TESTS.parent / name).read_text()
    assert 'pytest.mark.long' in text or 'needs_devices' in text, name
