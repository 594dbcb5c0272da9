"""How many updates of 16-bit weights land: per leaf kind, TACO and AdamW.

A bfloat16 weight of 0.02 has an ulp of 1.2e-4, and rounding ``w + u`` to
nearest drops every ``|u|`` below half of it. This benchmark takes a few
optimizer steps on a Llama-shaped tree (SmolLM2-135M's shapes, ``--layers``
of its 30 blocks; matrices and the token table N(0, 0.02**2), norm scales 1)
with random gradients, and reports per leaf kind:

* ``landed``: the share of the intended updates (TACO: one winner per
  column with a nonzero sign; Adam: every element) that changed the stored
  weight;
* ``moved``: the weights' total movement over the intended one (the same
  optimizer's update on float32 copies), ``sum |w_new - w_old| / sum |u|``:
  1 is an update that lands on average (stochastic rounding), well below 1
  an update rounding swallows;
* the share of weights that became NaN or Inf, where any did.

for bfloat16 and float16 weights, rounding to nearest (``optax.apply_updates``)
and stochastically (``taco(rounding='stochastic')``; AdamW chained with
``taco_optax.stochastic_rounding()``), at the paper's rate (3e-5) and at the
example CLI's 40-step rates (TACO 1e-4, AdamW 3.2e-5). TACO's winners depend
on the gradients only, so every rounding sees the same ones. The last line is
``taco_stochastic_landed=... taco_nearest_landed=... taco_stochastic_moved=...``
(bfloat16, the paper's rate, averaged over TACO's matrix kinds).

    python -m benchmarks.landed_updates [--layers 4] [--steps 3]
        [--write docs/measured/landed_updates.md]
"""

import argparse
import collections
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import presets
from benchmarks import provenance
import taco_optax

KINDS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down', 'embedding', 'norm')
PAPER_RATE = 3e-5
CLI_RATES = {'taco': 1e-4, 'adamw': 3.2e-5}


def llama_tree(config: dict, layers: int, dtype: Any, seed: int = 0
               ) -> dict[str, jax.Array]:
  """``{'<layer>/<kind>': weight}`` of a Llama config's first ``layers``."""
  hidden, ffn = config['hidden_size'], config['intermediate_size']
  heads_dim = config['num_attention_heads'] * config['head_dim']
  kv_dim = config['num_key_value_heads'] * config['head_dim']
  shapes = {'embedding': (config['vocab_size'], hidden)}
  for l in range(layers):
    shapes.update({
        f'{l}/q': (hidden, heads_dim), f'{l}/k': (hidden, kv_dim),
        f'{l}/v': (hidden, kv_dim), f'{l}/o': (heads_dim, hidden),
        f'{l}/gate': (hidden, ffn), f'{l}/up': (hidden, ffn),
        f'{l}/down': (ffn, hidden), f'{l}/norm': (hidden,)})
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {name: (jnp.ones(shape) if name.endswith('norm') else 0.02 *
                 jax.random.normal(key, shape)).astype(dtype)
          for key, (name, shape) in zip(keys, sorted(shapes.items()))}


def kind_of(name: str) -> str:
  return name.split('/')[-1]


def optimizer(name: str, rate: float, rounding: str
              ) -> optax.GradientTransformation:
  """TACO as the example runs it (token table scale 1), or AdamW."""
  if name == 'taco':
    scale = lambda tree: {n: 1.0 if n == 'embedding' else None for n in tree}
    return taco_optax.taco(rate, update_scale=scale, rounding=rounding)
  adamw = optax.adamw(rate, weight_decay=0.0)
  if rounding == 'stochastic':
    return optax.chain(adamw, taco_optax.stochastic_rounding())
  return adamw


def measure(params: dict, make: Callable[[str], optax.GradientTransformation],
            steps: int, seed: int = 1) -> dict[str, dict[str, tuple]]:
  """``{rounding: {kind: (landed, moved, non-finite)}}`` over ``steps``.

  The intended update of each step is the same optimizer's on float32
  copies of the weights and gradients: neither TACO's update nor Adam's
  (without weight decay) depends on the weights, only on the gradients,
  which all runs share.
  """
  # Per kind: intended updates, landed ones, movement, intended movement,
  # non-finite weights.
  counts = {r: collections.defaultdict(lambda: np.zeros(5))
            for r in ('nearest', 'stochastic')}
  as_f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  txs = dict({r: make(r) for r in counts}, reference=make('nearest'))
  weights = dict({r: params for r in counts}, reference=as_f32(params))
  states = {r: txs[r].init(weights[r]) for r in txs}
  updates = {r: jax.jit(txs[r].update) for r in txs}
  for step in range(steps):
    keys = jax.random.split(jax.random.key(seed + step), len(params))
    grads = {n: jax.random.normal(key, p.shape).astype(p.dtype)
             for key, (n, p) in zip(keys, sorted(params.items()))}
    intended, states['reference'] = updates['reference'](
        as_f32(grads), states['reference'], weights['reference'])
    for rounding in counts:
      old = weights[rounding]
      update, states[rounding] = updates[rounding](grads, states[rounding],
                                                   old)
      new = optax.apply_updates(old, update)
      for name in params:
        want = np.asarray(intended[name], np.float64)
        after = np.asarray(new[name], np.float64)
        finite = np.isfinite(after)
        moved = np.where(finite, np.abs(after - np.asarray(old[name],
                                                            np.float64)), 0)
        counts[rounding][kind_of(name)] += (
            np.count_nonzero(want), np.count_nonzero(moved[want != 0]),
            moved.sum(), np.abs(want).sum(), np.count_nonzero(~finite))
      weights[rounding] = new
  return {r: {kind: (c[1] / c[0], c[2] / c[3], c[4] / c[0])
              for kind, c in by_kind.items()}
          for r, by_kind in counts.items()}


def run(config: dict, layers: int, steps: int, dtypes=('bfloat16', 'float16')
        ) -> list[tuple]:
  """Rows ``(dtype, optimizer, rate, rounding, {kind: (landed, moved)})``."""
  rows = []
  for dtype in dtypes:
    params = llama_tree(config, layers, jnp.dtype(dtype))
    for name in ('taco', 'adamw'):
      for rate in (PAPER_RATE, CLI_RATES[name]):
        result = measure(params, lambda r: optimizer(name, rate, r), steps)
        rows += [(dtype, name, rate, r, result[r]) for r in result]
  return rows


def _mean(result: dict, kinds, field: int) -> float:
  return float(np.mean([result[k][field] for k in kinds if k in result]))


def _cell(landed: float, moved: float, non_finite: float) -> str:
  if non_finite:
    return f'NaN/Inf in {100 * non_finite:.1f}%'
  return f'{100 * landed:.0f}% ({moved:.2f})'


def table(rows: list[tuple]) -> list[str]:
  header = ('| dtype | optimizer | lr | rounding | '
            + ' | '.join(KINDS) + ' |')
  lines = [header, '| ' + ' | '.join(['---'] * 4 + ['---:'] * len(KINDS))
           + ' |']
  for dtype, name, rate, rounding, result in rows:
    cells = [_cell(*result[k]) if k in result else '' for k in KINDS]
    lines.append(f'| {dtype} | {name} | {rate:g} | {rounding} | '
                 + ' | '.join(cells) + ' |')
  return lines


def summary(rows: list[tuple]) -> str:
  matrices = [k for k in KINDS if k != 'norm']
  pick = {(d, n, r, m): res for d, n, r, m, res in rows}
  taco = lambda m, field: _mean(pick[('bfloat16', 'taco', PAPER_RATE, m)],
                                matrices, field)
  adam_norm = lambda m: pick[('bfloat16', 'taco', PAPER_RATE, m)]['norm'][1]
  return (f'taco_stochastic_landed={taco("stochastic", 0):.3f} '
          f'taco_nearest_landed={taco("nearest", 0):.3f} '
          f'taco_stochastic_moved={taco("stochastic", 1):.3f} '
          f'taco_nearest_moved={taco("nearest", 1):.3f} '
          f'norm_stochastic_moved={adam_norm("stochastic"):.3f} '
          f'norm_nearest_moved={adam_norm("nearest"):.3f}')


def write(path: str, args, rows: list[tuple], line: str) -> None:
  command = (f'python -m benchmarks.landed_updates --layers {args.layers} '
             f'--steps {args.steps} --write {path}')
  lines = [
      '# Do 16-bit updates land? (written by `python -m '
      'benchmarks.landed_updates`)', '',
      f'Command: `{command}`  ', f'{provenance.stamp()}.', '',
      f'SmolLM2-135M shapes ({args.layers} of 30 blocks and the token table), '
      'weights N(0, 0.02²), norm scales 1, random gradients, '
      f'{args.steps} steps. Each cell: the share of intended updates that '
      'changed the stored weight, and (in brackets) the total movement over '
      'the intended one (1: the updates land on average), the intended '
      'update being the same optimizer\'s on float32 copies; "NaN/Inf" when '
      'weights became non-finite. TACO\'s norm scales are its Adam branch '
      '(float32 moments with stochastic rounding).', '']
  lines += table(rows) + ['', f'`{line}`', '']
  with open(path, 'w') as f:
    f.write('\n'.join(lines))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--write', default=None, help='Markdown output file')
  args = parser.parse_args()
  rows = run(presets.PRESETS['smollm2-135m'], args.layers, args.steps)
  for line in table(rows):
    print(line)
  line = summary(rows)
  print(line)
  if args.write:
    write(args.write, args, rows, line)


if __name__ == '__main__':
  main()
