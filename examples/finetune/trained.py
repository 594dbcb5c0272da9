"""A fine-tuned model from wherever it is: a model, a run or a checkpoint.

:func:`load` takes what ``--eval-only``, ``examples.finetune.export`` and
``examples.finetune.generate`` accept: a Hugging Face model directory or a
``.gguf`` file (read by :mod:`model.loading`), a run's output directory (its
newest checkpoint) or one checkpoint's ``step_N`` directory. A checkpoint's
model is built from the model file and dtypes stored in its settings, then
its parameters are put in by module path; a checkpoint whose parameters are
not that model's is refused by name.
"""

import os
from typing import Any, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from examples.finetune import checkpoint as checkpoint_lib
from examples.finetune import flags as flags_lib
from examples.finetune import preparation
from examples.finetune import resume as resume_lib
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib


class Trained(NamedTuple):
  """A model ready to use.

  Attributes:
    model: the model.
    tokenizer: its tokenizer.
    config: its architecture.
    source: the model file or directory its architecture (and, without a
      checkpoint, its weights) came from.
    checkpoint: the checkpoint its weights came from, if any.
  """
  model: decoder_lib.DecoderLM
  tokenizer: tokenizers.Tokenizer
  config: config_lib.ModelConfig
  source: str
  checkpoint: Optional[checkpoint_lib.Checkpoint]


def find_checkpoint(path: str) -> Optional[checkpoint_lib.Checkpoint]:
  """The checkpoint ``path`` names (a ``step_N`` folder, or a run's newest
  one); ``None`` when ``path`` is neither.

  Raises:
    flags.FinetuneError: a run folder without a complete checkpoint, or a
      corrupt one.
  """
  try:
    if checkpoint_lib.is_checkpoint(path):
      return checkpoint_lib.read(path)
    directory = resume_lib.checkpoint_dir(path)
    if os.path.isdir(directory) or os.path.isfile(
        os.path.join(path, 'results.json')):
      found = checkpoint_lib.latest(directory)
      if found is None:
        raise flags_lib.FinetuneError(
            f'{path} is a run without checkpoints (it ran with '
            '--no-checkpoint, or was stopped before its first save); export '
            'at the end of a run instead')
      return found
  except checkpoint_lib.CheckpointError as e:
    raise flags_lib.FinetuneError(str(e)) from e
  return None


def put_params(model: decoder_lib.DecoderLM, named: Any, where: str) -> None:
  """Sets every parameter of ``model`` from ``named`` (nested by module path,
  dictionary keys as ``int`` or ``str``), checking names and shapes."""
  state = nnx.state(model, nnx.Param)

  def fill(path, current):
    names = decoder_lib.path_names(path)
    node = named
    for name in names:
      if isinstance(node, dict):
        node = node.get(name, node.get(int(name)) if name.isdigit() else None)
      elif isinstance(node, (list, tuple)) and name.isdigit():
        node = node[int(name)] if int(name) < len(node) else None
      else:
        node = None
      if node is None:
        raise flags_lib.FinetuneError(
            f'{where} has no parameter {"/".join(names)}: it is not a '
            f'checkpoint of this {model.config.family} model')
    if tuple(node.shape) != tuple(current.shape):
      raise flags_lib.FinetuneError(
          f'{where} holds {"/".join(names)} of shape {tuple(node.shape)}, '
          f'the model {tuple(current.shape)}: a checkpoint of another model')
    return jnp.asarray(node, current.dtype)

  leaves, treedef = jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(state))
  values = [fill(path, leaf) for path, leaf in leaves]
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef,
                                                               values))
  nnx.update(model, state)


def _settings_model(checkpoint: checkpoint_lib.Checkpoint) -> str:
  path = checkpoint.metadata.get('model file')
  if not path or not os.path.exists(path):
    raise flags_lib.FinetuneError(
        f'{checkpoint.path} was trained from {path!r}, which is missing: '
        'its architecture and tokenizer come from that file')
  return path


def load(path: Optional[str], *, dtype: Any = None, param_dtype: Any = None,
         scan_layers: bool = False) -> Trained:
  """The model at ``path`` (``None``: SmolLM2-135M).

  Args:
    path: a model directory or ``.gguf`` file, a run directory or a
      checkpoint directory.
    dtype: computation dtype of a model file (``None``: float32); a
      checkpoint's model uses its run's.
    param_dtype: the parameters' dtype of a model file (``None``:
      ``dtype``); a checkpoint's model uses its run's.
    scan_layers: stack the blocks of a model file; a checkpoint's model
      is laid out as its run's (as its arrays are).

  Raises:
    flags.FinetuneError: one line naming what is wrong.
  """
  checkpoint = None if path is None else find_checkpoint(path)
  if checkpoint is None:
    model, tokenizer, config, source = preparation.load_model(
        path, dtype=dtype or 'float32', param_dtype=param_dtype, remat=False,
        scan_layers=bool(scan_layers))
    return Trained(model, tokenizer, config, source, None)
  settings = checkpoint.metadata
  model, tokenizer, config, source = preparation.load_model(
      _settings_model(checkpoint),
      dtype=settings.get('compute dtype') or dtype or 'float32',
      param_dtype=settings.get('parameter dtype') or param_dtype,
      remat=False,
      scan_layers=bool(settings.get('--scan-layers', False)))
  try:
    tree = checkpoint_lib.restore(checkpoint)
  except checkpoint_lib.CheckpointError as e:
    raise flags_lib.FinetuneError(str(e)) from e
  named = checkpoint_lib.named_params(checkpoint, tree)
  put_params(model, jax.tree.map(np.asarray, named), checkpoint.path)
  return Trained(model, tokenizer, config, source, checkpoint)
