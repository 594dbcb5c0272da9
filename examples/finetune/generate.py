"""``python -m examples.finetune.generate MODEL --prompt TEXT``: greedy text.

``MODEL`` is what :func:`trained.load` takes: a model directory or ``.gguf``
file (an export included), a run's output directory or a checkpoint. The
continuation is greedy (the most likely token each step, as the held-out
evaluation of SQuAD/DROP decodes), ``--max-new-tokens`` long at most,
stopped by the end-of-sequence token.
"""

import dataclasses
import sys
from typing import Annotated, Optional, Sequence

from flax import nnx
import jax.numpy as jnp
import numpy as np
import tyro

from examples.finetune import flags as flags_lib
from examples.finetune import trained as trained_lib
from examples.finetune.flag_words import Range

PROG = 'python -m examples.finetune.generate'


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
  """Greedy continuation of a prompt by a fine-tuned model.

  Attributes:
    model: A model directory or .gguf file, a run's output directory or a
      checkpoint (step_N).
    prompt: The text to continue.
    max_new_tokens: Tokens generated at most.
  """
  model: tyro.conf.Positional[str]
  prompt: str
  max_new_tokens: Annotated[int, Range(low=1)] = 32


@nnx.jit
def _next_token(model, ids, length):
  mask = jnp.arange(ids.shape[1])[None] < length
  logits = model(ids, mask)
  return jnp.argmax(logits[0, length - 1])


def greedy(model, tokenizer, prompt: str, max_new_tokens: int,
           eos_token_id: Optional[int] = None) -> str:
  """The greedy continuation of ``prompt`` (the new text only).

  One fixed ``[1, len(prompt) + max_new_tokens]`` buffer, so one compile.
  """
  prompt_ids = tokenizer.encode(prompt).ids
  ids = np.zeros((1, len(prompt_ids) + max_new_tokens), np.int32)
  ids[0, :len(prompt_ids)] = prompt_ids
  length = len(prompt_ids)
  model.eval()
  for _ in range(max_new_tokens):
    token = int(_next_token(model, jnp.asarray(ids), jnp.int32(length)))
    if token == eos_token_id:
      break
    ids[0, length] = token
    length += 1
  return tokenizer.decode(ids[0, len(prompt_ids):length].tolist())


def main(argv: Optional[Sequence[str]] = None) -> int:
  config = tyro.cli(GenerateConfig, args=argv, prog=PROG)
  try:
    if config.max_new_tokens < 1:
      raise flags_lib.FinetuneError('--max-new-tokens must be at least 1')
    trained = trained_lib.load(config.model)
  except flags_lib.FinetuneError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  text = greedy(trained.model, trained.tokenizer, config.prompt,
                config.max_new_tokens, trained.config.eos_token_id)
  print(config.prompt + text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
