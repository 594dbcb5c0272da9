"""The quality report's sections: main comparison, ablations, longer budget,
learning-rate transfer and memory, each a markdown table and a plot.

Each ``*_section(data, out_dir, lines)`` appends its markdown to ``lines`` and
returns the summary the findings are worded from.
"""

import math

import numpy as np

from benchmarks import _report_format as fmt


def main_summary(data) -> list[dict]:
  """One row per optimizer: its grid, best rate, seeds at the best rate."""
  budget = data['meta']['budget']
  best = data.get('best_learning_rates', {})
  rows = []
  grids = data.get('learning_rate_grids', {})
  for name, grid in budget['learning_rates']:
    grid = grids.get(name, grid)
    label = fmt.variant_label(name)
    sweep = {r['learning_rate']: r for r in fmt.runs(
        data, stage='sweep', optimizer=name, variant=label)}
    if not sweep:
      continue
    lr = best.get(name)
    at_best = [r for r in data['runs'] if r['optimizer'] == name and
               r.get('variant') == label and r['stage'] in ('sweep', 'seeds')
               and r['learning_rate'] == lr and r['steps'] == budget['steps']]
    mean, std = fmt.mean_std([r['accuracy'] for r in at_best])
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
        'loss': fmt.tail_loss(reference),
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
    grid = ', '.join(f'{lr:g}: {fmt.pct(acc)}'
                     for lr, acc in row['sweep'].items())
    edge = ' (grid edge)' if row['edge'] else ''
    mean = ('n/a' if row['mean'] is None else
            f'{100 * row["mean"]:.1f} +- {100 * row["std"]:.1f} '
            f'({row["seeds"]})')
    lines.append(f'| {row["optimizer"]} | {grid} | {row["best_lr"]}{edge} | '
                 f'{mean} | {fmt.mib(row["state_bytes"])} | '
                 f'{fmt.mib(row["peak_bytes"])} | '
                 f'{row["tokens_per_second"]:.0f} |')
  lines.append('')
  plt = fmt.plt()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for axis, field, title in ((axes[0], 'state_bytes',
                              'persistent optimizer state (MiB)'),
                             (axes[1], 'peak_bytes',
                              'compiled peak memory of a step (MiB)')):
    for row in rows:
      if row['mean'] is None or row[field] is None:
        continue
      x = max(row[field] / fmt.MIB, 1e-3)
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
  lines.append(fmt.image(fig, out_dir, 'pareto.png', 'accuracy vs memory'))
  fig, axis = plt.subplots(figsize=(6.5, 4))
  for row in rows:
    runs = fmt.runs(data, stage='sweep', optimizer=row['optimizer'],
                    variant=fmt.variant_label(row['optimizer']),
                    learning_rate=row['best_lr'])
    if runs:
      axis.plot(np.arange(1, len(runs[0]['losses']) + 1), runs[0]['losses'],
                label=f'{row["optimizer"]} (lr {row["best_lr"]:g})',
                lw=2.2 if row['optimizer'] == 'taco' else 1.2)
  fmt.finish(axis, xlabel='step', ylabel='training loss (completion NLL)',
             title='Loss curves at each optimizer\'s best rate, seed 0')
  lines.append(fmt.image(fig, out_dir, 'loss_curves.png', 'loss curves'))
  fig, axis = plt.subplots(figsize=(6.5, 4))
  for row in rows:
    lrs = [lr for lr, acc in row['sweep'].items() if acc is not None]
    axis.plot(lrs, [100 * row['sweep'][lr] for lr in lrs], 'o-',
              label=row['optimizer'])
  axis.set_xscale('log')
  fmt.finish(axis, xlabel='peak learning rate',
             ylabel='held-out accuracy (%), seed 0',
             title='Learning-rate sweep')
  lines.append(fmt.image(fig, out_dir, 'lr_sweep.png', 'lr sweep'))
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
  plt = fmt.plt()
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
      lines.append(f'| {label} | {fmt.pct(run["accuracy"])} | '
                   f'{fmt.tail_loss(run):.3f} | '
                   f'{fmt.mib(run["optimizer_state_bytes"])} | '
                   f'{fmt.mib(run["peak_memory_bytes"])} |')
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
      twin.bar(labels, [r['optimizer_state_bytes'] / fmt.MIB for _, r in rows],
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
  lines.append(fmt.image(fig, out_dir, 'ablations.png', 'ablations'))
  return found


def long_section(data, out_dir, lines):
  lines.append('## Longer step budget\n')
  runs = fmt.runs(data, stage='long')
  if not runs:
    lines.append('_Not run yet._\n')
    return runs
  lines.append('Same best rate, seed 0, the schedule stretched over the longer '
               'budget; held-out accuracy at intermediate steps.\n')
  lines.append('| optimizer | lr | steps | accuracy % at each evaluation |')
  lines.append('|---|---|---|---|')
  plt = fmt.plt()
  fig, axis = plt.subplots(figsize=(6, 4))
  for run in runs:
    evals = ', '.join(f'{e["step"]}: {fmt.pct(e["accuracy"])}'
                      for e in run['evals'])
    lines.append(f'| {run["optimizer"]} | {run["learning_rate"]:g} | '
                 f'{run["steps"]} | {evals} |')
    axis.plot([e['step'] for e in run['evals']],
              [100 * e['accuracy'] for e in run['evals']], 'o-',
              label=run['optimizer'])
  fmt.finish(axis, xlabel='step', ylabel='held-out accuracy (%)',
             title='Longer budget', legend_size=None)
  lines.append('')
  lines.append(fmt.image(fig, out_dir, 'long_budget.png', 'long budget'))
  return runs


def transfer_summary(data):
  """``{optimizer: {width: [(lr, tail loss, accuracy)]}}``."""
  table = {}
  for run in fmt.runs(data, stage='transfer'):
    table.setdefault(run['optimizer'], {}).setdefault(run['width'], []).append(
        (run['learning_rate'], fmt.tail_loss(run) if run['diverged_at_step'] is
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
  pretrain = {r['width']: r for r in fmt.runs(data, stage='transfer-pretrain')}
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
  plt = fmt.plt()
  fig, axes = plt.subplots(1, len(table), figsize=(5.5 * len(table), 4),
                           squeeze=False)
  for axis, (name, per_width) in zip(axes[0], sorted(table.items(),
                                                     key=lambda x: x[0] !=
                                                     'taco')):
    for width, rows in sorted(per_width.items()):
      best = min(rows, key=lambda r: r[1])
      cells = ', '.join(f'{lr:g}: {loss:.3f} / {fmt.pct(acc)}'
                        for lr, loss, acc in rows)
      p = pretrain.get(width)
      pre = (f'{p["losses"][0]:.2f} -> {fmt.tail_loss(p):.2f}' if p else 'n/a')
      params = f'{p["parameters"] / 1e6:.2f} M' if p else 'n/a'
      lines.append(f'| {width} | {params} | {pre} | {name} | {best[0]:g} | '
                   f'{cells} |')
      finite = [(lr, loss) for lr, loss, _ in rows if math.isfinite(loss)]
      axis.plot([lr for lr, _ in finite], [loss for _, loss in finite], 'o-',
                label=f'width {width}')
      axis.plot([best[0]], [best[1]], 'k*', ms=10)
    axis.set_xscale('log')
    fmt.finish(axis, xlabel='peak learning rate',
               ylabel='fine-tuning loss (last quarter)',
               title=f'{name}: loss vs rate per width (* = best)')
  lines.append('')
  lines.append(fmt.image(fig, out_dir, 'lr_transfer.png', 'lr transfer'))
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
  lines.append(f'Weights: {fmt.mib(data["meta"].get("parameter_bytes"))} MiB '
               '(f32). Peak from XLA\'s compiled memory analysis of one train '
               'step on CPU (batch and sequence as above, no remat).\n')
  lines.append('| step | persistent state MiB | peak MiB | compile s |')
  lines.append('|---|---|---|---|')
  for label, info in memory.items():
    lines.append(f'| {label} | {fmt.mib(state.get(label))} | '
                 f'{fmt.mib(info.get("peak_memory_bytes"))} | '
                 f'{info.get("compile_seconds", 0):.0f} |')
  lines.append('\nThe layer-wise step is the example\'s memory-lean TACO path '
               '(same updates as the optax path, tested); its state equals the '
               'default TACO state.\n')
  return lines
