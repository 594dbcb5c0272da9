"""The A/B fine-tuning loop: one model, one task, any ``--optimizer``.

:func:`run` reads as its three parts: :func:`preparation.prepare` checks
every input and builds the run before anything is written; :func:`train`
scores the held-out set, takes the steps (:mod:`trainers`: ``nnx.Optimizer``
+ a donated ``nnx.jit`` step, or TACO's layer-wise step), evaluates
periodically and saves checkpoints; :func:`results` gathers the
Table-4-style figures (metric before/after, persistent optimizer-state
bytes, peak memory, tokens/s, wall time) that go to ``results.json`` in
``output_dir``.
"""

import dataclasses
import math
import os
import time
from typing import Callable, NamedTuple, Optional, Union

from flax import nnx
import jax

from examples.finetune import compile_cache as compile_cache_lib
from examples.finetune import eval_only
from examples.finetune import evaluation as evaluation_lib
from examples.finetune import flags as flags_lib
from examples.finetune import host_memory
from examples.finetune import memory_plan
from examples.finetune import phases
from examples.finetune import precision as precision_lib
from examples.finetune import preparation
from examples.finetune import processes as processes_lib
from examples.finetune import report as report_lib
from examples.finetune import results as results_lib
from examples.finetune import resume as resume_lib
from examples.finetune import trainers as trainers_lib
from examples.finetune.model import saving
from examples.finetune.model import sharding as sharding_lib


class TrainingRecord(NamedTuple):
  """What training produced.

  Attributes:
    before: held-out scores before the first step (a resumed run's come
      from its checkpoint).
    after: held-out scores after the last step.
    evals: ``{'step': s, **scores}`` of each evaluation, the last included.
    losses: every step's training loss, the steps before a resume included.
    times: the steps' time and throughput.
    compile_seconds: time to compile the train step.
    compile_cache: what the persistent compilation cache answered for it
      (:class:`compile_cache.Lookup`).
    peak_memory: ``(bytes or None, where the figure comes from)``.
    mesh: the device mesh the run used, if any.
  """
  before: dict[str, float]
  after: dict[str, float]
  evals: list[dict[str, float]]
  losses: list[float]
  times: report_lib.StepTimes
  compile_seconds: float
  compile_cache: compile_cache_lib.Lookup
  peak_memory: tuple[Optional[int], str]
  mesh: Optional[jax.sharding.Mesh]


def run(config: flags_lib.RunConfig,
        log: Callable[[str], None] = phases.flushed_print
        ) -> Union[results_lib.RunResults, dict]:
  """Fine-tunes and evaluates; returns (and writes) the results.

  With ``--eval-only``: :func:`eval_only.run`'s scores, nothing written.

  Raises:
    flags.FinetuneError: an input the run cannot use, refused before
      anything is written; or a loss that became NaN or infinite, after the
      checkpoints saved so far (``results.json`` is not written).
    resume.Interrupted: SIGINT or SIGTERM stopped the run after a step.
  """
  started = time.perf_counter()
  if config.eval_only:
    return eval_only.run(config, log)
  prepared = preparation.prepare(config, log)
  record = train(prepared, log)
  exported = export(prepared, log)
  outcome = results(prepared, record, started, exported)
  if processes_lib.is_leader():
    report_lib.write_json_atomic(
        os.path.join(prepared.config.output_dir, results_lib.FILE_NAME),
        outcome.to_json())
  return outcome


def export(prepared: preparation.PreparedRun,
           log: Callable[[str], None]) -> Optional[str]:
  """Writes the trained model as a Hugging Face directory (process 0, after
  every process has gathered its arrays); its path, ``None`` with
  ``--no-export``."""
  target = preparation.export_dir(prepared.config)
  if target is None:
    return None
  # The run's own folder (no --export-dir) is replaced, as its checkpoints
  # are; another one was checked to be empty before training.
  replace = prepared.config.export_dir is None
  if replace and os.path.isdir(target) and os.listdir(target):
    log(f'{target} holds an earlier run\'s model: this run replaces it')
  with phases.phase(f'exporting the model to {target}', log):
    path = saving.save_pretrained(
        prepared.model, prepared.tokenizer, target,
        source=prepared.model_path, write=processes_lib.is_leader(),
        replace=replace)
  processes_lib.barrier('taco_export_done')
  return path


def _evaluate(prepared: preparation.PreparedRun,
              log: Callable[[str], None], *,
              bar: bool = True) -> dict[str, float]:
  """The held-out scores of the model as it is now.

  Args:
    prepared: the run.
    log: where the phase lines go.
    bar: show a progress bar (not during training: rich shows one live
      display at a time, and the training bar is one).
  """
  config = prepared.config
  with phases.phase(f'evaluating {len(prepared.held_out)} '
                    f'{config.scored_set} examples', log):
    return evaluation_lib.evaluate(
        prepared.model, prepared.eval_set, prepared.tokenizer,
        seq_len=config.seq_len, batch_size=config.eval_batch_size,
        max_new_tokens=config.max_new_tokens, stop_ids=prepared.stop_ids,
        track=phases.tracker('evaluate', config.progress and bar))


def _placed(batch, mesh: Optional[jax.sharding.Mesh]):
  """``batch`` split over the mesh's batch axes, if there is a mesh."""
  return sharding_lib.shard_batch(batch, mesh) if mesh else batch


def train(prepared: preparation.PreparedRun,
          log: Callable[[str], None]) -> TrainingRecord:
  """Scores the held-out set, trains to ``--steps`` and scores it again.

  Raises:
    flags.FinetuneError: the loss became NaN or infinite.
    resume.Interrupted: SIGINT or SIGTERM stopped the run after a step.
  """
  history = prepared.checkpoints.history
  metric = prepared.task.headline_metric
  before = history['before'] if 'before' in history else _evaluate(prepared,
                                                                    log)
  host_memory.release_free_memory()
  log(f'{prepared.config.scored_set} {metric} before: {before[metric]:.4f}'
      + (' (from the checkpoint)' if 'before' in history else ''))
  mesh = sharding_lib.current_mesh()
  if mesh:
    log(f'mesh {dict(mesh.shape)}: parameters sharded by '
        'examples/finetune/model/sharding.py, batch over data x fsdp')
  first = _placed(next(prepared.batches), mesh)
  began = time.perf_counter()
  lookups = compile_cache_lib.Lookups()
  with phases.phase('compiling the train step', log), lookups:
    compiled = prepared.trainer.compile(first)
  # Before the steps' buffers: what compiling freed (host_memory.py).
  host_memory.release_free_memory()
  compile_seconds = time.perf_counter() - began
  log('compilation cache: '
      + report_lib.compile_cache(lookups.result.as_json()))
  losses, evals, times = _steps(prepared, before, first, mesh, log)
  after = _evaluate(prepared, log)
  evals.append({'step': prepared.config.steps, **after})
  return TrainingRecord(
      before=before, after=after, evals=evals, losses=losses, times=times,
      compile_seconds=compile_seconds, compile_cache=lookups.result,
      peak_memory=trainers_lib.peak_memory(compiled), mesh=mesh)


def _steps(prepared: preparation.PreparedRun, before: dict[str, float],
           batch, mesh: Optional[jax.sharding.Mesh],
           log: Callable[[str], None]
           ) -> tuple[list[float], list[dict[str, float]],
                      report_lib.StepTimes]:
  """The training steps after ``start_step``, checkpoints saved as due.

  Args:
    prepared: the run.
    before: the held-out scores before training (kept in checkpoints).
    batch: the first step's batch, placed.
    mesh: the device mesh, if any.
    log: where the lines outside the progress bar go.

  Returns:
    ``(losses, evaluations, step times)``, those before a resume included.
  """
  config, checkpoints = prepared.config, prepared.checkpoints
  history = checkpoints.history
  losses = list(history.get('losses', []))
  evals = list(history.get('evals', []))
  times = report_lib.StepTimes(history.get('step_times'))
  metric = prepared.task.headline_metric
  progress = report_lib.Progress(config.steps, config.progress,
                                 done=prepared.start_step)
  saved = None
  with resume_lib.StopRequest() as stop:
    try:
      for step in range(prepared.start_step + 1, config.steps + 1):
        began = time.perf_counter()
        loss = float(prepared.trainer.step(batch))
        # Padding tokens are no work done: only real ones count.
        times.record(int(batch.attention_mask.sum()),
                     time.perf_counter() - began)
        losses.append(loss)
        if not math.isfinite(loss):
          raise flags_lib.FinetuneError(
              f'loss became {loss} at step {step}; lower --lr')
        # No throughput until a step past this process's first is timed.
        progress.advance(f'loss {loss:.4f}' + (
            f'  {times.tokens_per_second:.0f} tok/s' if times.steady_seconds
            else ''))
        if config.eval_every and step % config.eval_every == 0 and (
            step < config.steps):
          scores = _evaluate(prepared, progress.print, bar=False)
          evals.append({'step': step, **scores})
          progress.print(
              f'step {step}: {config.scored_set} {metric} '
              f'{scores[metric]:.4f}')
        stop.pause_for_test(step)
        stop.agree()
        if stop.signal_number or step == config.steps or checkpoints.due(
            step):
          saved = _save(prepared, step, progress, {
              'before': before, 'losses': losses, 'evals': evals,
              'step_times': times.totals(), **_landed_totals(prepared)})
        if stop.signal_number:
          break
        if step < config.steps:
          batch = _placed(next(prepared.batches), mesh)
    finally:
      progress.close()
  if stop.signal_number:
    where = (f'checkpoint saved to {saved}' if saved
             else 'no checkpoint (--no-checkpoint)')
    log(f'interrupted at step {step}/{config.steps}; {where}'
        + ('; resume with --resume' if saved and step < config.steps else ''))
    raise resume_lib.Interrupted(stop.exit_code)
  return losses, evals, times


def _landed_totals(prepared: preparation.PreparedRun) -> dict:
  """``{'landed': totals}`` for a checkpoint of a measured run, else ``{}``.
  """
  measurement = prepared.trainer.measurement
  return {} if measurement is None else {
      'landed': measurement.counts.totals()}


def _save(prepared: preparation.PreparedRun, step: int,
          progress: report_lib.Progress, history: dict) -> Optional[str]:
  """Checkpoints ``step`` with ``history``; its path (``None``: disabled)."""
  if not prepared.config.save_checkpoint:
    return None
  progress.print(f'step {step}: saving a checkpoint ...')
  began = time.perf_counter()
  path = prepared.checkpoints.save(
      step, prepared.trainer.checkpoint_tree(),
      {**history, 'jax': jax.__version__, 'backend': jax.default_backend()})
  progress.print(f'step {step}: checkpoint saved to {path} '
                 f'({time.perf_counter() - began:.1f} s)')
  return path


def results(prepared: preparation.PreparedRun, record: TrainingRecord,
            started: float,
            exported_to: Optional[str] = None) -> results_lib.RunResults:
  """The run's ``results.json``: a :class:`results.RunResults`.

  Args:
    prepared: the run.
    record: what training produced.
    started: ``time.perf_counter()`` when the run began.
    exported_to: where the model was exported (``None``: not exported).
  """
  config, model_config = prepared.config, prepared.model_config
  peak, peak_source = record.peak_memory
  measurement = prepared.trainer.measurement
  memory = report_lib.process_memory()
  return results_lib.RunResults(
      optimizer=config.optimizer,
      learning_rate=prepared.learning_rate,
      learning_rate_source=prepared.learning_rate_source,
      warmup_steps=prepared.warmup_steps,
      model=prepared.model_path,
      family=model_config.family,
      task=prepared.task.name,
      metric=prepared.task.headline_metric,
      before=record.before,
      after=record.after,
      evals=record.evals,
      losses=record.losses,
      optimizer_state_bytes=prepared.trainer.optimizer_state_bytes(),
      parameter_bytes=memory_plan.tree_bytes(
          nnx.state(prepared.model, nnx.Param)),
      rounding=prepared.precision.rounding,
      compute_dtype=prepared.precision.compute_dtype.name,
      parameter_dtype=prepared.precision.param_dtype.name,
      master_weight_bytes=results_lib.MasterWeightBytes(
          *prepared.master_cost),
      updates_16bit=precision_lib.describe(prepared.precision,
                                           *prepared.master_cost),
      landed_updates=(None if measurement is None
                      else measurement.counts.shares()),
      peak_memory_bytes=peak,
      peak_memory_source=peak_source,
      # The whole process (loading, compiling, running), as `top` sees it;
      # process 0's in a multi-process run, with every process's peak.
      process_peak_rss_bytes=memory['process_peak_rss_bytes'],
      device_peak_bytes_in_use=memory['device_peak_bytes_in_use'],
      process_peak_rss_bytes_per_process=processes_lib.per_process(
          memory['process_peak_rss_bytes']),
      tokens_per_second=record.times.tokens_per_second,
      train_seconds=record.times.train_seconds,
      compile_seconds=record.compile_seconds,
      compilation_cache=record.compile_cache.as_json(),
      wall_seconds=time.perf_counter() - started,
      step_path=prepared.trainer.path,
      mesh=dict(record.mesh.shape) if record.mesh else None,
      process_count=jax.process_count(),
      objective=prepared.objective,
      resumed_from_step=prepared.start_step,
      backend=jax.default_backend(),
      eval_split=config.eval_split,
      config=dataclasses.asdict(config),
      exported_to=exported_to)
