"""``python -m examples.finetune.export SOURCE --to DIR`` (or ``--gguf FILE``).

Writes the model of a run (its newest checkpoint), of one checkpoint
(``step_N``), or of a model file as a Hugging Face directory
(:func:`model.saving.save_pretrained`) or, for the Llama family, as a GGUF
file for llama.cpp (:func:`model.gguf_export.save_gguf`, ``--gguf-type``
f32, f16 or bf16). A run's own export (``OUTPUT_DIR/model``) is written at its
end by ``python -m examples.finetune``; this command is for checkpoints, runs
that had ``--no-export``, and GGUF. A refused input is one line, exit 2,
and nothing is written.
"""

import dataclasses
import sys
from typing import Annotated, Literal, Optional, Sequence

import tyro

from examples.finetune import flags as flags_lib
from examples.finetune import trained as trained_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import gguf_export
from examples.finetune.model import saving

PROG = 'python -m examples.finetune.export'


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """Export a fine-tuned model for use outside this example.

  Attributes:
    source: A run's output directory (its newest checkpoint), a checkpoint
      (OUTPUT_DIR/checkpoints/step_N), a model directory or a .gguf file.
    to: The Hugging Face directory to write (must not exist or be empty).
    gguf: The GGUF file to write instead (Llama family).
    gguf_type: The GGUF matrices' type.
  """
  source: tyro.conf.Positional[str]
  to: Optional[str] = None
  gguf: Optional[str] = None
  gguf_type: Annotated[Literal[gguf_export.GGUF_TYPES],
                       tyro.conf.arg(metavar='{f32,f16,bf16}')] = 'f32'


def export(config: ExportConfig) -> str:
  """Writes the export; returns its path.

  Raises:
    flags.FinetuneError: one line naming what is wrong.
  """
  if (config.to is None) == (config.gguf is None):
    raise flags_lib.FinetuneError('pass one of --to DIR and --gguf FILE')
  try:
    if config.to is not None:
      saving.check_target(config.to)
  except saving.ExportError as e:
    raise flags_lib.FinetuneError(str(e)) from e
  trained = trained_lib.load(config.source)
  try:
    if config.to is not None:
      return saving.save_pretrained(trained.model, trained.tokenizer,
                                    config.to, source=trained.source)
    template = (gguf_lib.chat_template(trained.source)
                if trained.source.endswith('.gguf') else None)
    return gguf_export.save_gguf(trained.model, trained.tokenizer,
                                 config.gguf, tensor_type=config.gguf_type,
                                 chat_template=template)
  except saving.ExportError as e:
    raise flags_lib.FinetuneError(str(e)) from e


def main(argv: Optional[Sequence[str]] = None) -> int:
  config = tyro.cli(ExportConfig, args=argv, prog=PROG)
  try:
    path = export(config)
  except flags_lib.FinetuneError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'exported to {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
