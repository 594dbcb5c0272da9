"""Checkpoints and resume for ``loop.run``: the command line's side.

:mod:`checkpoint` writes, verifies and reads the checkpoints; this module
decides what goes into them and what a resume must match. The run's settings
are its :class:`flags.RunConfig` fields named as flags (``--taco-k``),
so a refusal names the flag, plus what the defaults resolve to (learning
rate, warm-up, dtypes and how 16-bit updates land, model file, a digest of
the training data). The batch order is a function of those settings, so it
continues exactly.
:class:`StopRequest` turns SIGINT/SIGTERM into a stop after the current step,
so that a run saves and exits instead of dying mid-step.
"""

import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Optional

import jax
import numpy as np

from examples.finetune import checkpoint as checkpoint_lib
from examples.finetune import flags as flags_lib
from examples.finetune import processes as processes_lib

CHECKPOINT_DIR = 'checkpoints'
# Fields that leave what the run computes unchanged: a resume may change them.
_FREE_FIELDS = frozenset({
    'eval_every', 'eval_batch_size', 'memory_limit_gb', 'output_dir',
    'resume', 'resume_allow_changes', 'save_checkpoint', 'checkpoint_every',
    'progress', 'coordinator_address', 'num_processes', 'process_id',
    'initialization_timeout', 'compilation_cache', 'compilation_cache_dir',
    'export', 'export_dir', 'eval_only'})


class Interrupted(SystemExit):
  """SIGINT or SIGTERM stopped the run after a step, its checkpoint saved.

  A ``SystemExit`` with the shell's code for the signal (130 for Ctrl-C), so
  ``python -m examples.finetune`` exits with it, without a traceback.
  """


def checkpoint_dir(output_dir: str) -> str:
  return os.path.join(os.path.abspath(output_dir), CHECKPOINT_DIR)


def open_checkpoints(config: flags_lib.RunConfig,
                     log) -> checkpoint_lib.RunCheckpoints:
  """The run's checkpoints; with ``--resume``, the newest, settings checked.

  Runs before the model loads: a resume with another flag is refused in
  seconds. The flags are stored by name, so the refusal names the flag.
  """
  settings = {flags_lib.flag(field.name): getattr(config, field.name)
              for field in dataclasses.fields(config)
              if field.name not in _FREE_FIELDS}
  directory = checkpoint_dir(config.output_dir)
  try:
    checkpoints = checkpoint_lib.RunCheckpoints(
        directory, settings, resume=config.resume,
        allow_changes=config.resume_allow_changes,
        every=config.checkpoint_every, log=log)
  except checkpoint_lib.CheckpointError as e:
    raise flags_lib.FinetuneError(f'--resume: {e}') from e
  resumed = checkpoints.resumed_from
  if resumed is not None and resumed.format != checkpoint_lib.FORMAT:
    raise flags_lib.FinetuneError(
        f'--resume: {resumed.path} has format {resumed.format} (parameters '
        'by position), which cannot resume; export its model with python -m '
        'examples.finetune.export RUN --to DIR and start a run with --model '
        'DIR')
  if config.resume and checkpoints.start_step >= config.steps:
    raise flags_lib.FinetuneError(
        f'--resume: the checkpoint is at step {checkpoints.start_step} of '
        f'--steps {config.steps}, which counts the steps before the resume: '
        'nothing left to train (to train longer, raise --steps and add '
        '--resume-allow-changes)')
  if not config.resume and checkpoint_lib.complete_steps(directory):
    log(f'{directory} holds an earlier run\'s checkpoints: this run replaces '
        'them at its first save (--resume continues them instead)')
  return checkpoints


def check_resolved(checkpoints: checkpoint_lib.RunCheckpoints, **settings):
  """Checks what the flags leave open (defaults, files, data) on resume."""
  try:
    checkpoints.check(settings)
  except checkpoint_lib.CheckpointError as e:
    raise flags_lib.FinetuneError(f'--resume: {e}') from e


def data_digest(train_tokens) -> str:
  """Names the tokenised training examples (their order included)."""
  text = json.dumps(train_tokens, default=lambda x: np.asarray(x).tolist())
  digest = hashlib.sha256(text.encode()).hexdigest()
  return f'{len(train_tokens)} examples, sha256 {digest[:16]}'


def restore(checkpoints: checkpoint_lib.RunCheckpoints, trainer, batches,
            log) -> int:
  """Loads the resumed checkpoint into ``trainer``; returns its step.

  ``batches`` moves on past the batches of the steps done: the stream is a
  function of the training data, ``--seed`` and ``--batch-size`` (all
  checked), and step ``s`` trains on its ``s``-th batch.
  """
  if checkpoints.resumed_from is None:
    # Committed to its devices, as a restored state is, so that a fresh run
    # and a resumed one compile one train step and share its entry in the
    # compilation cache (an array's commitment is part of the program).
    trainer.load_checkpoint_tree(_committed(trainer.checkpoint_tree()))
    return 0
  try:
    trainer.load_checkpoint_tree(
        checkpoints.restore(trainer.checkpoint_tree()))
  except checkpoint_lib.CheckpointError as e:
    raise flags_lib.FinetuneError(f'--resume: {e}') from e
  step = checkpoints.start_step
  if trainer.step_count != step:
    raise flags_lib.FinetuneError(
        f'--resume: {checkpoints.resumed_from.path} is named step {step} but '
        f'holds the state of step {trainer.step_count}')
  for _ in range(step):
    next(batches)
  log(f'resumed from step {step} ({checkpoints.resumed_from.path})')
  return step


def _committed(tree):
  """``tree`` with its arrays committed to the devices they are on (no copy).
  """
  return jax.tree.map(
      lambda x: (jax.device_put(x, x.sharding)
                 if isinstance(x, jax.Array) and not x.committed else x),
      tree)


# Stopping at a step boundary.

# Tests set this to a step number: after that step the run waits (up to a
# minute) for the signal the test then sends, so the signal lands at a known
# step however fast the steps are.
PAUSE_AFTER_STEP_ENV = 'TACO_FINETUNE_TEST_PAUSE_AFTER_STEP'


class StopRequest:
  """SIGINT and SIGTERM, caught, as a request to stop after the current step.

  Used as a context manager around a training loop (in the main thread; in
  any other thread it does nothing). The first signal is recorded in
  :attr:`signal_number` and the default handlers come back, so a second
  Ctrl-C stops at once; leaving the context restores the handlers.
  """
  _SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.signal_number: Optional[int] = None
    self._previous = {}

  def _handle(self, number, frame):
    del frame
    self.signal_number = number
    for number_, handler in self._previous.items():
      signal.signal(number_, handler)

  def __enter__(self) -> 'StopRequest':
    if threading.current_thread() is threading.main_thread():
      self._previous = {n: signal.getsignal(n) for n in self._SIGNALS}
      for number in self._SIGNALS:
        signal.signal(number, self._handle)
    return self

  def __exit__(self, *exc_info):
    for number, handler in self._previous.items():
      signal.signal(number, handler)
    self._previous = {}

  def agree(self) -> None:
    """Takes the signal another process got, if any (a collective: every
    process calls it after each step), so that all stop after the same step
    instead of one saving while another waits in the next step."""
    caught = [n for n in processes_lib.per_process(self.signal_number or 0)
              if n]
    if caught and self.signal_number is None:
      self.signal_number = caught[0]

  @property
  def exit_code(self) -> int:
    """The shell's code for death by the signal: 130 for SIGINT."""
    return 128 + int(self.signal_number or 0)

  @property
  def name(self) -> str:
    return signal.Signals(self.signal_number).name

  def pause_for_test(self, step: int) -> None:
    """Waits for a signal after the step that ``PAUSE_AFTER_STEP_ENV`` names.
    """
    if os.environ.get(PAUSE_AFTER_STEP_ENV) != str(step):
      return
    # The real stderr: a process other than 0 prints nothing else.
    print(f'paused after step {step} for a test: waiting for a signal',
          file=sys.__stderr__, flush=True)
    deadline = time.monotonic() + 60
    while self.signal_number is None and time.monotonic() < deadline:
      time.sleep(0.01)
