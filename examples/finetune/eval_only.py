"""``--eval-only``: the held-out metric of a model, a run or a checkpoint.

The model comes from :func:`trained.load` (a model directory, a ``.gguf``
file, a run's newest checkpoint, or one checkpoint) and is scored on the
task's held-out set exactly as a run scores it after its last step (same
``--eval-size`` subset, ``--seq-len``, batches), so the exported model of a
run, scored with the run's flags, gives the run's final figure. Nothing is
written.
"""

import os
from typing import Callable, Optional

from examples.finetune import data as data_lib
from examples.finetune import evaluation as evaluation_lib
from examples.finetune import flags as flags_lib
from examples.finetune import phases
from examples.finetune import precision as precision_lib
from examples.finetune import preparation
from examples.finetune import results as results_lib
from examples.finetune import tasks as tasks_lib
from examples.finetune import trained as trained_lib


def _run_results(path: Optional[str]) -> Optional[results_lib.RunResults]:
  """The ``results.json`` of the run ``path`` is or is inside, if any."""
  if path is None:
    return None
  for folder in (path, os.path.dirname(path),
                 os.path.dirname(os.path.dirname(os.path.abspath(path)))):
    found = results_lib.find(folder)
    if found is not None:
      return found
  return None


def run(config: flags_lib.RunConfig,
        log: Callable[[str], None] = phases.flushed_print) -> dict:
  """Scores ``config.model`` on the held-out set; returns the scores.

  Raises:
    flags.FinetuneError: an input that cannot be used, as one line.
  """
  try:
    task, _, held_out = preparation.load_task(config)
  except (data_lib.DataError, tasks_lib.TaskDataError) as e:
    raise flags_lib.FinetuneError(str(e)) from e
  precision = precision_lib.resolve(config.dtype, config.rounding,
                                    config.optimizer)
  with phases.phase('loading ' + (config.model or '(SmolLM2-135M GGUF)'),
                    log):
    trained = trained_lib.load(
        config.model, dtype=precision.compute_dtype.name,
        param_dtype=precision.param_dtype.name,
        scan_layers=config.scan_layers)
  eval_set = evaluation_lib.make_eval_set(task, held_out, trained.tokenizer)
  with phases.phase(f'evaluating {len(held_out)} {config.scored_set} '
                    'examples', log):
    scores = evaluation_lib.evaluate(
        trained.model, eval_set, trained.tokenizer, seq_len=config.seq_len,
        batch_size=config.eval_batch_size,
        max_new_tokens=config.max_new_tokens,
        stop_ids=preparation.stop_ids(trained.config, trained.tokenizer),
        track=phases.tracker('evaluate', config.progress))
  metric = task.headline_metric
  weights = (trained.checkpoint.path if trained.checkpoint is not None
             else trained.source)
  recorded = _run_results(config.model)
  return {'eval_only': True, 'model': weights, 'task': task.name,
          'metric': metric, 'scores': scores, 'held_out': len(held_out),
          'eval_split': config.eval_split,
          'run_after': None if recorded is None else recorded.after}
