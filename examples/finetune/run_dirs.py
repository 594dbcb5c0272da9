"""One directory per run, so that an A/B run never overwrites the other.

Without ``--output-dir`` a run writes to ``runs/finetune/OPTIMIZER-TASK-
YYYYMMDD-HHMMSS`` (``-2``, ``-3``, ... when that name is taken), and
``--resume`` continues the newest such directory that holds checkpoints.
``python -m examples.finetune.compare runs/finetune/*`` shows them side by
side.
"""

import dataclasses
import datetime
import glob
import os
from typing import Optional

from examples.finetune import flags as flags_lib
from examples.finetune import processes as processes_lib
from examples.finetune import resume as resume_lib

RUNS_ROOT = os.path.join('runs', 'finetune')


def new_run_dir(optimizer: str, task: str, root: str = RUNS_ROOT,
                now: Optional[datetime.datetime] = None) -> str:
  """A directory name under ``root`` that no earlier run has used."""
  stamp = (now or datetime.datetime.now()).strftime('%Y%m%d-%H%M%S')
  base = os.path.join(root, f'{optimizer}-{task}-{stamp}')
  path, counter = base, 1
  while os.path.exists(path):
    counter += 1
    path = f'{base}-{counter}'
  return path


def latest_run_dir(optimizer: str, task: str,
                   root: str = RUNS_ROOT) -> Optional[str]:
  """The newest ``root/OPTIMIZER-TASK-*`` with a checkpoints folder."""
  pattern = os.path.join(glob.escape(root), f'{optimizer}-{task}-*')
  runs = [path for path in glob.glob(pattern) if os.path.isdir(
      os.path.join(path, resume_lib.CHECKPOINT_DIR))]
  if not runs:
    return None
  return max(runs, key=lambda path: os.path.getmtime(
      os.path.join(path, resume_lib.CHECKPOINT_DIR)))


def with_output_dir(
    config: flags_lib.RunConfig) -> flags_lib.RunConfig:
  """``config`` with ``output_dir`` resolved; nothing is created here.

  Raises:
    FinetuneError: ``--resume`` without ``--output-dir`` and no earlier run
      of this optimizer and task to continue.
  """
  if config.output_dir is not None:
    return config
  if config.resume:
    path = latest_run_dir(config.optimizer, config.task)
    if path is None:
      raise flags_lib.FinetuneError(
          f'--resume: no checkpointed run in {RUNS_ROOT}/{config.optimizer}-'
          f'{config.task}-*; pass --output-dir DIR of the run to continue')
  else:
    path = new_run_dir(config.optimizer, config.task)
  # Processes started a second apart would name different directories.
  path = processes_lib.same_on_every_process(path)
  return dataclasses.replace(config, output_dir=path)
