"""The A/B fine-tuning loop: one model, one task, any ``--optimizer``.

``run(flags.RunConfig(...))`` loads the model and data, checks every
input before anything is written, scores the held-out set, trains with
``nnx.Optimizer`` + ``nnx.jit`` (model and optimizer donated), evaluates
periodically, and writes ``results.json`` (Table-4-style figures: metric
before/after, persistent optimizer-state bytes, peak memory, tokens/s, wall
time) into ``output_dir``. The pieces live beside it: ``losses``,
``evaluation``, ``trainers``, ``memory_plan`` and ``report``.
"""

import dataclasses
import math
import os
import time
from typing import Callable, Optional

from flax import nnx
import jax
import jax.numpy as jnp

from examples.finetune import data as data_lib
from examples.finetune import evaluation as evaluation_lib
from examples.finetune import flags as flags_lib
from examples.finetune import memory_plan
from examples.finetune import optimizers as optimizers_lib
from examples.finetune import phases
from examples.finetune import report as report_lib
from examples.finetune import resume as resume_lib
from examples.finetune import run_dirs
from examples.finetune import tasks as tasks_lib
from examples.finetune import trainers as trainers_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import loading
from examples.finetune.model import sharding as sharding_lib
from examples.finetune.model import weights as weights_lib

# The run.


def _dtype(name: str):
  if name == 'auto':
    # CPUs upcast bf16 matmuls (slower, no memory gain in the temporaries).
    return jnp.float32 if jax.default_backend() == 'cpu' else jnp.bfloat16
  return jnp.dtype(name)


def load_model(path: Optional[str], *, dtype: str, remat: bool,
               remat_policy: str = 'nothing_saveable',
               scan_layers: bool = False):
  """``(model, tokenizer, model_config, path)``; bad inputs -> FinetuneError.

  Args:
    path: a Hugging Face directory or ``.gguf`` file; ``None``: SmolLM2-135M.
    dtype: ``'auto'``, ``'float32'`` or ``'bfloat16'`` (``RunConfig.dtype``).
    remat: recompute each block in the backward pass.
    remat_policy: what a rematerialised block keeps.
    scan_layers: stack the blocks for ``lax.scan``.
  """
  try:
    if path is None:
      path = gguf_lib.smollm2_gguf_path()
    model, tokenizer, model_config = loading.load_pretrained(
        path, dtype=_dtype(dtype), remat='block' if remat else None,
        remat_policy=remat_policy, scan_layers=scan_layers)
  except weights_lib.ModelLoadError as e:
    raise flags_lib.FinetuneError(str(e)) from e
  return model, tokenizer, model_config, path


def load_task(config: flags_lib.RunConfig):
  """``(task, train examples, held-out examples)`` for the configured task."""
  if config.task == 'tweets':
    if config.train_file or config.test_file:
      raise flags_lib.FinetuneError(
          '--train-file/--test-file need --task (e.g. text, sst2); the '
          'default task uses the embedded tweets')
    task = data_lib.tweets_task()
    train, test = data_lib.split_tweets(data_lib.read_tweets(),
                                        data_lib.TWEETS_TEST_PER_CLASS)
    return (task, [task.example(r) for r in train],
            data_lib.balanced_subset([task.example(r) for r in test],
                                     config.eval_size))
  if config.task == 'text':
    if not config.label_words:
      raise flags_lib.FinetuneError(
          '--task text needs --label-words, e.g. '
          '"negative=terrible,positive=great"')
    try:
      task = tasks_lib.text_classification(
          tasks_lib.parse_label_words(config.label_words), config.template)
    except ValueError as e:
      raise flags_lib.FinetuneError(str(e)) from e
  else:
    task = tasks_lib.TASKS[config.task]
  if not config.train_file or not config.test_file:
    raise flags_lib.FinetuneError(
        f'--task {config.task} needs --train-file and --test-file (JSONL in '
        'the Hugging Face field layout)')
  train = data_lib.load_examples(task, config.train_file)
  test = data_lib.load_examples(task, config.test_file)
  return task, train, data_lib.balanced_subset(test, config.eval_size)


def _check_memory(config: flags_lib.RunConfig, model, schedule,
                  hints) -> None:
  """Refuses a run whose predicted peak exceeds the device's memory.

  The limit is ``config.memory_limit_gb``, else the device's own
  (``bytes_limit``; CPUs report none, so nothing is checked there), times the
  devices of an active mesh (the plan is unsharded: a run over this is sure
  not to fit). The prediction is :mod:`memory_plan`'s, with this optimizer's
  exact state size.
  """
  limit = (memory_plan.device_memory_limit() if config.memory_limit_gb is None
           else config.memory_limit_gb * memory_plan.GB)
  if limit is None:
    return
  mesh = jax.sharding.get_abstract_mesh()
  devices = 1 if mesh.empty else mesh.size
  limit *= devices
  params = memory_plan.model_params(model)
  tx = optimizers_lib.get(config.optimizer).build(schedule, hints, config.taco)
  state_bytes = memory_plan.tree_bytes(
      jax.eval_shape(tx.init, nnx.state(model, nnx.Param)))
  layerwise = trainers_lib.uses_layerwise_step(config)
  peak_of = lambda batch: memory_plan.model_peak(
      model, params, state_bytes, batch=batch, seq=config.seq_len,
      layerwise=layerwise)
  peak = peak_of(config.batch_size)
  if peak <= limit:
    return
  fitting = [b for b in range(config.batch_size - 1, 0, -1)
             if peak_of(b) <= limit]
  advice = [f'--batch-size {fitting[0]}'] if fitting else []
  advice += [] if config.remat else ['--remat on']
  if config.optimizer != 'taco':
    advice.append('--optimizer taco')
  elif not layerwise:
    advice.append('--taco-step auto')
  advice = ' or '.join(advice) or 'a device with more memory'
  gb = lambda n: f'{n / memory_plan.GB:.3g} GB'
  holder = 'device has' if devices == 1 else f'{devices} devices have'
  raise flags_lib.FinetuneError(
      f'--optimizer {config.optimizer} at --batch-size {config.batch_size} '
      f'x --seq-len {config.seq_len} needs about {gb(peak)} (predicted), the '
      f'{holder} {gb(limit)}; try {advice}')


def _training_tokens(objective: str, task, examples, tokenizer):
  """``(tokenised examples, collate function, objective's name)``."""
  if objective in ('auto', 'candidates') and not task.generative:
    choices = data_lib.choice_examples(tokenizer, examples)
    if choices is not None:
      return choices, data_lib.collate_choices, 'candidate cross-entropy'
    if objective == 'candidates':
      raise flags_lib.FinetuneError(
          '--objective candidates needs single-token candidates')
  elif objective == 'candidates':
    raise flags_lib.FinetuneError(
        '--objective candidates needs a classification task')
  return ([data_lib.tokenize(tokenizer, e.prompt, e.target) for e in examples],
          data_lib.collate, 'completion likelihood')


def run(config: flags_lib.RunConfig,
        log: Callable[[str], None] = phases.flushed_print) -> dict:
  """Fine-tunes and evaluates; returns (and writes) the results.

  Every input is checked before ``output_dir`` is touched; without one, the
  run gets a new directory (:func:`run_dirs.with_output_dir`).
  """
  wall_start = time.perf_counter()
  config = run_dirs.with_output_dir(config)
  checkpoints = resume_lib.open_checkpoints(config, log)
  spec = optimizers_lib.get(config.optimizer)
  try:
    task, train_examples, test_examples = load_task(config)
  except (data_lib.DataError, tasks_lib.TaskDataError) as e:
    raise flags_lib.FinetuneError(str(e)) from e
  with phases.phase('loading the model '
                    + (config.model or '(SmolLM2-135M GGUF)'), log):
    model, tokenizer, model_config, model_path = load_model(
        config.model, dtype=config.dtype, remat=config.remat,
        remat_policy=config.remat_policy, scan_layers=config.scan_layers)
  if config.seq_len > model_config.max_position_embeddings:
    raise flags_lib.FinetuneError(
        f'--seq-len {config.seq_len} exceeds the model\'s '
        f'{model_config.max_position_embeddings} positions')
  if task.generative and config.max_new_tokens >= config.seq_len:
    raise flags_lib.FinetuneError(
        '--max-new-tokens must be below --seq-len')

  with phases.phase(f'tokenising {len(train_examples)} training and '
                    f'{len(test_examples)} held-out examples', log):
    train_tokens, collate_fn, objective = _training_tokens(
        config.objective, task, train_examples, tokenizer)
    eval_set = evaluation_lib.make_eval_set(task, test_examples, tokenizer)
  pad_id = model_config.pad_token_id or 0
  batches = data_lib.training_batches(train_tokens, config.batch_size,
                                      config.seq_len, config.seed, pad_id,
                                      collate_fn)
  stop_ids = [i for i in (model_config.eos_token_id,) if i is not None]
  stop_ids += tokenizer.encode('\n', add_special_tokens=False).ids[:1]

  lr, lr_source = config.lr, '--lr'
  if lr is None:
    lr, lr_source = spec.default_rate(config.steps)
  warmup = (config.warmup_steps if config.warmup_steps is not None
            else min(50, config.steps // 10))
  schedule = optimizers_lib.linear_schedule(lr, config.steps, warmup)
  resume_lib.check_resolved(checkpoints, **{
      'learning rate': lr, 'warm-up steps': warmup,
      'parameter dtype': jnp.dtype(_dtype(config.dtype)).name,
      'model file': os.path.abspath(model_path),
      'training data': resume_lib.data_digest(train_tokens)})
  hints = optimizers_lib.decoder_hints(model_config)
  _check_memory(config, model, schedule, hints)
  with phases.phase(f'setting up {config.optimizer}', log):
    trainer = trainers_lib.make_trainer(config, model, schedule, hints)
    start_step = resume_lib.restore(checkpoints, trainer, batches, log)
  step_path = trainer.path
  log(f'run directory {config.output_dir}')
  log(f'model {model_path} ({model_config.family}, '
      f'{len(train_tokens)} train / {len(test_examples)} held-out examples)')
  log(f'optimizer {config.optimizer}: lr {lr:g} ({lr_source}), '
      f'warm-up {warmup}, '
      f'{config.steps} steps x batch {config.batch_size} x {config.seq_len} '
      f'tokens, {objective}; step path: {step_path}')

  metric = task.headline_metric

  def evaluate(bar: bool = True) -> dict:
    # No bar beside the training bar: rich shows one live display at a time.
    with phases.phase(f'evaluating {len(test_examples)} held-out examples',
                      log if bar else progress.print):
      return evaluation_lib.evaluate(
          model, eval_set, tokenizer, seq_len=config.seq_len,
          batch_size=config.eval_batch_size,
          max_new_tokens=config.max_new_tokens, stop_ids=stop_ids,
          track=phases.tracker('evaluate', config.progress and bar))

  history = checkpoints.history
  before = history['before'] if 'before' in history else evaluate()
  log(f'held-out {metric} before: {before[metric]:.4f}'
      + (' (from the checkpoint)' if 'before' in history else ''))

  mesh = sharding_lib.current_mesh()
  place = (lambda b: sharding_lib.shard_batch(b, mesh)) if mesh else (
      lambda b: b)
  if mesh:
    log(f'mesh {dict(mesh.shape)}: parameters sharded by '
        'examples/finetune/model/sharding.py, batch over data x fsdp')
  first = place(next(batches))
  compile_start = time.perf_counter()
  with phases.phase('compiling the train step', log):
    compiled = trainer.compile(first)
  compile_seconds = time.perf_counter() - compile_start

  progress = report_lib.Progress(config.steps, config.progress,
                                 done=start_step)
  losses, evals = history.get('losses', []), history.get('evals', [])
  tokens = history.get('tokens', 0)
  train_seconds = history.get('train_seconds', 0.0)

  def save(step: int) -> Optional[str]:
    if not config.save_checkpoint:
      return None
    progress.print(f'step {step}: saving a checkpoint ...')
    began = time.perf_counter()
    path = checkpoints.save(step, trainer.checkpoint_tree(), {
        'before': before, 'losses': losses, 'evals': evals, 'tokens': tokens,
        'train_seconds': train_seconds, 'jax': jax.__version__,
        'backend': jax.default_backend()})
    progress.print(f'step {step}: checkpoint saved to {path} '
                   f'({time.perf_counter() - began:.1f} s)')
    return path

  batch, saved = first, None
  with resume_lib.StopRequest() as stop:
    try:
      for step in range(start_step + 1, config.steps + 1):
        start = time.perf_counter()
        loss = float(trainer.step(batch))
        elapsed = time.perf_counter() - start
        # Compiled above, so every step counts; padding tokens do not.
        train_seconds += elapsed
        tokens += int(batch.attention_mask.sum())
        losses.append(loss)
        if not math.isfinite(loss):
          raise flags_lib.FinetuneError(
              f'loss became {loss} at step {step}; lower --lr')
        rate = tokens / train_seconds if train_seconds else 0.0
        progress.advance(f'loss {loss:.4f}  {rate:.0f} tok/s')
        if config.eval_every and step % config.eval_every == 0 and (
            step < config.steps):
          scores = evaluate(bar=False)
          evals.append({'step': step, **scores})
          progress.print(
              f'step {step}: held-out {metric} {scores[metric]:.4f}')
        stop.pause_for_test(step)
        if stop.signal_number or step == config.steps or checkpoints.due(
            step):
          saved = save(step)
        if stop.signal_number:
          break
        if step < config.steps:
          batch = place(next(batches))
    finally:
      progress.close()
  if stop.signal_number:
    where = (f'checkpoint saved to {saved}' if saved
             else 'no checkpoint (--no-checkpoint)')
    log(f'interrupted at step {step}/{config.steps}; {where}'
        + ('; resume with --resume' if saved and step < config.steps else ''))
    raise resume_lib.Interrupted(stop.exit_code)

  after = evaluate()
  evals.append({'step': config.steps, **after})
  peak, peak_source = trainers_lib.peak_memory(compiled)
  param_bytes = memory_plan.tree_bytes(nnx.state(model, nnx.Param))
  results = {
      'optimizer': config.optimizer,
      'learning_rate': lr,
      'learning_rate_source': lr_source,
      'warmup_steps': warmup,
      'model': model_path,
      'family': model_config.family,
      'task': task.name,
      'metric': metric,
      'before': before,
      'after': after,
      'evals': evals,
      'losses': losses,
      'optimizer_state_bytes': trainer.optimizer_state_bytes(),
      'parameter_bytes': param_bytes,
      'peak_memory_bytes': peak,
      'peak_memory_source': peak_source,
      # The whole process (loading, compiling, running), as `top` sees it.
      **report_lib.process_memory(),
      'tokens_per_second': tokens / train_seconds if train_seconds else 0.0,
      'train_seconds': train_seconds,
      'compile_seconds': compile_seconds,
      'wall_seconds': time.perf_counter() - wall_start,
      'step_path': step_path,
      'mesh': dict(mesh.shape) if mesh else None,
      'objective': objective,
      'resumed_from_step': start_step,
      'backend': jax.default_backend(),
      'config': dataclasses.asdict(config),
  }
  report_lib.write_json_atomic(
      os.path.join(config.output_dir, 'results.json'), results)
  return results
