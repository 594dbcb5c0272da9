"""Update-only time of TACO vs optax optimizers on LLM-shaped parameter trees.

Times ``jit(update + apply_updates)`` (params and state donated) for
``taco_optax.taco`` and optax's adamw, adafactor, lion and contrib.muon, TACO
as the example's layer-wise step applies it (blocks unrolled, each one's
winners scattered into its weights at the end of its backward pass, no dense
update, on a model whose backward pass only hands over the gradient), and one
read of the gradient tree (the memory-bound floor). With 16-bit
parameters TACO is also timed with ``rounding='nearest'``. Prints a table
and, on its last line, ``taco_over_adamw=<ratio> taco_over_read=<ratio>
taco_scatter_over_adamw=...`` (and ``stochastic_over_nearest=...``).

  python -m benchmarks.step_time [--model llama-125m|llama-350m|smollm2-135m]
      [--dtype bfloat16|float32] [--repeats 3]
"""

import argparse
import datetime
import os
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks import provenance
import taco_optax

# name: (vocab, hidden, layers, ffn, q heads * head dim, kv heads * head dim)
SHAPES = {
    'smollm2-135m': (49152, 576, 30, 1536, 576, 192),
    'llama-125m': (32000, 768, 12, 2048, 768, 768),
    'llama-350m': (32000, 1024, 24, 2816, 1024, 1024),
}


def llama_params(name, dtype):
  """A Llama-shaped parameter tree, Flax layout (in, out), random values."""
  vocab, hidden, layers, ffn, q_dim, kv_dim = SHAPES[name]
  shapes = {'embedding': (vocab, hidden), 'lm_head': (hidden, vocab),
            'final_norm': (hidden,)}
  for l in range(layers):
    shapes.update({
        f'layer{l}/q': (hidden, q_dim), f'layer{l}/k': (hidden, kv_dim),
        f'layer{l}/v': (hidden, kv_dim), f'layer{l}/o': (q_dim, hidden),
        f'layer{l}/gate': (hidden, ffn), f'layer{l}/up': (hidden, ffn),
        f'layer{l}/down': (ffn, hidden), f'layer{l}/attn_norm': (hidden,),
        f'layer{l}/mlp_norm': (hidden,)})
  keys = jax.random.split(jax.random.key(0), len(shapes))
  return {name: (0.02 * jax.random.normal(key, shape)).astype(dtype)
          for key, (name, shape) in zip(keys, sorted(shapes.items()))}


def optimizers():
  lr = 1e-4
  return {
      'taco': taco_optax.taco(lr),
      'adamw': optax.adamw(lr),
      'adafactor': optax.adafactor(lr),
      'lion': optax.lion(lr),
      'muon': optax.contrib.muon(lr),
  }


def time_fn(fn, args, repeats):
  """Best wall time of ``fn(*args)`` over ``repeats`` runs (after a warm-up)."""
  out = fn(*args)
  jax.block_until_ready(out)
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, time.perf_counter() - start)
  return best


def time_optimizer(tx, params, grads, repeats):
  """Best time of one update step; ``grads`` is a list used in turn."""
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  compiled = step.lower(params, state, grads[0]).compile()
  carry = [jax.tree.map(jnp.copy, params), state, 0]

  def run():
    carry[2] += 1
    carry[0], carry[1] = compiled(carry[0], carry[1],
                                  grads[carry[2] % len(grads)])
    return carry[0]

  best = time_fn(lambda: run(), (), repeats)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  return best, state_bytes


def _given_gradient(grad_of):
  """``f(params, hidden, g) -> hidden`` whose vjp gives ``grad_of(g, hidden)``
  as the params' gradient and passes the hidden cotangent through: a model
  whose backward pass costs nothing but handing over a known gradient."""
  @jax.custom_vjp
  def f(params, hidden, g):
    del params, g
    return hidden

  def fwd(params, hidden, g):
    return hidden, (hidden, g)

  def bwd(residuals, d_hidden):
    hidden, g = residuals
    return grad_of(g, hidden), d_hidden, None

  f.defvjp(fwd, bwd)
  return f


def layered_split(params):
  """``(outer, layers)`` of a :func:`llama_params` tree, as the example splits
  its decoder: embedding, head and final norm outside, one dict per block."""
  outer = {k: v for k, v in params.items() if not k.startswith('layer')}
  count = 1 + max(int(k.split('/')[0][5:]) for k in params
                  if k.startswith('layer'))
  layers = [{k.split('/')[1]: v for k, v in params.items()
             if k.startswith(f'layer{l}/')} for l in range(count)]
  return outer, layers


def given_gradient_loss():
  """A ``LayeredLoss`` on :func:`layered_split` params whose gradient is the
  batch: ``batch = (outer G, layers' G stacked)`` (:func:`given_batch`).

  Its backward hands each block its slice of ``G`` (``_given_gradient``) and
  computes nothing else (no loss pass); the hidden state carries the
  block's index. The embedding is read by the embedding, the head's leaves
  by the head, as in the example's split.
  """
  emit = _given_gradient(lambda g, hidden: g)
  block = _given_gradient(lambda g, hidden: jax.tree.map(
      lambda x: jax.lax.dynamic_index_in_dim(
          x, hidden[1].astype(jnp.int32), keepdims=False), g))
  head_leaves = lambda tree: {k: tree[k] for k in ('final_norm', 'lm_head')}
  return taco_optax.layerwise.LayeredLoss(
      embed=lambda outer, batch: emit(
          outer['embedding'], (jnp.zeros(()), jnp.zeros(())),
          batch[0]['embedding']),
      layer=lambda p, hidden, batch: (
          lambda h: (h[0], h[1] + 1))(block(p, hidden, batch[1])),
      head=lambda outer, hidden, batch: emit(
          head_leaves(outer), hidden, head_leaves(batch[0]))[0],
      scan_layers=False)


def given_batch(grads):
  """The batch of :func:`given_gradient_loss` for a gradient tree."""
  g_outer, g_layers = layered_split(grads)
  return g_outer, jax.tree.map(lambda *xs: jnp.stack(xs), *g_layers)


def time_scatter_apply(params, grads, repeats, implementation, lr=1e-4):
  """TACO as the example's layer-wise step applies it, on given gradients.

  ``taco_optax.layerwise.train_step`` on the example's split (unrolled
  blocks) with :func:`given_gradient_loss`: each block's winners are written
  into its weights as its backward pass ends, the head's before the blocks
  and the embedding's after.
  """
  loss = given_gradient_loss()
  batches = [given_batch(tree) for tree in grads]
  tx = taco_optax.taco(lr, implementation=implementation)
  split = layered_split(params)
  state = tx.init(split)
  step = jax.jit(taco_optax.layerwise.train_step(loss, tx),
                 donate_argnums=(0, 1))
  carry = [jax.tree.map(jnp.copy, split), state, 0]

  def run():
    carry[2] += 1
    carry[0], carry[1], _ = step(carry[0], carry[1],
                                 batches[carry[2] % len(batches)])
    return carry[0]

  return time_fn(run, (), repeats)


def time_read(grads, repeats):
  read = jax.jit(lambda g: [jnp.max(x) for x in jax.tree.leaves(g)])
  return time_fn(read, (grads,), repeats)


def write_markdown(path, args, rows, read, summary):
  """The run's table as Markdown, with what it was measured on."""
  load = ', '.join(f'{x:.1f}' for x in os.getloadavg())
  lines = [
      '# Update time (written by `python -m benchmarks.step_time`)', '',
      f'Command: `python -m benchmarks.step_time --model {args.model} '
      f'--dtype {args.dtype} --repeats {args.repeats} --kernels '
      f'{args.kernels}{" --same-gradient" if args.same_gradient else ""}'
      f'{" --only " + args.only if args.only else ""}`  ',
      f'Commit {provenance.commit()}, {datetime.date.today().isoformat()}, '
      f'{jax.devices()[0].device_kind}, {os.cpu_count()} cores, load average '
      f'{load} (a shared machine: times are noisy; ratios come from one run).',
      '', '| update | ms | × one read of the gradients | state MiB |',
      '| --- | ---: | ---: | ---: |']
  lines += [f'| {name} | {1e3 * seconds:.1f} | {seconds / read:.2f} | '
            f'{state_bytes / 2**20:.1f} |'
            for name, seconds, state_bytes in rows]
  lines += ['', f'`{summary}`', '']
  with open(path, 'w') as f:
    f.write('\n'.join(lines))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', default='llama-125m', choices=sorted(SHAPES))
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--only', default=None,
                      help='comma-separated subset of optimizers')
  parser.add_argument(
      '--kernels', default=os.environ.get('TACO_OPTAX_KERNEL', 'auto'),
      help="comma-separated implementation= values to time ('auto', 'cpu', "
      "'pallas', 'reference')")
  parser.add_argument('--same-gradient', action='store_true',
                      help='one gradient tree for every step')
  parser.add_argument('--write', default=None, help='Markdown output file')
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  params = llama_params(args.model, dtype)
  grads = [jax.tree.map(
      lambda p, seed=seed: (1e-3 * jax.random.normal(
          jax.random.key(seed), p.shape)).astype(p.dtype), params)
           for seed in ((1,) if args.same_gradient else (1, 2))]
  num_params = sum(x.size for x in jax.tree.leaves(params))
  print(f'model={args.model} params={num_params / 1e6:.1f}M dtype={dtype.name}'
        f' device={jax.devices()[0].device_kind}')
  read = time_read(grads[0], args.repeats)
  rows = [('read gradients', read, 0)]
  chosen = optimizers()
  if args.only:
    chosen = {k: v for k, v in chosen.items() if k in args.only.split(',')}
  kernels = args.kernels.split(',')
  times = {}
  for name, tx in chosen.items():
    if name != 'taco':
      seconds, state_bytes = time_optimizer(tx, params, grads, args.repeats)
      rows.append((name, seconds, state_bytes))
      times[name] = seconds
      continue
    for kernel in kernels:
      label = '' if len(kernels) == 1 else f' [{kernel}]'
      seconds, state_bytes = time_optimizer(
          taco_optax.taco(1e-4, implementation=kernel), params, grads,
          args.repeats)
      scatter = time_scatter_apply(params, grads, args.repeats, kernel)
      rows += [(f'taco{label}', seconds, state_bytes),
               (f'taco (scatter){label}', scatter, state_bytes)]
      times[f'taco{kernel}'] = seconds
      times[f'scatter{kernel}'] = scatter
      if dtype.itemsize == 2:  # what stochastic rounding costs the update
        nearest, _ = time_optimizer(
            taco_optax.taco(1e-4, implementation=kernel, rounding='nearest'),
            params, grads, args.repeats)
        rows.append((f"taco, rounding='nearest'{label}", nearest,
                     state_bytes))
        times[f'nearest{kernel}'] = nearest
  print(f'{"update":<34}{"ms":>10}{"x read":>9}{"state MiB":>11}')
  for name, seconds, state_bytes in rows:
    print(f'{name:<34}{1e3 * seconds:>10.1f}{seconds / read:>9.2f}'
          f'{state_bytes / 2**20:>11.1f}')
  last = kernels[-1]
  if f'taco{last}' in times and 'adamw' in times:
    summary = (f'taco_over_adamw={times[f"taco{last}"] / times["adamw"]:.3f} '
               f'taco_over_read={times[f"taco{last}"] / read:.3f} '
               f'taco_scatter_over_adamw='
               f'{times[f"scatter{last}"] / times["adamw"]:.3f}')
    if f'nearest{last}' in times:
      summary += (' stochastic_over_nearest='
                  f'{times[f"taco{last}"] / times[f"nearest{last}"]:.3f}')
    print(summary)
    if args.write:
      write_markdown(args.write, args, rows, read, summary)


if __name__ == '__main__':
  main()
