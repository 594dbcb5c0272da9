"""The quality benchmark's stages: learning-rate sweep and seeds, TACO
ablations, a longer budget, compiled memory, and learning-rate transfer.

Each ``stage_*`` takes the :class:`quality_results.Results`, a
``quality_runs.Runner`` and the ``benchmark.Budget``; runs already in the
results are reused, not rerun.
"""

import time

import jax
import numpy as np

from benchmarks.quality import results as quality_results
from benchmarks.quality import runs as quality_runs
from examples.finetune import api

Variant = quality_runs.Variant
Results = quality_results.Results


def log(message: str) -> None:
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
  log(f'{stage:<10} {variant.label:<24} lr {lr:<8g} seed {seed} '
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


def stage_main(results: Results, runner, budget) -> dict[str, float]:
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


def stage_ablations(results: Results, runner, budget,
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


def stage_long(results: Results, runner, budget,
               best: dict[str, float]) -> None:
  steps = budget.steps * budget.long_factor
  evals = range(budget.steps, steps, budget.steps)
  for name in budget.long_optimizers:
    _train(results, runner, 'long', Variant(name), best[name],
           budget.seeds[0], steps, max(1, steps // 10), eval_steps=evals)


def stage_memory(results: Results, runner, setup,
                 budget) -> None:
  """State bytes and compiled peaks of every compiled variant, and the
  example's layer-wise TACO step."""
  memory = results.data['memory']
  for variant, compiled in runner.compiled_steps().items():
    memory.setdefault(variant.label, {}).update(
        peak_memory_bytes=compiled.peak_memory_bytes,
        peak_memory_source=compiled.peak_memory_source,
        compile_seconds=compiled.compile_seconds)
  if budget.layerwise_peak and 'taco (layer-wise step)' not in memory:
    model = runner.model_of(runner.initial_params)
    batch = runner.first_batch()
    start = time.perf_counter()
    peak, source = quality_runs.layerwise_taco_peak(model, batch,
                                                     runner.hints)
    memory['taco (layer-wise step)'] = {
        'peak_memory_bytes': peak, 'peak_memory_source': source,
        'compile_seconds': time.perf_counter() - start}
  params = runner.initial_params
  results.data['meta']['parameter_bytes'] = sum(
      x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  results.save()


def transfer_vocabulary(task, train_records, tokenizer, budget):
  tokens = api.training_tokens(task, train_records, tokenizer)
  always = set()
  for word in api.TWEETS_LABEL_WORDS.values():
    always.update(api.encode(tokenizer, word, special=False))
  always.update(api.encode(tokenizer, ' It was', special=False))
  always.update(api.encode(tokenizer, '', special=True))
  size = tokenizer.get_vocab_size() if hasattr(
      tokenizer, 'get_vocab_size') else 49152
  return quality_runs.compact_vocabulary(tokens, size, budget.transfer_vocab,
                                           sorted(always))


def stage_transfer(results: Results, budget, tokenizer) -> None:
  """Pretrain each width briefly, then sweep the fine-tuning rate."""
  task, train, test = api.tweets(budget.transfer_eval_per_class)
  if budget.smoke:
    train = train[:64]
  vocabulary = transfer_vocabulary(task, train, tokenizer, budget)
  texts = [r['text'] for r in train]
  lm_tokens = quality_runs.language_modelling_examples(texts, tokenizer,
                                                         vocabulary)
  tokens = [vocabulary.example(t)
            for t in api.training_tokens(task, train, tokenizer)]
  eval_set = quality_runs.compact_eval_set(
      api.held_out_set(task, test, tokenizer), vocabulary)
  results.data['meta']['transfer'] = {
      'vocabulary': vocabulary.size,
      'vocabulary_coverage': float(np.mean(
          [t != vocabulary.size - 1 for e in lm_tokens
           for t in e.completion_ids])),
      'pretrain_texts': len(texts), 'eval_examples': len(test)}
  seq_len = budget.seq_len
  for width in budget.transfer_widths:
    config = quality_runs.small_config(
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
    model = quality_runs.new_model(config, seed=width)
    hints = api.decoder_hints(config)
    pretrainer = quality_runs.Runner(
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
    log(f'pretrain width {width}: loss {record["losses"][0]:.2f} -> '
         f'{np.mean(record["losses"][-5:]):.2f}, zero-shot accuracy '
         f'{record["accuracy"]}')
    if not results.find(stage='transfer-pretrain', width=width):
      results.add_run(record)
    pretrained = pretrainer.model_of(pretrainer.last_params)
    runner = quality_runs.Runner(
        pretrained, tokens, eval_set, None,
        batch_size=budget.transfer_batch_size, seq_len=seq_len,
        eval_batch_size=64, pad_id=0, hints=hints)
    for name, lr in planned:
      _train(results, runner, 'transfer', Variant(name), lr, 0, steps,
             max(1, steps // 10), width=width)
