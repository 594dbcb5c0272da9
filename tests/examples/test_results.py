"""results.json, typed: what the CLI writes reads back as the same keys and
values, a file written before the type reads too, and bad files are refused."""

import dataclasses
import json
import os

import pytest

from examples.finetune import results as results_lib
from tests.support.run_results import run_results

# A results.json that the CLI wrote before RunResults existed (a 3-step TACO
# run of the tiny Llama with --measure-landed; its folders renamed).
RECORDED = os.path.join(os.path.dirname(__file__), 'data', 'results.json')


# Keys added since RECORDED was written: it reads with them None.
NEWER = ('eval_split',)


def _recorded() -> dict:
  with open(RECORDED, encoding='utf-8') as f:
    payload = json.load(f)
  assert not set(NEWER) & set(payload)
  return {**payload, **dict.fromkeys(NEWER)}


def test_a_recorded_results_file_round_trips_key_for_key():
  payload = _recorded()
  results = results_lib.RunResults.read(RECORDED)
  # The same keys in the same order, the same values.
  assert list(results.to_json()) == list(payload)
  assert results.to_json() == payload
  assert json.dumps(results.to_json(), indent=2) == json.dumps(payload,
                                                               indent=2)
  assert results.master_weight_bytes == results_lib.MasterWeightBytes(0, 0)
  assert results.headline_after == payload['after'][payload['metric']]


def test_the_fields_are_the_recorded_keys():
  names = [field.name for field in dataclasses.fields(results_lib.RunResults)]
  assert names == list(_recorded())


def test_a_file_from_before_a_key_existed_reads_with_none(tmp_path):
  payload = _recorded()
  for key in ('rounding', 'process_peak_rss_bytes', 'compilation_cache',
              'master_weight_bytes', 'exported_to'):
    del payload[key]
  (tmp_path / 'results.json').write_text(json.dumps(payload))
  results = results_lib.find(str(tmp_path))
  assert results.rounding is None and results.compilation_cache is None
  assert results.master_weight_bytes is None
  assert results.after == payload['after']


def test_unknown_or_missing_keys_are_refused(tmp_path):
  payload = _recorded()
  with pytest.raises(ValueError, match=r"unknown key\(s\) \['acuracy'\]"):
    results_lib.RunResults.from_json({**payload, 'acuracy': 1.0})
  del payload['losses']
  with pytest.raises(ValueError, match='losses'):
    results_lib.RunResults.from_json(payload)
  assert results_lib.find(str(tmp_path)) is None  # no results.json (yet)


def test_a_directory_or_its_file_reads_the_same(tmp_path):
  results = run_results(task='trec', after={'accuracy': 0.75})
  (tmp_path / 'results.json').write_text(json.dumps(results.to_json()))
  assert results_lib.RunResults.read(str(tmp_path)) == results
  assert results_lib.RunResults.read(
      str(tmp_path / 'results.json')) == results
