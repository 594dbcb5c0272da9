"""One fine-tuning run of the quality benchmark, with compiled steps reused.

The example's loop (``examples.finetune.loop``) compiles one step per run.
A benchmark of ~100 runs cannot afford that on two CPU cores, so this module
keeps the example's pieces (model, data, batches, loss, schedule, optimizer
registry, evaluation, memory figure) and changes one thing: the peak learning
rate is a traced value (``optax.inject_hyperparams``), fed each step from the
example's warm-up/decay schedule on the host, so one compiled step serves every
learning rate and seed of an optimizer variant.

The learning-rate transfer test's small models live here too
(:func:`small_config`, :func:`new_model`): Llama-style models of one family,
each width pretrained briefly from scratch (AdamW, next-token loss on the
training tweets' text, never the held-out ones), then fine-tuned on the tweet
sentiment task like the real model. The SmolLM2 tokenizer is kept but its
49k-token vocabulary is cut to the most frequent tokens of the training
tweets (the rest share one id): a 49k x d embedding would dominate these
models' size and time on two CPU cores.
"""

import collections
import dataclasses
import functools
import math
import time
from typing import Any, Iterable, Optional, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.finetune import api


@dataclasses.dataclass(frozen=True)
class Variant:
  """An optimizer configuration that needs its own compiled step.

  Attributes:
    optimizer: a name of the example's ``--optimizer`` registry.
    taco_k: TACO history entries per column; ``None`` is a dense history.
    taco_mu: TACO history decay.
    taco_update_topk: TACO's update Top-r.
  """
  optimizer: str
  taco_k: Optional[int] = 16
  taco_mu: float = 0.95
  taco_update_topk: int = 1

  @property
  def taco(self) -> api.TacoSettings:
    return api.TacoSettings(self.taco_k, self.taco_mu, self.taco_update_topk)

  @property
  def label(self) -> str:
    if self.optimizer != 'taco':
      return self.optimizer
    k = 'dense' if self.taco_k is None else self.taco_k
    return f'taco(k={k},mu={self.taco_mu:g},r={self.taco_update_topk})'


def build_transformation(variant: Variant, hints) -> tuple[Any, bool]:
  """``(inject_hyperparams transformation, needs_loss)`` for a variant."""
  spec = api.optimizer(variant.optimizer)
  factory = lambda learning_rate: spec.build(learning_rate, hints,
                                             variant.taco)
  return optax.inject_hyperparams(factory)(learning_rate=0.0), spec.needs_loss


@dataclasses.dataclass
class CompiledStep:
  """A compiled ``(params, state, batch, lr) -> (params, state, loss)``."""
  step: Any
  transformation: Any
  compile_seconds: float
  peak_memory_bytes: Optional[int]
  peak_memory_source: str


class Runner:
  """Runs fine-tuning runs of one model on one data set.

  Args:
    model: the ``DecoderLM`` whose current parameters every run starts from.
    train_tokens: tokenised training examples.
    eval_set: the held-out ``evaluation.EvalSet`` (``None``: no evaluation).
    tokenizer: the tokenizer (for evaluation).
    batch_size: training batch size.
    seq_len: padded training and evaluation length.
    eval_batch_size: evaluation batch size.
    pad_id: padding token id.
    hints: ``optimizers.ModelHints`` for the registry's builders.
  """

  def __init__(self, model, train_tokens: Sequence[api.TokenizedExample],
               eval_set, tokenizer, *, batch_size: int, seq_len: int,
               eval_batch_size: int, pad_id: int, hints):
    self.graphdef, self.initial_params, self.rest = nnx.split(
        model, nnx.Param, ...)
    self.train_tokens = list(train_tokens)
    self.eval_set = eval_set
    self.tokenizer = tokenizer
    self.batch_size = batch_size
    self.seq_len = seq_len
    self.pad_id = pad_id
    self.hints = hints
    self.eval_batch_size = eval_batch_size
    self._compiled: dict[Variant, CompiledStep] = {}

  def loss(self, params, batch):
    return api.completion_loss(
        nnx.merge(self.graphdef, params, self.rest), batch)

  def model_of(self, params):
    return nnx.merge(self.graphdef, params, self.rest)

  def first_batch(self):
    """The first training batch of seed 0 (the compiled steps' shapes)."""
    return next(api.training_batches(self.train_tokens, self.batch_size,
                                     self.seq_len, 0, self.pad_id))

  def compiled(self, variant: Variant) -> CompiledStep:
    """The variant's compiled step (compiled on first use)."""
    if variant in self._compiled:
      return self._compiled[variant]
    transformation, needs_loss = build_transformation(variant, self.hints)

    def step(params, state, batch, learning_rate):
      loss, grads = jax.value_and_grad(self.loss)(params, batch)
      state = state._replace(
          hyperparams={**state.hyperparams, 'learning_rate': learning_rate})
      extra = ({'obj_fn': functools.partial(self.loss, batch=batch)}
               if needs_loss else {})
      updates, state = transformation.update(grads, state, params, **extra)
      return optax.apply_updates(params, updates), state, loss

    params = self.initial_params
    state = jax.eval_shape(transformation.init, params)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, state, self.first_batch(), jnp.float32(0.0)).compile()
    seconds = time.perf_counter() - start
    peak, source = api.peak_memory(compiled)
    self._compiled[variant] = CompiledStep(compiled, transformation, seconds,
                                           peak, source)
    return self._compiled[variant]

  def compiled_steps(self) -> dict[Variant, CompiledStep]:
    """The steps compiled so far, by variant, in compilation order."""
    return dict(self._compiled)

  def evaluate(self, params) -> float:
    """Held-out accuracy (the task's headline metric)."""
    scores = api.evaluate(
        self.model_of(params), self.eval_set, self.tokenizer,
        seq_len=self.seq_len, batch_size=self.eval_batch_size)
    return float(next(iter(scores.values())))

  def train(self, variant: Variant, learning_rate: float, seed: int,
            steps: int, warmup_steps: int,
            eval_steps: Iterable[int] = ()) -> dict:
    """Trains from the initial parameters; returns the run's record.

    Args:
      variant: the optimizer configuration.
      learning_rate: peak learning rate of the linear warm-up/decay schedule.
      seed: seed of the training-batch order.
      steps: training steps.
      warmup_steps: warm-up steps.
      eval_steps: steps before the last after which to evaluate too.

    Returns:
      A JSON-ready record: losses, evaluations, final accuracy (``None``
      without an eval set), state bytes, peak memory, tokens/s, times; the
      final parameters are kept in ``self.last_params``.
    """
    compiled = self.compiled(variant)
    params = jax.tree.map(jnp.copy, self.initial_params)
    state = jax.jit(compiled.transformation.init)(params)
    state_bytes = api.tree_bytes(state.inner_state)
    schedule = api.linear_schedule(learning_rate, steps, warmup_steps)
    batches = api.training_batches(self.train_tokens, self.batch_size,
                                   self.seq_len, seed, self.pad_id)
    eval_steps = set(eval_steps)
    losses, evals, times = [], [], api.StepTimes()
    diverged_at = None
    wall = time.perf_counter()
    for step in range(steps):
      batch = next(batches)
      start = time.perf_counter()
      params, state, loss = compiled.step(
          params, state, batch, jnp.float32(schedule(step)))
      loss = float(loss)
      times.record(int(batch.attention_mask.sum()),
                   time.perf_counter() - start)
      losses.append(loss)
      if not math.isfinite(loss):
        diverged_at = step + 1
        break
      if self.eval_set is not None and step + 1 in eval_steps and (
          step + 1 < steps):
        evals.append({'step': step + 1, 'accuracy': self.evaluate(params)})
    accuracy = None
    if self.eval_set is not None:
      accuracy = 0.0 if diverged_at else self.evaluate(params)
      evals.append({'step': len(losses), 'accuracy': accuracy})
    self.last_params = params
    return {
        'variant': variant.label,
        'optimizer': variant.optimizer,
        'taco_k': variant.taco_k if variant.optimizer == 'taco' else None,
        'taco_mu': variant.taco_mu if variant.optimizer == 'taco' else None,
        'taco_update_topk': (variant.taco_update_topk
                             if variant.optimizer == 'taco' else None),
        'learning_rate': learning_rate,
        'seed': seed,
        'steps': steps,
        'warmup_steps': warmup_steps,
        'accuracy': accuracy,
        'evals': evals,
        'losses': losses,
        'diverged_at_step': diverged_at,
        'optimizer_state_bytes': state_bytes,
        'peak_memory_bytes': compiled.peak_memory_bytes,
        'peak_memory_source': compiled.peak_memory_source,
        'compile_seconds': compiled.compile_seconds,
        'tokens_per_second': times.tokens_per_second,
        'train_seconds': times.train_seconds,
        'wall_seconds': time.perf_counter() - wall,
    }


def layerwise_taco_peak(model, batch, hints) -> tuple[Optional[int], str]:
  """Compiled peak memory of the example's layer-wise TACO step."""
  schedule = api.linear_schedule(3e-5, 10, 1)
  trainer = api.LayerwiseTacoTrainer(
      model, api.optimizer('taco').build(schedule, hints))
  return api.peak_memory(trainer.compile(batch))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  values = np.asarray(values, np.float64)
  return float(values.mean()), float(values.std(ddof=1) if len(values) > 1
                                     else 0.0)


# Small models for the learning-rate transfer test.

@dataclasses.dataclass(frozen=True)
class CompactVocabulary:
  """A map from tokenizer ids to ``size`` model ids.

  Attributes:
    to_compact: ``int32[tokenizer vocabulary]``; ids outside the kept set map
      to ``size - 1``.
    size: model vocabulary size.
  """
  to_compact: np.ndarray
  size: int

  def ids(self, ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(i) for i in self.to_compact[np.asarray(ids, np.int64)])

  def example(self, example: api.TokenizedExample) -> api.TokenizedExample:
    return api.TokenizedExample(self.ids(example.prompt_ids),
                                self.ids(example.completion_ids))


def compact_vocabulary(examples: Sequence[api.TokenizedExample],
                       tokenizer_size: int, size: int,
                       always: Sequence[int] = ()) -> CompactVocabulary:
  """Keeps ``always`` and the most frequent ids of ``examples``."""
  counts = collections.Counter()
  for example in examples:
    counts.update(example.prompt_ids)
    counts.update(example.completion_ids)
  kept = list(dict.fromkeys(always))
  for token, _ in counts.most_common():
    if len(kept) >= size - 1:
      break
    if token not in kept:
      kept.append(token)
  to_compact = np.full((tokenizer_size,), size - 1, np.int32)
  to_compact[np.asarray(kept, np.int64)] = np.arange(len(kept))
  return CompactVocabulary(to_compact, size)


def compact_eval_set(eval_set, vocabulary: CompactVocabulary):
  return dataclasses.replace(
      eval_set, prompts=[vocabulary.ids(p) for p in eval_set.prompts],
      candidates=[[vocabulary.ids(c) for c in cands]
                  for cands in eval_set.candidates])


def language_modelling_examples(texts: Sequence[str], tokenizer,
                                vocabulary: CompactVocabulary
                                ) -> list[api.TokenizedExample]:
  """Whole texts as completions after the BOS prompt: loss on every token."""
  examples = []
  for text in texts:
    tokenized = api.tokenize(tokenizer, '', text)
    examples.append(vocabulary.example(tokenized))
  return examples


def small_config(width: int, vocab_size: int, *, num_layers: int,
                 head_dim: int, max_positions: int,
                 bos_token_id, eos_token_id) -> api.ModelConfig:
  """A Llama-style config of the family: only the width varies.

  Heads grow with the width at a fixed head size, the MLP is 8/3 wide (as in
  Llama, rounded to a multiple of 16), embeddings are tied (as in SmolLM2).
  """
  heads = max(width // head_dim, 1)
  return api.ModelConfig(
      family='llama', vocab_size=vocab_size, hidden_size=width,
      num_layers=num_layers, num_heads=heads, num_kv_heads=heads,
      head_dim=head_dim, intermediate_size=16 * round(width * 8 / 3 / 16),
      max_position_embeddings=max_positions, tie_word_embeddings=True,
      norm_eps=1e-5, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def new_model(config: api.ModelConfig, seed: int):
  return api.new_decoder(config, dtype=jnp.float32, remat=False, seed=seed)
