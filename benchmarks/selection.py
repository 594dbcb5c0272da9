"""Where TACO's update time goes: per-column selection against the floor.

For every distinct matrix of a Llama-shaped tree (``benchmarks.step_time``'s
shapes), in the row layout TACO selects on (``(n, m)``: one row per column of
the weight, ``m`` candidates each), times

* ``max``: ``max(|x|)`` per row, one read of the candidates (the floor);
* ``top_k``: ``lax.top_k(|x|, k)`` per row, what ``column_topk`` runs;
* ``taco``: the whole ``scale_by_taco`` update of that one matrix, history
  included;

and the sums over the tree (each matrix weighted by how often it occurs).
Last line: ``topk_share=<top_k sum / taco sum> topk_over_max=<ratio>``.

  python -m benchmarks.selection [--model llama-125m] [--k 16]
"""

import argparse
import collections

import jax
import jax.numpy as jnp

from benchmarks import step_time
import taco_optax


def _timed(fn, *args, repeats):
  return 1e3 * step_time.time_fn(jax.jit(fn), args, repeats)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='llama-125m',
                      choices=sorted(step_time.SHAPES))
  parser.add_argument('--k', type=int, default=16)
  parser.add_argument('--repeats', type=int, default=10)
  args = parser.parse_args()
  params = step_time.llama_params(args.model, jnp.float32)
  counts = collections.Counter(x.shape for x in params.values()
                               if x.ndim == 2)
  tx = taco_optax.scale_by_taco(k=args.k)
  print(f'model={args.model} k={args.k} device={jax.devices()[0].device_kind}')
  print(f'{"weight (in, out)":>18} {"count":>5} {"max ms":>8} '
        f'{"top_k ms":>9} {"taco ms":>8}')
  totals = collections.Counter()
  for shape, count in sorted(counts.items()):
    grad = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    rows = grad  # (in, out): row j holds column j's out-feature candidates
    t_max = _timed(lambda x: jnp.max(jnp.abs(x), axis=-1), rows,
                   repeats=args.repeats)
    t_topk = _timed(lambda x: jax.lax.top_k(jnp.abs(x), args.k), rows,
                    repeats=args.repeats)
    state = tx.init({'w': grad})
    t_taco = _timed(lambda g, s: tx.update({'w': g}, s), grad, state,
                    repeats=args.repeats)
    print(f'{str(shape):>18} {count:>5} {t_max:>8.3f} {t_topk:>9.3f} '
          f'{t_taco:>8.3f}')
    totals.update(max=count * t_max, top_k=count * t_topk, taco=count * t_taco)
  print(f'{"tree total":>18} {"":>5} {totals["max"]:>8.2f} '
        f'{totals["top_k"]:>9.2f} {totals["taco"]:>8.2f}')
  print(f'topk_share={totals["top_k"] / totals["taco"]:.3f} '
        f'topk_over_max={totals["top_k"] / totals["max"]:.2f}')


if __name__ == '__main__':
  main()
