"""The quality benchmark's budgets, its two setups (SmolLM2 and the smoke
test's tiny model) and its driver: :func:`run` the stages, :func:`main`."""

import argparse
import dataclasses
import functools
import os
import platform
from typing import Any, Optional

import jax

from benchmarks import provenance
from benchmarks.quality import report as quality_report
from benchmarks.quality import results as quality_results
from benchmarks.quality import runs as quality_runs
from benchmarks.quality import stages as quality_stages
from examples.finetune import api

OPTIMIZER_NAMES = ('taco', 'adamw', 'adafactor', 'lion', 'muon', 'sophia',
                   'galore')


@dataclasses.dataclass(frozen=True)
class Budget:
  """Everything that sizes the run (recorded in the JSON)."""
  steps: int = 16
  batch_size: int = 4
  seq_len: int = 32
  eval_per_class: int = 32
  eval_batch_size: int = 32
  seeds: tuple[int, ...] = (0, 1, 2)
  learning_rates: tuple[tuple[str, tuple[float, ...]], ...] = (
      ('taco', (3e-5, 1e-4, 3e-4)),
      ('adamw', (1e-5, 3e-5, 1e-4)),
      ('adafactor', (1e-5, 3e-5, 1e-4)),
      ('lion', (3e-6, 1e-5, 3e-5)),
      ('muon', (1e-5, 3e-5, 1e-4)),
      ('sophia', (1e-5, 3e-5, 1e-4)),
      ('galore', (1e-5, 3e-5, 1e-4)),
  )
  ablation_k: tuple[Optional[int], ...] = (1, 2, 4, 8, 16, 32, 64, None)
  ablation_mu: tuple[float, ...] = (0.0, 0.95)
  ablation_update_topk: tuple[int, ...] = (1, 2, 4, 8)
  max_grid_extensions: int = 2
  long_factor: int = 3
  long_optimizers: tuple[str, ...] = ('taco', 'adamw')
  transfer_widths: tuple[int, ...] = (64, 128, 256)
  transfer_layers: int = 2
  transfer_head_dim: int = 32
  transfer_vocab: int = 2048
  transfer_pretrain_steps: int = 150
  transfer_pretrain_lr: float = 3e-3
  transfer_batch_size: int = 16
  transfer_steps: int = 40
  transfer_eval_per_class: int = 100
  transfer_learning_rates: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3,
                                                1e-2, 3e-2)
  transfer_optimizers: tuple[str, ...] = ('taco', 'adamw')
  layerwise_peak: bool = True
  smoke: bool = False

  @property
  def warmup_steps(self) -> int:
    return max(1, self.steps // 10)


SMOKE = Budget(
    steps=2, batch_size=2, seq_len=24, eval_per_class=4, eval_batch_size=8,
    seeds=(0, 1),
    learning_rates=tuple((name, (1e-3,)) for name in OPTIMIZER_NAMES),
    ablation_k=(1, 16, None), ablation_mu=(0.0, 0.95),
    ablation_update_topk=(1, 2), long_factor=2, transfer_widths=(16, 32),
    transfer_layers=1, transfer_head_dim=8, transfer_vocab=128,
    transfer_pretrain_steps=2, transfer_batch_size=4, transfer_steps=2,
    transfer_eval_per_class=4, transfer_learning_rates=(1e-3, 1e-2),
    layerwise_peak=True, smoke=True)


# Setting up the model and data.


@dataclasses.dataclass
class Setup:
  model: Any
  model_config: Any
  tokenizer: Any
  task: Any
  train_records: list
  test_records: list
  description: str


def real_setup(budget: Budget) -> Setup:
  model, tokenizer, model_config, path = api.load_model(
      None, dtype='float32', remat=False)
  task, train, test = api.tweets(budget.eval_per_class)
  return Setup(model, model_config, tokenizer, task, train, test,
               f'SmolLM2-135M-Instruct ({os.path.basename(path)}), float32, '
               'no remat')


def smoke_setup(budget: Budget) -> Setup:
  """A tiny random Llama on a compact vocabulary, for the smoke test."""
  tokenizer = api.smollm2_tokenizer()
  task, train, test = api.tweets(budget.eval_per_class)
  train = train[:64]
  vocabulary = quality_stages.transfer_vocabulary(task, train, tokenizer,
                                                  budget)
  config = quality_runs.small_config(
      32, vocabulary.size, num_layers=1, head_dim=8,
      max_positions=budget.seq_len, bos_token_id=None, eos_token_id=None)
  model = quality_runs.new_model(config, 0)
  return Setup(model, config, _CompactTokenizer(tokenizer, vocabulary), task,
               train, test, 'smoke: a tiny random Llama (not a real model)')


class _CompactTokenizer:
  """A tokenizer whose ids are a compact vocabulary's (smoke test only)."""

  def __init__(self, tokenizer, vocabulary):
    self._tokenizer, self._vocabulary = tokenizer, vocabulary

  def encode(self, text, add_special_tokens=True):
    encoding = self._tokenizer.encode(text,
                                      add_special_tokens=add_special_tokens)
    return _Ids(list(self._vocabulary.ids(encoding.ids)))


@dataclasses.dataclass
class _Ids:
  ids: list


def _runner(setup: Setup, budget: Budget):
  tokens = api.training_tokens(setup.task, setup.train_records,
                               setup.tokenizer)
  eval_set = api.held_out_set(setup.task, setup.test_records,
                              setup.tokenizer)
  return quality_runs.Runner(
      setup.model, tokens, eval_set, setup.tokenizer,
      batch_size=budget.batch_size, seq_len=budget.seq_len,
      eval_batch_size=budget.eval_batch_size,
      pad_id=setup.model_config.pad_token_id or 0,
      hints=api.decoder_hints(setup.model_config))


STAGES = ('transfer', 'main', 'ablations', 'long', 'memory')


def run(out_dir: str, budget: Budget, render_only: bool = False,
        stages=STAGES) -> dict:
  """Runs the stages (skipping finished runs); renders after each."""
  results_dir = os.path.join(out_dir, 'results')
  os.makedirs(results_dir, exist_ok=True)
  results = quality_results.Results(
      os.path.join(results_dir, 'results.json'), budget)
  render = lambda: quality_report.render(results.data, out_dir)
  stage = functools.partial(quality_results.run_stage, results)
  if render_only:
    render()
    return results.data
  meta = results.data['meta']
  meta.update(jax_version=jax.__version__, backend=jax.default_backend(),
              cpu_count=os.cpu_count(), platform=platform.platform())
  session = results.start_session()
  session.update(stages=list(stages), commit=provenance.commit(),
                 load_average_at_start=list(os.getloadavg()))
  if 'transfer' in stages:
    stage('transfer', quality_stages.stage_transfer, results, budget,
          api.smollm2_tokenizer())
    render()
  if set(stages) & {'main', 'ablations', 'long', 'memory'}:
    setup = (smoke_setup if budget.smoke else real_setup)(budget)
    meta.update(model=setup.description, task='tweets sentiment',
                train_examples=len(setup.train_records),
                eval_examples=len(setup.test_records))
    runner = _runner(setup, budget)
    if 'zero_shot_accuracy' not in meta:
      meta['zero_shot_accuracy'] = runner.evaluate(runner.initial_params)
    quality_stages.log(f'{setup.description}: zero-shot accuracy '
                       f'{meta["zero_shot_accuracy"]:.3f}')
    best = results.data.get('best_learning_rates')
    if 'main' in stages:
      best = stage('main', quality_stages.stage_main, results, runner, budget)
      render()
    if best and 'ablations' in stages:
      stage('ablations', quality_stages.stage_ablations, results, runner,
            budget, best['taco'])
      render()
    if best and 'long' in stages:
      stage('long', quality_stages.stage_long, results, runner, budget, best)
    if 'memory' in stages:
      stage('memory', quality_stages.stage_memory, results, runner, setup,
            budget)
  session['load_average_at_end'] = list(os.getloadavg())
  results.save()
  render()
  return results.data


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
      prog='python -m benchmarks.quality',
      description='Does TACO fine-tune as well as the alternatives, with how '
      'much less memory?')
  parser.add_argument('--out', default='docs/measured',
                      help='writes <out>/results.md and <out>/results/')
  parser.add_argument('--smoke', action='store_true',
                      help='a seconds-long run on a tiny random model')
  parser.add_argument('--render-only', action='store_true',
                      help='re-render results.md from the existing JSON')
  parser.add_argument('--stages', default=','.join(STAGES),
                      help='comma-separated subset of ' + ','.join(STAGES))
  args = parser.parse_args(argv)
  stages = tuple(args.stages.split(','))
  unknown = set(stages) - set(STAGES)
  if unknown:
    parser.error(f'unknown stages {sorted(unknown)}')
  budget = SMOKE if args.smoke else Budget()
  run(args.out, budget, args.render_only, stages)

