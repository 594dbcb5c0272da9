"""The fast tier keeps one case of every matrix that tests/tiers.py splits."""

import pathlib

from tests import tiers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_split_names_a_test_that_exists():
  # A renamed test would silently fall out of the split (all its cases fast).
  for key, kept in tiers.FAST_CASES.items():
    path, name = key.split('::')
    assert f'def {name}(' in (ROOT / path).read_text(), key
    assert kept is None or kept, key


class _Item:

  def __init__(self, nodeid, case):
    self.nodeid = nodeid
    self.originalname = nodeid.split('::')[1].split('[')[0]
    self.callspec = type('CallSpec', (), {'id': case})()


def test_first_or_named_cases_stay_fast():
  key = 'tests/test_tunix.py::test_checkpoint_resumes'
  named = ('tests/examples/test_optimizers.py::'
           'test_optimizer_lowers_the_loss_of_a_fixed_batch')
  items = [_Item(f'{key}[a]', 'a'), _Item(f'{key}[b]', 'b'),
           _Item(f'{named}[adamw]', 'adamw'), _Item(f'{named}[lion]', 'lion'),
           _Item(f'{named}[taco]', 'taco'),
           _Item('tests/test_x.py::test_other[a]', 'a')]
  assert [i.nodeid for i in tiers.long_cases(items)] == [
      f'{key}[b]', f'{named}[lion]']
