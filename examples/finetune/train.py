"""The A/B fine-tuning loop: one model, one task, any ``--optimizer``.

``run(RunConfig(...))`` loads the model and data, checks every input before
anything is written, scores the held-out set, trains with
``nnx.Optimizer`` + ``nnx.jit`` (model and optimizer donated), evaluates
periodically, and writes ``results.json`` (Table-4-style figures: metric
before/after, persistent optimizer-state bytes, peak memory, tokens/s, wall
time) into ``output_dir``.
"""

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from examples.finetune import data as data_lib
from examples.finetune import optimizers as optimizers_lib
from examples.finetune import tasks as tasks_lib


class FinetuneError(Exception):
  """An input the run cannot use; the CLI prints it as one line."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything a run depends on (the CLI flags)."""
  optimizer: str = 'taco'
  lr: Optional[float] = None
  steps: int = 40
  batch_size: int = 4
  seq_len: int = 64
  warmup_steps: Optional[int] = None
  eval_every: int = 0
  eval_size: int = 200
  eval_batch_size: int = 16
  seed: int = 0
  model: Optional[str] = None
  dtype: str = 'auto'
  remat: bool = True
  remat_policy: str = 'nothing_saveable'
  scan_layers: bool = False
  task: str = 'tweets'
  train_file: Optional[str] = None
  test_file: Optional[str] = None
  label_words: Optional[str] = None
  template: str = '{text} It was'
  max_new_tokens: int = 16
  taco_k: int = 16
  taco_mu: float = 0.95
  taco_step: str = 'auto'
  objective: str = 'auto'
  output_dir: str = 'runs/finetune'
  resume: bool = False
  save_checkpoint: bool = True
  progress: bool = True


# Losses and scores.


def next_token_log_probs(model, input_ids, attention_mask):
  """``[B, T-1]`` log-probability of each next token."""
  logits = model(input_ids, attention_mask).astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  return jnp.take_along_axis(log_probs, input_ids[:, 1:, None], -1)[..., 0]


def completion_nll(logits, batch: data_lib.Batch):
  """Mean negative log-likelihood of the completion tokens, from logits."""
  log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  log_probs = jnp.take_along_axis(log_probs, batch.input_ids[:, 1:, None],
                                  -1)[..., 0]
  mask = batch.loss_mask[:, 1:]
  return -(log_probs * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def candidate_nll(logits, batch: data_lib.ChoiceBatch):
  """Cross-entropy of the correct candidate among the candidate tokens.

  The classification objective of MeZO's prompt-based fine-tuning: a softmax
  over the label words' logits after the prompt, so no step is spent on the
  label words' prior probability.
  """
  last = batch.attention_mask.sum(-1).astype(jnp.int32) - 1
  rows = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
  scores = jnp.take_along_axis(rows.astype(jnp.float32), batch.candidate_ids,
                               -1)
  log_probs = jax.nn.log_softmax(scores, axis=-1)
  return -jnp.take_along_axis(log_probs, batch.labels[:, None], -1).mean()


def batch_loss(logits, batch):
  """The loss a batch asks for: candidates (``ChoiceBatch``) or completion."""
  if isinstance(batch, data_lib.ChoiceBatch):
    return candidate_nll(logits, batch)
  return completion_nll(logits, batch)


def completion_loss(model, batch):
  """The training loss of ``model`` on ``batch`` (see :func:`batch_loss`)."""
  return batch_loss(model(batch.input_ids, batch.attention_mask), batch)


@nnx.jit
def _completion_scores(model, batch: data_lib.Batch):
  """Per-row mean log-likelihood of the completion."""
  log_probs = next_token_log_probs(model, batch.input_ids,
                                   batch.attention_mask)
  mask = batch.loss_mask[:, 1:]
  return (log_probs * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)


@nnx.jit
def _last_token_log_probs(model, input_ids, attention_mask, last):
  """``[B, V]`` next-token log-probabilities after position ``last[b]``."""
  logits = model(input_ids, attention_mask)
  rows = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
  return jax.nn.log_softmax(rows.astype(jnp.float32), axis=-1)


def _chunks(items: Sequence, size: int):
  """Fixed-size chunks, the last one padded by repeating its first item, so
  every call has one shape (no recompilation); yields (chunk, real_count)."""
  for start in range(0, len(items), size):
    chunk = list(items[start:start + size])
    real = len(chunk)
    chunk += [chunk[0]] * (size - real)
    yield chunk, real


# Evaluation.


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """A held-out set, tokenised once."""
  task: tasks_lib.Task
  examples: list[tasks_lib.Example]
  prompts: list[tuple[int, ...]]
  candidates: list[list[tuple[int, ...]]]

  @property
  def single_token(self) -> bool:
    """Every candidate is one token after one shared prompt: one forward per
    example scores all candidates."""
    return all(len(c) == 1 for cands in self.candidates for c in cands)


def make_eval_set(task, examples, tokenizer) -> EvalSet:
  prompts = [data_lib.encode(tokenizer, e.prompt, special=True)
             for e in examples]
  candidates = [[data_lib.encode(tokenizer, c, special=False)
                 for c in e.candidates] for e in examples]
  return EvalSet(task, list(examples), prompts, candidates)


def _predict_single_token(model, eval_set, seq_len, batch_size):
  predictions = []
  pairs = list(zip(eval_set.prompts, eval_set.candidates))
  for chunk, real in _chunks(pairs, batch_size):
    batch = data_lib.collate(
        [data_lib.TokenizedExample(p, ()) for p, _ in chunk], seq_len)
    last = batch.attention_mask.sum(-1).astype(np.int32) - 1
    log_probs = np.asarray(_last_token_log_probs(
        model, batch.input_ids, batch.attention_mask, last))
    for row in range(real):
      ids = [c[0] for c in chunk[row][1]]
      predictions.append(int(np.argmax(log_probs[row, ids])))
  return predictions


def _predict_by_likelihood(model, eval_set, seq_len, batch_size):
  flat = [(i, data_lib.TokenizedExample(p, c))
          for i, (p, cands) in enumerate(zip(eval_set.prompts,
                                             eval_set.candidates))
          for c in cands]
  scores = []
  for chunk, real in _chunks(flat, batch_size):
    batch = data_lib.collate([e for _, e in chunk], seq_len)
    scores.extend(np.asarray(_completion_scores(model, batch))[:real])
  predictions, position = [], 0
  for cands in eval_set.candidates:
    predictions.append(int(np.argmax(scores[position:position + len(cands)])))
    position += len(cands)
  return predictions


def _generate(model, eval_set, tokenizer, seq_len, batch_size,
              max_new_tokens, stop_ids):
  """Greedy decoding in a fixed ``[B, seq_len]`` buffer (no KV cache)."""
  texts = []
  room = seq_len - max_new_tokens
  for chunk, real in _chunks(eval_set.prompts, batch_size):
    ids = np.zeros((batch_size, seq_len), np.int32)
    lengths = np.zeros((batch_size,), np.int32)
    for row, prompt in enumerate(chunk):
      prompt = prompt[-room:]
      ids[row, :len(prompt)] = prompt
      lengths[row] = len(prompt)
    start = lengths.copy()
    done = np.zeros((batch_size,), bool)
    for _ in range(max_new_tokens):
      mask = np.arange(seq_len)[None] < lengths[:, None]
      log_probs = _last_token_log_probs(model, ids, mask, lengths - 1)
      next_ids = np.asarray(jnp.argmax(log_probs, -1))
      for row in range(batch_size):
        if done[row]:
          continue
        ids[row, lengths[row]] = next_ids[row]
        lengths[row] += 1
        done[row] = next_ids[row] in stop_ids
      if done[:real].all():
        break
    for row in range(real):
      new = [t for t in ids[row, start[row]:lengths[row]] if t not in stop_ids]
      texts.append(tasks_lib.first_line(tokenizer.decode(new)))
  return texts


def evaluate(model, eval_set: EvalSet, tokenizer, config: RunConfig,
             stop_ids=()) -> dict[str, float]:
  """The task metric(s) of ``model`` on ``eval_set``."""
  model.eval()
  try:
    if eval_set.task.generative:
      predictions = _generate(model, eval_set, tokenizer, config.seq_len,
                              config.eval_batch_size, config.max_new_tokens,
                              set(stop_ids))
    elif eval_set.single_token:
      predictions = _predict_single_token(model, eval_set, config.seq_len,
                                          config.eval_batch_size)
    else:
      predictions = _predict_by_likelihood(model, eval_set, config.seq_len,
                                           config.eval_batch_size)
  finally:
    model.train()
  return tasks_lib.score(eval_set.task, eval_set.examples, predictions)


# Training.


def make_train_step(needs_loss: bool) -> Callable:
  """``step(model, optimizer, batch) -> loss``, jitted, model/state donated.
  """

  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(completion_loss)(model, batch)
    if needs_loss:
      graphdef, _, rest = nnx.split(model, nnx.Param, ...)
      objective = lambda params: completion_loss(
          nnx.merge(graphdef, params, rest), batch)
      optimizer.update(model, grads, obj_fn=objective)
    else:
      optimizer.update(model, grads)
    return loss

  return nnx.jit(train_step, donate_argnames=('model', 'optimizer'))


def peak_memory(compiled=None) -> tuple[Optional[int], str]:
  """Peak bytes and where the figure comes from.

  The device's own counter where the backend has one (GPU/TPU); else the
  compiled train step's memory analysis (arguments + outputs + temporaries
  - donated aliases), an estimate of the step's peak.
  """
  stats = None
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # Backends without memory stats raise or return None.
    stats = None
  if stats and 'peak_bytes_in_use' in stats:
    return int(stats['peak_bytes_in_use']), 'device memory_stats'
  if compiled is not None:
    analysis = compiled.memory_analysis()
    if analysis is not None:
      total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
               + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
      return int(total), 'compiled memory analysis of the train step'
  return None, 'unavailable'


def write_json_atomic(path: str, payload: dict) -> None:
  """Writes ``path`` whole or not at all."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, suffix='.tmp')
  try:
    with os.fdopen(fd, 'w') as f:
      json.dump(payload, f, indent=2)
      f.write('\n')
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


# Trainers: the optax path for every optimizer, the layer-wise TACO step.


class NnxTrainer:
  """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and a donated ``nnx.jit`` step.
  """
  path = 'optax (nnx.Optimizer + nnx.jit)'

  def __init__(self, model, tx, needs_loss: bool):
    self.model = model
    self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    self._step = make_train_step(needs_loss)

  def compile(self, batch):
    return self._step.lower(self.model, self.optimizer, batch).compile()

  def step(self, batch):
    return self._step(self.model, self.optimizer, batch)

  @property
  def step_count(self) -> int:
    return int(self.optimizer.step[...])

  def optimizer_state_bytes(self) -> int:
    return optimizers_lib.state_bytes(
        nnx.state(self.optimizer, nnx.optimizer.OptState))

  def checkpoint_tree(self):
    return nnx.to_pure_dict(nnx.state((self.model, self.optimizer)))

  def load_checkpoint_tree(self, tree) -> None:
    state = nnx.state((self.model, self.optimizer))
    nnx.replace_by_pure_dict(state, tree)
    nnx.update((self.model, self.optimizer), state)


class LayerwiseTacoTrainer:
  """TACO through ``taco_optax``'s layer-wise step: each block's gradient is
  consumed (history updated, winners written into the weight) as soon as
  backprop produces it, so no dense update and at most one block's gradients
  exist at a time. Same parameters and state as the optax path."""
  path = ('layer-wise TACO step (taco_optax): per-block backward, winners '
          'written into the weights during backprop')

  def __init__(self, model, schedule, hints: optimizers_lib.ModelHints):
    from examples.finetune import layerwise  # pylint: disable=g-import-not-at-top
    self.model = model
    self._layered = layerwise.layered_model(model, batch_loss)
    train = layerwise.layerwise_lib.layerwise_train_step(
        self._layered.loss, schedule, k=hints.taco_k, mu=hints.taco_mu,
        weight_dimension_numbers=hints.taco_dimension_numbers,
        update_scale=hints.taco_update_scale)
    self.params = self._layered.params
    self.opt_state = train.optimizer.init(self.params)
    self.count = 0
    self._step = jax.jit(train.step, donate_argnums=(0, 1))

  def compile(self, batch):
    return self._step.lower(self.params, self.opt_state, batch).compile()

  def step(self, batch):
    self.params, self.opt_state, loss = self._step(self.params,
                                                   self.opt_state, batch)
    # The donated old arrays are gone: point the model at the new ones.
    self._layered.write_back(self.params)
    self.count += 1
    return loss

  @property
  def step_count(self) -> int:
    return self.count

  def optimizer_state_bytes(self) -> int:
    return optimizers_lib.state_bytes(self.opt_state)

  def checkpoint_tree(self):
    return {'params': self.params, 'opt_state': self.opt_state,
            'step': np.asarray(self.count, np.int64)}

  def load_checkpoint_tree(self, tree) -> None:
    self.params, self.opt_state = tree['params'], tree['opt_state']
    self.count = int(tree['step'])
    self._layered.write_back(self.params)


def make_trainer(config: 'RunConfig', spec, model, schedule, hints):
  """The layer-wise step for TACO when ``--taco-step`` allows, else optax."""
  if config.optimizer == 'taco' and config.taco_step != 'optax':
    from examples.finetune import layerwise  # pylint: disable=g-import-not-at-top
    if layerwise.available():
      return LayerwiseTacoTrainer(model, schedule, hints)
    if config.taco_step == 'layerwise':
      raise FinetuneError('--taco-step layerwise: this taco_optax has no '
                          'layer-wise train step')
  return NnxTrainer(model, spec.build(schedule, hints), spec.needs_loss)


# Checkpoints (Orbax): parameters and optimizer state, step included.

CHECKPOINT_DIR = 'checkpoint'


def checkpoint_path(output_dir: str) -> str:
  return os.path.join(os.path.abspath(output_dir), CHECKPOINT_DIR)


def save_checkpoint(path: str, trainer) -> None:
  """Saves the trainer's state; Orbax writes it atomically."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, trainer.checkpoint_tree(), force=True)
  checkpointer.wait_until_finished()


def restore_checkpoint(path: str, trainer) -> int:
  """Loads a checkpoint into the trainer; returns its step.

  The freshly built trainer gives the expected structure, shapes and dtypes,
  so a checkpoint of another model, optimizer or step path is refused.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(path):
    raise FinetuneError(f'--resume: no checkpoint at {path}')
  try:
    restored = ocp.StandardCheckpointer().restore(path,
                                                  trainer.checkpoint_tree())
  except Exception as e:  # Orbax raises many types for a mismatched tree.
    raise FinetuneError(
        f'--resume: checkpoint at {path} does not match this model, '
        f'optimizer and step path ({type(e).__name__}: '
        f'{str(e).splitlines()[0][:200]})') from e
  trainer.load_checkpoint_tree(restored)
  return trainer.step_count


# The run.


def _dtype(name: str):
  if name == 'auto':
    # CPUs upcast bf16 matmuls (slower, no memory gain in the temporaries).
    return jnp.float32 if jax.default_backend() == 'cpu' else jnp.bfloat16
  if name not in ('float32', 'bfloat16'):
    raise FinetuneError(f'--dtype must be auto, float32 or bfloat16, '
                        f'got {name!r}')
  return jnp.dtype(name)


def load_model(config: RunConfig):
  """``(model, tokenizer, model_config, path)``; bad inputs -> FinetuneError.
  """
  from examples.finetune import loading  # pylint: disable=g-import-not-at-top
  path = config.model
  try:
    if path is None:
      path = loading.smollm2_gguf_path()
    model, tokenizer, model_config = loading.load_pretrained(
        path, dtype=_dtype(config.dtype),
        remat='block' if config.remat else None,
        remat_policy=config.remat_policy, scan_layers=config.scan_layers)
  except loading.ModelLoadError as e:
    raise FinetuneError(str(e)) from e
  return model, tokenizer, model_config, path


def _subset(items: list, size: int, seed: int) -> list:
  if size <= 0 or size >= len(items):
    return items
  keep = np.sort(np.random.default_rng(seed).permutation(len(items))[:size])
  return [items[i] for i in keep]


def load_task(config: RunConfig):
  """``(task, train examples, held-out examples)`` for the configured task."""
  if config.task == 'tweets':
    if config.train_file or config.test_file:
      raise FinetuneError('--train-file/--test-file need --task (e.g. text, '
                          'sst2); the default task uses the embedded tweets')
    task = data_lib.tweets_task()
    train, test = data_lib.split_tweets(data_lib.read_tweets(),
                                        max(config.eval_size // 2, 1))
    return (task, [task.example(r) for r in train],
            [task.example(r) for r in test])
  if config.task == 'text':
    if not config.label_words:
      raise FinetuneError('--task text needs --label-words, e.g. '
                          '"negative=terrible,positive=great"')
    try:
      task = tasks_lib.text_classification(
          tasks_lib.parse_label_words(config.label_words), config.template)
    except ValueError as e:
      raise FinetuneError(str(e)) from e
  elif config.task in tasks_lib.TASKS:
    task = tasks_lib.TASKS[config.task]
  else:
    raise FinetuneError(
        f'unknown task {config.task!r}; choose from tweets, text, '
        f'{", ".join(tasks_lib.TASKS)}')
  if not config.train_file or not config.test_file:
    raise FinetuneError(f'--task {config.task} needs --train-file and '
                        '--test-file (JSONL in the Hugging Face field layout)')
  train = data_lib.load_examples(task, config.train_file)
  test = data_lib.load_examples(task, config.test_file)
  return task, train, _subset(test, config.eval_size, seed=0)


def _check_config(config: RunConfig) -> None:
  if config.optimizer not in optimizers_lib.OPTIMIZERS:
    raise FinetuneError(f'unknown optimizer {config.optimizer!r}; choose '
                        f'from {", ".join(optimizers_lib.OPTIMIZERS)}')
  for name in ('steps', 'batch_size', 'seq_len', 'eval_batch_size'):
    if getattr(config, name) <= 0:
      raise FinetuneError(f'--{name.replace("_", "-")} must be positive')
  from examples.finetune import model as model_lib  # pylint: disable=g-import-not-at-top
  if config.remat_policy not in model_lib.REMAT_POLICIES:
    raise FinetuneError(f'--remat-policy must be one of '
                        f'{", ".join(model_lib.REMAT_POLICIES)}')
  if config.taco_step not in ('auto', 'layerwise', 'optax'):
    raise FinetuneError('--taco-step must be auto, layerwise or optax')
  if config.objective not in ('auto', 'candidates', 'completion'):
    raise FinetuneError('--objective must be auto, candidates or completion')
  if config.eval_every < 0:
    raise FinetuneError('--eval-every must be >= 0')


def _format_bytes(n: Optional[int]) -> str:
  if n is None:
    return 'n/a'
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if n < 1024 or unit == 'GiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024


def results_table(results: dict) -> str:
  """The paper's Table-4 figures as plain text."""
  metric = results['metric']
  rows = [
      ('optimizer', results['optimizer']),
      ('model', os.path.basename(str(results['model']))),
      ('task', results['task']),
      (f'{metric} before', f"{results['before'][metric]:.4f}"),
      (f'{metric} after', f"{results['after'][metric]:.4f}"),
      ('optimizer state', _format_bytes(results['optimizer_state_bytes'])),
      ('parameters', _format_bytes(results['parameter_bytes'])),
      ('peak memory', f"{_format_bytes(results['peak_memory_bytes'])} "
                      f"({results['peak_memory_source']})"),
      ('tokens/s', f"{results['tokens_per_second']:.1f}"),
      ('train time', f"{results['train_seconds']:.1f} s "
                     f"(compile {results['compile_seconds']:.1f} s)"),
      ('wall time', f"{results['wall_seconds']:.1f} s"),
      ('step path', results['step_path']),
  ]
  width = max(len(k) for k, _ in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)


class _Progress:
  """A rich progress bar with loss and tokens/s on a terminal; elsewhere (logs,
  CI) a plain line every tenth of the run; nothing when disabled."""

  def __init__(self, total: int, enabled: bool):
    self._bar = None
    self._total, self._done = total, 0
    self._log_every = max(1, total // 10) if enabled else 0
    if enabled and sys.stderr.isatty():
      from rich import console, progress  # pylint: disable=g-import-not-at-top
      self._bar = progress.Progress(
          progress.TextColumn('[bold]train'), progress.BarColumn(),
          progress.MofNCompleteColumn(), progress.TimeElapsedColumn(),
          progress.TextColumn('{task.fields[info]}'),
          console=console.Console(stderr=True))
      self._task = self._bar.add_task('train', total=total, info='')
      self._bar.start()

  def advance(self, info: str) -> None:
    self._done += 1
    if self._bar is not None:
      self._bar.update(self._task, advance=1, info=info)
    elif self._log_every and (self._done % self._log_every == 0
                              or self._done == self._total):
      print(f'step {self._done}/{self._total}: {info}', file=sys.stderr,
            flush=True)

  def print(self, text: str) -> None:
    if self._bar is not None:
      self._bar.console.print(text)
    else:
      print(text, file=sys.stderr)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()


def run(config: RunConfig, log: Callable[[str], None] = print) -> dict:
  """Fine-tunes and evaluates; returns (and writes) the results.

  Every input is checked before ``output_dir`` is touched.
  """
  wall_start = time.perf_counter()
  _check_config(config)
  spec = optimizers_lib.get(config.optimizer)
  try:
    task, train_examples, test_examples = load_task(config)
  except (data_lib.DataError, tasks_lib.TaskDataError) as e:
    raise FinetuneError(str(e)) from e
  model, tokenizer, model_config, model_path = load_model(config)
  if config.seq_len > model_config.max_position_embeddings:
    raise FinetuneError(
        f'--seq-len {config.seq_len} exceeds the model\'s '
        f'{model_config.max_position_embeddings} positions')
  if task.generative and config.max_new_tokens >= config.seq_len:
    raise FinetuneError('--max-new-tokens must be below --seq-len')

  train_tokens, collate_fn, objective = None, None, 'completion likelihood'
  if config.objective in ('auto', 'candidates') and not task.generative:
    train_tokens = data_lib.choice_examples(tokenizer, train_examples)
    collate_fn, objective = data_lib.collate_choices, 'candidate cross-entropy'
    if train_tokens is None and config.objective == 'candidates':
      raise FinetuneError('--objective candidates needs single-token '
                          'candidates')
  elif config.objective == 'candidates':
    raise FinetuneError('--objective candidates needs a classification task')
  if train_tokens is None:
    train_tokens = [data_lib.tokenize(tokenizer, e.prompt, e.target)
                    for e in train_examples]
    collate_fn, objective = data_lib.collate, 'completion likelihood'
  eval_set = make_eval_set(task, test_examples, tokenizer)
  pad_id = model_config.pad_token_id or 0
  batches = data_lib.training_batches(train_tokens, config.batch_size,
                                      config.seq_len, config.seed, pad_id,
                                      collate_fn)
  stop_ids = [i for i in (model_config.eos_token_id,) if i is not None]
  stop_ids += tokenizer.encode('\n', add_special_tokens=False).ids[:1]

  lr, lr_source = config.lr, '--lr'
  if lr is None:
    demo = config.task == 'tweets' and spec.demo_lr is not None
    lr = spec.demo_lr if demo else spec.default_lr
    lr_source = ('short-demo default; paper default '
                 f'{spec.default_lr:g} for 2000-step runs') if demo else (
                     spec.note or 'default')
  warmup = (config.warmup_steps if config.warmup_steps is not None
            else min(50, config.steps // 10))
  schedule = optimizers_lib.linear_schedule(lr, config.steps, warmup)
  from examples.finetune import model as model_lib  # pylint: disable=g-import-not-at-top
  hints = optimizers_lib.ModelHints(
      taco_dimension_numbers=model_lib.taco_dimension_numbers,
      taco_update_scale=model_lib.taco_update_scale,
      vocab_size=model_config.vocab_size, taco_k=config.taco_k,
      taco_mu=config.taco_mu)
  trainer = make_trainer(config, spec, model, schedule, hints)
  start_step = 0
  if config.resume:
    start_step = restore_checkpoint(checkpoint_path(config.output_dir),
                                    trainer)
    if start_step >= config.steps:
      raise FinetuneError(f'--resume: the checkpoint is at step {start_step}, '
                          f'not before --steps {config.steps}')
    for _ in range(start_step):  # Continue the same batch stream.
      next(batches)
    log(f'resumed from step {start_step}')
  step_path = trainer.path
  log(f'model {model_path} ({model_config.family}, '
      f'{len(train_tokens)} train / {len(test_examples)} held-out examples)')
  log(f'optimizer {config.optimizer}: lr {lr:g} ({lr_source}), '
      f'warm-up {warmup}, '
      f'{config.steps} steps x batch {config.batch_size} x {config.seq_len} '
      f'tokens, {objective}; step path: {step_path}')

  metric = next(iter(tasks_lib.score(task, [], [])))
  before = evaluate(model, eval_set, tokenizer, config, stop_ids)
  log(f'held-out {metric} before: {before[metric]:.4f}')

  first = next(batches)
  compile_start = time.perf_counter()
  compiled = trainer.compile(first)
  compile_seconds = time.perf_counter() - compile_start

  progress = _Progress(config.steps - start_step, config.progress)
  losses, evals, tokens, train_seconds = [], [], 0, 0.0
  batch = first
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
        raise FinetuneError(f'loss became {loss} at step {step}; lower --lr')
      rate = tokens / train_seconds if train_seconds else 0.0
      progress.advance(f'loss {loss:.4f}  {rate:.0f} tok/s')
      if config.eval_every and step % config.eval_every == 0 and (
          step < config.steps):
        scores = evaluate(model, eval_set, tokenizer, config, stop_ids)
        evals.append({'step': step, **scores})
        progress.print(f'step {step}: held-out {metric} {scores[metric]:.4f}')
      if step < config.steps:
        batch = next(batches)
  finally:
    progress.close()

  after = evaluate(model, eval_set, tokenizer, config, stop_ids)
  evals.append({'step': config.steps, **after})
  if config.save_checkpoint:
    save_checkpoint(checkpoint_path(config.output_dir), trainer)
  peak, peak_source = peak_memory(compiled)
  param_bytes = optimizers_lib.state_bytes(nnx.state(model, nnx.Param))
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
      'tokens_per_second': tokens / train_seconds if train_seconds else 0.0,
      'train_seconds': train_seconds,
      'compile_seconds': compile_seconds,
      'wall_seconds': time.perf_counter() - wall_start,
      'step_path': step_path,
      'objective': objective,
      'resumed_from_step': start_step,
      'backend': jax.default_backend(),
      'config': dataclasses.asdict(config),
  }
  write_json_atomic(os.path.join(config.output_dir, 'results.json'), results)
  return results
