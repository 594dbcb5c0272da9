"""tunix's trainers side by side: memory of PeftTrainer, LayerwisePeftTrainer.

On a tunix ``Qwen3`` of ~55M parameters (float32, untied head; CPU), for

* ``peft_adamw``: tunix's ``PeftTrainer`` with ``optax.adamw``,
* ``peft_taco``: ``PeftTrainer`` with ``taco_optax.taco`` (einsum kernels
  routed to TACO),
* ``layerwise_taco``: ``taco_optax.tunix.LayerwisePeftTrainer`` with the
  same optimizer,

it reports the compiled peak of each trainer's train step as the trainer
jits it (``memory_analysis()``: arguments + outputs - aliased + temporaries;
tunix donates the optimizer state, the layer-wise trainer the parameters
too), and, each in a fresh process, the peak RSS after 3 steps and the
losses of the first 5. The gradient saving is ``(peak of peft_taco - peak of
layerwise_taco) / gradient bytes`` (a float32 gradient of every parameter).

  python -m benchmarks.tunix_trainers [--out docs/measured/tunix_memory.md]

The last line is ``gradient_bytes_saved=<fraction> loss_max_rel=<value>``.
"""

import argparse
import json
import resource
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import optax

from benchmarks import provenance
from benchmarks import tunix_models

MODES = ('peft_adamw', 'peft_taco', 'layerwise_taco')
# Compiled only: gradient_accumulation_steps=ACCUMULATION (micro-batches of
# BATCH sequences).
ACCUMULATING = ('peft_taco_accum', 'layerwise_taco_accum')
ACCUMULATION = 4
SIZE = dict(layers=12, vocab=16384, dim=512, hidden=1536, heads=8,
            head_dim=64, kv_heads=4, tied=False)
BATCH, SEQ, STEPS, RSS_STEP = 4, 128, 5, 3


def trainer(mode: str, steps: int = STEPS):
  """The mode's trainer on a fresh ~55M Qwen3 (``*_accum``: accumulating)."""
  from tunix.sft import peft_trainer  # pylint: disable=import-outside-toplevel

  from taco_optax import tunix as taco_tunix  # pylint: disable=import-outside-toplevel
  model = tunix_models.qwen3(**SIZE)
  optimizer = (optax.adamw(1e-4) if mode == 'peft_adamw'
               else tunix_models.taco(model, 1e-4))
  cls = (taco_tunix.LayerwisePeftTrainer if mode.startswith('layerwise')
         else peft_trainer.PeftTrainer)
  config = peft_trainer.TrainingConfig(
      eval_every_n_steps=1000, max_steps=steps, pbar_description=None,
      gradient_accumulation_steps=(ACCUMULATION if mode.endswith('_accum')
                                   else None))
  return cls(model, optimizer, config).with_gen_model_input_fn(
      tunix_models.model_input)


def data(steps: int = STEPS):
  return tunix_models.batches(steps, batch=BATCH, seq=SEQ,
                              vocab=SIZE['vocab'], seed=1)


def compiled(mode: str) -> dict[str, Any]:
  """The memory analysis of the mode's train step, jitted as it trains.

  ``forward`` is tunix's eval step (the loss alone: inference's peak).
  """
  from flax import nnx  # pylint: disable=import-outside-toplevel
  run = trainer('peft_taco' if mode == 'forward' else mode)
  donated = () if mode == 'forward' else getattr(
      run, 'donated_arguments', ('optimizer',))
  model_def, model_state = nnx.split(run.model)
  opt_def, opt_state = nnx.split(run.optimizer)

  def pure(model_state, opt_state, inputs):
    model = nnx.merge(model_def, model_state)
    if mode == 'forward':  # the model and the batch in, the loss out
      return run.create_eval_step_fn()(model, inputs)
    optimizer = nnx.merge(opt_def, opt_state)
    out = run.create_train_step_fn()(model, optimizer, inputs)
    return nnx.state(model), nnx.state(optimizer), out

  donate = tuple(i for i, name in enumerate(('model', 'optimizer'))
                 if name in donated)
  batch = jax.tree.map(np.asarray, data(1)[0])
  if getattr(run, 'fused_accumulation_steps', None):  # a group of micro-batches
    batch = jax.tree.map(lambda x: np.stack([x] * ACCUMULATION, axis=1),
                         batch)
  stats = jax.jit(pure, donate_argnums=donate).lower(
      model_state, opt_state, batch).compile().memory_analysis()
  params = nnx.state(run.model, nnx.Param)
  return dict(
      argument=stats.argument_size_in_bytes,
      output=stats.output_size_in_bytes, alias=stats.alias_size_in_bytes,
      temp=stats.temp_size_in_bytes,
      peak=(stats.argument_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes + stats.temp_size_in_bytes),
      params=sum(x.size for x in jax.tree.leaves(params)),
      param_bytes=sum(x.nbytes for x in jax.tree.leaves(params)),
      state_bytes=sum(x.nbytes for x in jax.tree.leaves(
          nnx.state(run.optimizer, nnx.optimizer.OptState))))


def measured(mode: str) -> dict[str, Any]:
  """Losses of the first steps, and peak RSS after ``RSS_STEP`` (this run)."""
  from tunix.sft import hooks  # pylint: disable=import-outside-toplevel

  rss = {}

  class PeakAfter(hooks.TrainingHooks):

    def on_train_step_end(self, train_ctx, train_step, train_loss):
      del train_ctx, train_loss
      if train_step == RSS_STEP:
        rss['bytes'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def on_train_start(self, train_ctx):
      pass

    def on_train_end(self, train_ctx):
      pass

    def on_train_step_start(self, train_ctx):
      pass

    def on_eval_step_start(self, train_ctx):
      pass

    def on_eval_step_end(self, train_ctx, eval_loss):
      pass

  run = trainer(mode)
  run.with_training_hooks(PeakAfter())
  run.train(data())
  losses = run.metrics_logger.get_metric_history('', 'loss', 'train')
  return dict(losses=[float(x) for x in losses], rss=rss.get('bytes'))


def in_subprocess(mode: str) -> dict[str, Any]:
  out = subprocess.run(
      [sys.executable, '-m', 'benchmarks.tunix_trainers', '--measure', mode],
      capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(x):
  return f'{x / 2**20:,.1f}'


def report(rows: dict[str, dict[str, Any]]) -> str:
  """The markdown table and the closing ``key=value`` line."""
  grad_bytes = rows['peft_taco']['param_bytes']
  peft_taco, ours = rows['peft_taco'], rows['layerwise_taco']
  saved = (peft_taco['peak'] - ours['peak']) / grad_bytes
  in_temps = (peft_taco['temp'] - ours['temp']) / grad_bytes
  above_forward = (ours['peak'] - rows['forward']['peak']) / grad_bytes
  peft, ours = (np.asarray(rows[m]['losses']) for m in
                ('peft_taco', 'layerwise_taco'))
  rel = float(np.max(np.abs(ours - peft) / np.abs(peft)))
  lines = [
      '# tunix trainers: memory of PeftTrainer and LayerwisePeftTrainer', '',
      'Written by `python -m benchmarks.tunix_trainers`. '
      + provenance.stamp() + '.', '',
      f'tunix Qwen3, {rows["peft_taco"]["params"] / 1e6:.1f}M parameters '
      f'(float32, {SIZE["layers"]} layers, d={SIZE["dim"]}, vocab '
      f'{SIZE["vocab"]}, untied head), batch {BATCH} x {SEQ} tokens. '
      'Compiled figures are `memory_analysis()` of the train step as each '
      'trainer jits it; RSS is the process peak after '
      f'{RSS_STEP} steps (a fresh process each).', '',
      '| trainer | optimizer state MiB | compiled peak MiB | temporaries MiB '
      '| aliased MiB | peak RSS MiB |',
      '|---|---:|---:|---:|---:|---:|']
  for mode in ('forward',) + MODES + ACCUMULATING:
    row = rows[mode]
    lines.append(
        f'| {mode} | {"-" if mode == "forward" else _mib(row["state_bytes"])}'
        f' | {_mib(row["peak"])} | '
        f'{_mib(row["temp"])} | {_mib(row["alias"])} | '
        f'{_mib(row["rss"]) if row.get("rss") else "-"} |')
  lines += [
      '', f'Gradient bytes (float32, every parameter): {_mib(grad_bytes)} MiB. '
      f'The layer-wise trainer\'s compiled peak is {saved:.2f}x them below '
      'PeftTrainer + TACO\'s (target: at least 0.8x): '
      f'{in_temps:.2f}x in temporaries (the gradients, and the optax path\'s '
      'dense update) and the rest because it donates the parameters '
      '(updated in place; PeftTrainer donates only the optimizer state). '
      f'It is {above_forward:.2f}x the weights above the forward pass alone '
      '(`forward`: tunix\'s eval step).', '',
      f'`*_accum`: `gradient_accumulation_steps={ACCUMULATION}`, '
      f'micro-batches of {BATCH} (compiled only): PeftTrainer wraps TACO in '
      '`optax.MultiSteps` (a float32 gradient-sized accumulator in the state); '
      'the layer-wise trainer takes the group in one step, layer by layer.', '',
      'Losses of the first steps (PeftTrainer + TACO, then the layer-wise '
      'trainer): ' + ', '.join(f'{x:.6f}' for x in peft) + '; '
      + ', '.join(f'{x:.6f}' for x in ours) + f'. Largest relative '
      f'difference {rel:.2e} (target: within 2e-3).', '',
      f'gradient_bytes_saved={saved:.3f} in_temporaries={in_temps:.3f} '
      f'above_forward={above_forward:.3f} loss_max_rel={rel:.2e}']
  return '\n'.join(lines) + '\n'


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--measure', choices=MODES,
                      help='(internal) run one mode in this process')
  parser.add_argument('--out', help='write the markdown report here')
  args = parser.parse_args(argv)
  with tunix_models.tunix_flags():
    if args.measure:
      print(json.dumps(measured(args.measure)))
      return
    rows = {mode: compiled(mode) for mode in ('forward',) + ACCUMULATING}
    for mode in MODES:
      rows[mode] = compiled(mode) | in_subprocess(mode)
      print(mode, {k: v for k, v in rows[mode].items() if k != 'losses'},
            file=sys.stderr, flush=True)
  text = report(rows)
  if args.out:
    with open(args.out, 'w', encoding='utf-8') as f:
      f.write(text)
  print(text, end='')


if __name__ == '__main__':
  main()
