"""The quality benchmark's results file: every run, kept across sessions.

:class:`Results` holds the JSON (``results/results.json``) and writes it
atomically after every run, so an interrupted benchmark resumes where it
stopped; :func:`run_stage` records a stage's outcome (or its error).
"""

import dataclasses
import json
import os
import time
from typing import Any, Optional

import numpy as np

from examples.finetune import api

# Budget fields each group of stages depends on: a rerun with another budget
# keeps the runs of groups whose fields did not change.
_GROUP_OF_STAGE = {'sweep': 'main', 'seeds': 'main', 'ablation': 'main',
                   'long': 'main', 'main': 'main', 'ablations': 'main',
                   'memory': 'main', 'transfer': 'transfer',
                   'transfer-pretrain': 'transfer'}


def _group_budget(budget: dict, group: str) -> dict:
  if group == 'transfer':
    names = [n for n in budget if n.startswith('transfer_')]
  else:
    # Not the rate grids, seeds or long budget: runs are found by rate, seed
    # and steps, so a widened grid or more seeds reuse the runs they have.
    names = ['steps', 'batch_size', 'seq_len', 'eval_per_class']
  return as_json({n: budget.get(n) for n in names + ['seq_len', 'smoke']})


class Results:
  """The JSON results of a ``quality.Budget``, written after every run.

  Runs of an earlier session are kept when the budget fields their stage
  depends on are unchanged (see ``_group_budget``); the others are dropped.
  """

  def __init__(self, path: str, budget):
    self.path = path
    self.budget = as_json(dataclasses.asdict(budget))
    self.data = {'meta': {'budget': self.budget}, 'runs': [], 'memory': {},
                 'stages_done': [], 'errors': []}
    if os.path.exists(path):
      with open(path) as f:
        previous = json.load(f)
      self._keep(previous)
    self._start = time.time()

  def start_session(self) -> dict:
    """Records a new run of the script; its wall time is kept updated."""
    self._start = time.time()
    session = {'started_unix': self._start}
    self.data['meta'].setdefault('sessions', []).append(session)
    return session

  def _keep(self, previous: dict) -> None:
    old = previous.get('meta', {}).get('budget') or {}
    same = {group: _group_budget(old, group) == _group_budget(self.budget,
                                                              group)
            for group in ('main', 'transfer')}
    if not any(same.values()):
      return
    self.data = previous
    self.data['meta']['budget'] = self.budget
    self.data['runs'] = [r for r in previous['runs']
                         if same[_GROUP_OF_STAGE[r['stage']]]]
    self.data['stages_done'] = [s for s in previous.get('stages_done', [])
                                if same[_GROUP_OF_STAGE[s]]]
    if not same['main']:
      self.data['memory'] = {}
      self.data.pop('best_learning_rates', None)
      self.data['meta'].pop('zero_shot_accuracy', None)

  def find(self, **key) -> Optional[dict]:
    for run in self.data['runs']:
      if all(run.get(k) == v for k, v in key.items()):
        return run
    return None

  def add_run(self, record: dict) -> None:
    self.data['runs'].append(record)
    self.save()

  def save(self) -> None:
    sessions = self.data['meta'].get('sessions')
    if sessions:
      sessions[-1]['elapsed_seconds'] = time.time() - self._start
    api.write_json_atomic(self.path, as_json(self.data))


def as_json(value: Any) -> Any:
  return json.loads(json.dumps(value, default=_json_default))


def _json_default(value):
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (np.floating,)):
    return float(value)
  raise TypeError(type(value).__name__)


def run_stage(results: Results, name: str, function, *args):
  """Runs one stage; records its time, or its error (the rest still runs)."""
  start = time.perf_counter()
  try:
    output = function(*args)
  except Exception as e:  # A failed stage is reported; the rest still runs.
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
    results.data['errors'].append(f'{name}: {type(e).__name__}: {e}'[:500])
    results.save()
    return None
  if name not in results.data['stages_done']:
    results.data['stages_done'].append(name)
  results.data['meta'].setdefault('stage_seconds', {})[name] = (
      time.perf_counter() - start)
  results.save()
  return output
