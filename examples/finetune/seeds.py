"""Runs that differ only in ``--seed``: their held-out metric's mean and error.

``python -m examples.finetune.compare`` prints, after its table of runs, one
row per group of runs whose settings are the same but for the seed (and the
flags that do not change what a run computes: where it writes, checkpoints,
progress, processes): the optimizer, its learning rate, the number of seeds
and the mean and standard error of the metric after training. Two groups that
differ only in the optimizer (and so its learning rate) get a row for the
difference of their means, with the standard error of that difference.
"""

import math
from typing import Any, NamedTuple, Optional, Sequence

from examples.finetune import results as results_lib

Run = tuple[str, results_lib.RunResults]

# Settings that do not change what a run computes.
RUN_ONLY = frozenset({
    'seed', 'output_dir', 'resume', 'resume_allow_changes', 'save_checkpoint',
    'checkpoint_every', 'progress', 'compilation_cache',
    'compilation_cache_dir', 'coordinator_address', 'num_processes',
    'process_id', 'initialization_timeout', 'memory_limit_gb',
    'measure_landed'})
# What differs between the two arms of an A/B comparison.
ARM = frozenset({'optimizer', 'lr', 'warmup_steps', 'rounding', 'taco_k',
                 'taco_mu', 'taco_step'})


class Summary(NamedTuple):
  """The metric over seeds: ``mean`` and its standard error (``None`` with
  one seed)."""
  count: int
  mean: float
  error: Optional[float]


def summary(values: Sequence[float]) -> Summary:
  """Mean and standard error (sample standard deviation over sqrt(n))."""
  count = len(values)
  mean = sum(values) / count
  if count < 2:
    return Summary(count, mean, None)
  variance = sum((v - mean) ** 2 for v in values) / (count - 1)
  return Summary(count, mean, math.sqrt(variance / count))


def _setting(results: results_lib.RunResults) -> dict[str, Any]:
  config = dict(results.config)
  config['lr'] = results.learning_rate  # the rate the run used
  config['optimizer'] = results.optimizer
  return {k: v for k, v in config.items() if k not in RUN_ONLY}


def _key(setting: dict[str, Any], drop=frozenset()) -> tuple:
  return tuple(sorted((k, repr(v)) for k, v in setting.items()
                      if k not in drop))


def groups(runs: Sequence[Run]) -> list[list[Run]]:
  """The runs grouped by their settings but the seed, in first-seen order."""
  found: dict[tuple, list[Run]] = {}
  for run in runs:
    found.setdefault(_key(_setting(run[1])), []).append(run)
  return list(found.values())


def _after(group: Sequence[Run]) -> Summary:
  return summary([results.headline_after for _, results in group])


def _cell(s: Summary, scale: float) -> str:
  error = '' if s.error is None else f' ± {s.error * scale:.1f}'
  return f'{s.mean * scale:.1f}{error}'


def table(runs: Sequence[Run]) -> Optional[str]:
  """The groups with more than one seed, and the A/B differences; ``None``
  when no setting was run with several seeds."""
  grouped = [g for g in groups(runs) if len(g) > 1]
  if not grouped:
    return None
  rows = [('optimizer', 'lr', 'steps', 'task', 'seeds', 'metric',
           'after (mean ± s.e., %)')]
  for group in grouped:
    results = group[0][1]
    seeds = ','.join(str(r.config.get('seed', '?')) for _, r in group)
    rows.append((results.optimizer, f'{results.learning_rate:g}',
                 str(len(results.losses)), str(results.task), seeds,
                 results.metric, _cell(_after(group), 100)))
  rows += _differences(grouped)
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return '\n'.join('  '.join(cell.ljust(width) for cell, width
                             in zip(row, widths)).rstrip() for row in rows)


def _differences(grouped: Sequence[Sequence[Run]]) -> list[tuple[str, ...]]:
  """``a − b`` for pairs of groups that differ only in their arm."""
  rows = []
  for i, first in enumerate(grouped):
    for second in grouped[i + 1:]:
      a, b = _setting(first[0][1]), _setting(second[0][1])
      if _key(a, ARM) != _key(b, ARM) or a['optimizer'] == b['optimizer']:
        continue
      sa, sb = _after(first), _after(second)
      error = math.sqrt(sa.error ** 2 + sb.error ** 2)
      rows.append((f"{a['optimizer']} − {b['optimizer']}", '', '', '',
                   f'{sa.count} / {sb.count}', first[0][1].metric,
                   _cell(Summary(0, sa.mean - sb.mean, error), 100)))
  return rows
