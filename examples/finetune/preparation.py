"""Everything a run does before its first step, each input checked first.

:func:`prepare` resolves the run directory, opens (or resumes) the
checkpoints, reads the task and the model, checks the flags against them,
tokenises, picks the learning rate, refuses a run predicted not to fit in
memory and builds the trainer. Nothing is written until every check has
passed, so a refusal (a :class:`flags.FinetuneError`) leaves no trace.
"""

import os
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

from flax import nnx
import jax
import jax.numpy as jnp
import optax
import tokenizers

from examples.finetune import checkpoint as checkpoint_lib
from examples.finetune import data as data_lib
from examples.finetune import evaluation as evaluation_lib
from examples.finetune import flags as flags_lib
from examples.finetune import landed as landed_lib
from examples.finetune import memory_plan
from examples.finetune import optimizers as optimizers_lib
from examples.finetune import phases
from examples.finetune import precision as precision_lib
from examples.finetune import resume as resume_lib
from examples.finetune import run_dirs
from examples.finetune import tasks as tasks_lib
from examples.finetune import trainers as trainers_lib
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import loading
from examples.finetune.model import saving
from examples.finetune.model import weights as weights_lib
import taco_optax

# The objective of a classification task whose candidates are single tokens:
# its loss projects one position per sequence onto the vocabulary.
CANDIDATES = 'candidate cross-entropy'


def load_model(path: Optional[str], *, dtype: Any, remat: bool,
               param_dtype: Any = None,
               remat_policy: str = 'nothing_saveable',
               scan_layers: bool = False):
  """``(model, tokenizer, model_config, path)``; bad inputs -> FinetuneError.

  Args:
    path: a Hugging Face directory or ``.gguf`` file; ``None``: SmolLM2-135M.
    dtype: the computation dtype (``'float32'``, ``jnp.bfloat16``, ...).
    remat: recompute each block in the backward pass.
    param_dtype: the stored parameters' dtype; ``None``: ``dtype``.
    remat_policy: what a rematerialised block keeps.
    scan_layers: stack the blocks for ``lax.scan``.
  """
  try:
    if path is None:
      path = gguf_lib.smollm2_gguf_path()
    model, tokenizer, model_config = loading.load_pretrained(
        path, dtype=jnp.dtype(dtype),
        param_dtype=None if param_dtype is None else jnp.dtype(param_dtype),
        remat='block' if remat else None, remat_policy=remat_policy,
        scan_layers=scan_layers)
  except weights_lib.ModelLoadError as e:
    raise flags_lib.FinetuneError(str(e)) from e
  return model, tokenizer, model_config, path


def export_dir(config: flags_lib.RunConfig) -> Optional[str]:
  """Where the run's model is exported (``None``: ``--no-export``)."""
  if not config.export:
    return None
  return config.export_dir or os.path.join(config.output_dir, 'model')


def load_task(config: flags_lib.RunConfig):
  """``(task, train examples, held-out examples)`` for the configured task.

  A task with its own records (the tweets, ``bbc``, ``trec``) splits them
  itself (``--eval-split`` picks its held-out or its validation set); every
  other task reads ``--train-file`` and ``--test-file``.
  """
  try:
    task = tasks_lib.get(config.task, config.label_words, config.template)
  except ValueError as e:
    raise flags_lib.FinetuneError(str(e)) from e
  if task.records is not None:
    if config.train_file or config.test_file:
      raise flags_lib.FinetuneError(
          f'--train-file/--test-file need --task (e.g. text, sst2); '
          f'--task {task.name} reads its own records')
    train, test = task.split(config.eval_split)
  elif config.eval_split != 'test':
    raise flags_lib.FinetuneError(
        f'--eval-split {config.eval_split} needs a task with its own records '
        f'(tweets, bbc, trec, tweets-to-movies); --task {task.name} is scored '
        'on --test-file')
  elif not config.train_file or not config.test_file:
    raise flags_lib.FinetuneError(
        f'--task {config.task} needs --train-file and --test-file (JSONL in '
        'the Hugging Face field layout)')
  else:
    train = data_lib.read_jsonl(config.train_file)
    test = data_lib.read_jsonl(config.test_file)
  train, test = (data_lib.examples(task, records, path) for records, path in
                 ((train, config.train_file), (test, config.test_file)))
  return task, train, data_lib.balanced_subset(test, config.eval_size)


def _check_memory(config: flags_lib.RunConfig, model, tx,
                  precision: precision_lib.Precision,
                  scored_positions: Optional[int] = None) -> None:
  """Refuses a run whose predicted peak exceeds the device's memory.

  The limit is ``config.memory_limit_gb``, else the device's own
  (``bytes_limit``; CPUs report none, so nothing is checked there), times the
  devices of an active mesh (the plan is unsharded: a run over this is sure
  not to fit). The prediction is :mod:`memory_plan`'s, with the parameters as
  stored (float32 master weights count 4 bytes each) and this optimizer's
  exact state size; the loss scores ``scored_positions`` positions per
  sequence (1 for the candidate cross-entropy; ``None``: every one).
  """
  limit = (memory_plan.device_memory_limit() if config.memory_limit_gb is None
           else config.memory_limit_gb * memory_plan.GB)
  if limit is None:
    return
  mesh = jax.sharding.get_abstract_mesh()
  devices = 1 if mesh.empty else mesh.size
  limit *= devices
  params = memory_plan.model_params(model)
  layerwise = trainers_lib.uses_layerwise_step(config)

  def peak_of(batch, accumulation):
    state_tx = (optax.MultiSteps(tx, accumulation).gradient_transformation()
                if accumulation > 1 and not layerwise else tx)
    state_bytes = memory_plan.tree_bytes(
        jax.eval_shape(state_tx.init, nnx.state(model, nnx.Param)))
    return memory_plan.model_peak(
        model, params, state_bytes, batch=batch // accumulation,
        seq=config.seq_len, layerwise=layerwise,
        accumulation_steps=accumulation, scored_positions=scored_positions)

  peak = peak_of(config.batch_size, config.grad_accum)
  if peak <= limit:
    return
  splits = [n for n in range(config.grad_accum + 1, config.batch_size + 1)
            if config.batch_size % n == 0
            and peak_of(config.batch_size, n) <= limit]
  fitting = [b for b in range(config.batch_size - 1, 0, -1)
             if b % config.grad_accum == 0
             and peak_of(b, config.grad_accum) <= limit]
  advice = [f'--grad-accum {splits[0]}'] if splits else []
  advice += [f'--batch-size {fitting[0]}'] if fitting else []
  advice += [] if config.remat else ['--remat on']
  if precision.rounding == 'master':
    advice.append('--rounding stochastic')
  if config.optimizer != 'taco':
    advice.append('--optimizer taco')
  elif not layerwise:
    advice.append('--taco-step auto')
  advice = ' or '.join(advice) or 'a device with more memory'
  gb = lambda n: f'{n / memory_plan.GB:.3g} GB'
  holder = 'device has' if devices == 1 else f'{devices} devices have'
  raise flags_lib.FinetuneError(
      f'--optimizer {config.optimizer} at --batch-size {config.batch_size} '
      + (f'(--grad-accum {config.grad_accum}) ' if config.grad_accum > 1
         else '') +
      f'x --seq-len {config.seq_len} needs about {gb(peak)} (predicted), the '
      f'{holder} {gb(limit)}; try {advice}')


def _training_tokens(objective: str, task, examples, tokenizer):
  """``(tokenised examples, collate function, objective's name)``."""
  if objective in ('auto', 'candidates') and not task.generative:
    choices = data_lib.choice_examples(tokenizer, examples)
    if choices is not None:
      return choices, data_lib.collate_choices, CANDIDATES
    if objective == 'candidates':
      raise flags_lib.FinetuneError(
          '--objective candidates needs single-token candidates')
  elif objective == 'candidates':
    raise flags_lib.FinetuneError(
        '--objective candidates needs a classification task')
  return ([data_lib.tokenize(tokenizer, e.prompt, e.target) for e in examples],
          data_lib.collate, 'completion likelihood')


class PreparedRun(NamedTuple):
  """A run ready for its first step.

  Attributes:
    config: the flags, ``output_dir`` resolved.
    checkpoints: the run's checkpoints; ``history`` holds what a resumed run
      had recorded.
    task: the task.
    held_out: the held-out examples scored.
    eval_set: those examples tokenised for :func:`evaluation.evaluate`.
    tokenizer: the model's tokenizer.
    stop_ids: tokens that end a generated answer.
    model: the model the trainer trains.
    model_config: its architecture.
    model_path: the file or directory it was read from.
    batches: the training batches, from the next step's on.
    objective: the training loss's name.
    learning_rate: the schedule's peak.
    learning_rate_source: where that rate comes from.
    warmup_steps: the schedule's warm-up.
    trainer: the step and the state it trains (``trainers``).
    start_step: the steps done before this process (a resume's).
    precision: the dtypes and how 16-bit updates land (``--rounding``).
    master_cost: ``(parameter bytes, state bytes)`` that float32 master
      weights add (0, 0 otherwise), measured from the shapes.
  """
  config: flags_lib.RunConfig
  checkpoints: checkpoint_lib.RunCheckpoints
  task: tasks_lib.Task
  held_out: list[tasks_lib.Example]
  eval_set: evaluation_lib.EvalSet
  tokenizer: tokenizers.Tokenizer
  stop_ids: list[int]
  model: decoder_lib.DecoderLM
  model_config: config_lib.ModelConfig
  model_path: str
  batches: Iterator[Union[data_lib.Batch, data_lib.ChoiceBatch]]
  objective: str
  learning_rate: float
  learning_rate_source: str
  warmup_steps: int
  trainer: Union[trainers_lib.NnxTrainer, trainers_lib.LayerwiseTacoTrainer]
  start_step: int
  precision: precision_lib.Precision
  master_cost: tuple[int, int]


def _check_lengths(config: flags_lib.RunConfig, task, model_config) -> None:
  if config.seq_len > model_config.max_position_embeddings:
    raise flags_lib.FinetuneError(
        f'--seq-len {config.seq_len} exceeds the model\'s '
        f'{model_config.max_position_embeddings} positions')
  if task.generative and config.max_new_tokens >= config.seq_len:
    raise flags_lib.FinetuneError(
        '--max-new-tokens must be below --seq-len')


def _learning_rate(config: flags_lib.RunConfig) -> tuple[float, str, int]:
  """``(peak rate, where it comes from, warm-up steps)`` of the schedule."""
  lr, lr_source = config.lr, '--lr'
  if lr is None:
    lr, lr_source = optimizers_lib.get(config.optimizer).default_rate(
        config.steps)
  warmup = (config.warmup_steps if config.warmup_steps is not None
            else default_warmup(config.steps))
  return lr, lr_source, warmup


def default_warmup(steps: int) -> int:
  """The warm-up without ``--warmup-steps``: a tenth of the run, at most
  50 steps."""
  return min(50, steps // 10)


def stop_ids(model_config, tokenizer) -> list[int]:
  """End of sequence, and a newline: a generated answer is one line."""
  ids = [i for i in (model_config.eos_token_id,) if i is not None]
  return ids + tokenizer.encode('\n', add_special_tokens=False).ids[:1]


def _measurement(config: flags_lib.RunConfig, checkpoints, hints,
                 schedule) -> Optional[landed_lib.Measurement]:
  """What ``--measure-landed`` counts (a resumed run's totals carried on)."""
  if not config.measure_landed:
    return None
  return landed_lib.Measurement(
      hints.taco_dimension_numbers, config.taco.update_topk or 1, schedule,
      landed_lib.LandedCounts(checkpoints.history.get('landed')))


def prepare(config: flags_lib.RunConfig,
            log: Callable[[str], None] = phases.flushed_print) -> PreparedRun:
  """Checks every input and builds the run; writes nothing.

  Without ``--output-dir`` the run gets a new directory
  (:func:`run_dirs.with_output_dir`); with ``--resume`` the trainer holds the
  checkpoint's state and the batches continue after its step.

  Raises:
    flags.FinetuneError: an input the run cannot use, as one line.
  """
  config = run_dirs.with_output_dir(config)
  if config.export and config.export_dir is not None:
    try:
      saving.check_target(config.export_dir)
    except saving.ExportError as e:
      raise flags_lib.FinetuneError(f'--export-dir: {e}') from e
  checkpoints = resume_lib.open_checkpoints(config, log)
  try:
    task, train_examples, held_out = load_task(config)
  except (data_lib.DataError, tasks_lib.TaskDataError) as e:
    raise flags_lib.FinetuneError(str(e)) from e
  precision = precision_lib.resolve(config.dtype, config.rounding,
                                    config.optimizer)
  with phases.phase('loading the model '
                    + (config.model or '(SmolLM2-135M GGUF)'), log):
    model, tokenizer, model_config, model_path = load_model(
        config.model, dtype=precision.compute_dtype,
        param_dtype=precision.param_dtype, remat=config.remat,
        remat_policy=config.remat_policy, scan_layers=config.scan_layers)
  _check_lengths(config, task, model_config)
  with phases.phase(f'tokenising {len(train_examples)} training and '
                    f'{len(held_out)} {config.scored_set} examples', log):
    train_tokens, collate_fn, objective = _training_tokens(
        config.objective, task, train_examples, tokenizer)
    eval_set = evaluation_lib.make_eval_set(task, held_out, tokenizer)
  batches = data_lib.training_batches(
      train_tokens, config.batch_size, config.seq_len, config.seed,
      model_config.pad_token_id or 0, collate_fn)
  lr, lr_source, warmup = _learning_rate(config)
  schedule = optimizers_lib.linear_schedule(lr, config.steps, warmup)
  resume_lib.check_resolved(checkpoints, **{
      'learning rate': lr, 'warm-up steps': warmup,
      'parameter dtype': precision.param_dtype.name,
      'compute dtype': precision.compute_dtype.name,
      '16-bit updates': precision.rounding,
      'model file': os.path.abspath(model_path),
      'training data': resume_lib.data_digest(train_tokens)})
  hints = optimizers_lib.decoder_hints(model_config)
  tx = optimizers_lib.get(config.optimizer).build(
      schedule, hints, config.taco, precision.optimizer_rounding(config.seed))
  _check_memory(config, model, tx, precision,
                scored_positions=(1 if objective == CANDIDATES else None))
  master_cost = precision_lib.master_cost(
      nnx.as_pure(nnx.state(model, nnx.Param)), tx.init,
      precision.compute_dtype)
  with phases.phase(f'setting up {config.optimizer}', log):
    trainer = trainers_lib.make_trainer(
        config, model, tx, _measurement(config, checkpoints, hints, schedule))
    start_step = resume_lib.restore(checkpoints, trainer, batches, log)
  log(f'run directory {config.output_dir}')
  log(f'model {model_path} ({model_config.family}, '
      f'{len(train_tokens)} train / {len(held_out)} {config.scored_set} '
      'examples)')
  log(f'optimizer {config.optimizer}: lr {lr:g} ({lr_source}), '
      f'warm-up {warmup}, '
      f'{config.steps} steps x batch {config.batch_size} x {config.seq_len} '
      f'tokens'
      + (f' ({config.grad_accum} micro-batches of '
         f'{config.batch_size // config.grad_accum})'
         if config.grad_accum > 1 else '')
      + f', {objective}; step path: {trainer.path}')
  log(f'16-bit updates: {precision_lib.describe(precision, *master_cost)} '
      f'({precision.why})')
  if config.optimizer == 'taco':  # which weights TACO updates, and the bytes
    log(str(taco_optax.routing_report(tx, nnx.state(model, nnx.Param))))
  return PreparedRun(
      config=config, checkpoints=checkpoints, task=task, held_out=held_out,
      eval_set=eval_set, tokenizer=tokenizer,
      stop_ids=stop_ids(model_config, tokenizer), model=model,
      model_config=model_config, model_path=model_path, batches=batches,
      objective=objective, learning_rate=lr, learning_rate_source=lr_source,
      warmup_steps=warmup, trainer=trainer, start_step=start_step,
      precision=precision, master_cost=master_cost)
