"""The example's public surface for scripts and benchmarks.

``benchmarks/`` reaches the fine-tuning example only through this module
(``tests/test_example_boundary.py`` checks it), so the example's modules may
be split, merged or renamed without breaking a benchmark, as long as these
names keep their meaning. Each one re-exports, or thinly wraps, a piece of the
example:

* the model: :class:`ModelConfig`, :func:`model_config`, :func:`new_decoder`,
  :func:`layered_model`, :func:`load_model`, :func:`smollm2_tokenizer`;
* the optimizers: :func:`optimizer` (an ``--optimizer`` entry: its builder
  and its learning-rate rule), :class:`TacoSettings`, :func:`decoder_hints`,
  :func:`linear_schedule` (the warm-up/decay schedule) and
  :func:`default_warmup` (its warm-up without ``--warmup-steps``);
* tasks, data and evaluation: :func:`task` (a ``--task`` entry of the one
  registry: its format, metric, labels and own records), :func:`tweets`,
  ``TWEETS_LABEL_WORDS`` (label -> scored completion of the tweets task),
  :func:`balanced_split`,
  :class:`TokenizedExample`, :func:`encode`, :func:`tokenize`,
  :func:`training_tokens`, :class:`Batch`, :class:`ChoiceBatch` (prompts
  scored over their candidate tokens), :func:`training_batches`,
  :func:`completion_loss`, :func:`held_out_set`, :func:`evaluate`;
* memory: :func:`tree_bytes`, ``GB`` (10**9 bytes, the planner's unit),
  :func:`plan_memory` (the predicted peak: a :class:`MemoryPlan`),
  :func:`plan_peaks` (a Hugging Face config's predicted peak per method),
  :func:`peak_memory` (a compiled step's), :class:`LayerwiseTacoTrainer`;
* meshes: ``BATCH_AXES``, :func:`make_mesh`, :func:`parse_mesh`,
  :func:`abstract_mesh`, :func:`with_shardings` (the sharding rule on
  abstract parameters), :func:`device_bytes`, :func:`plan_memory_on_mesh`
  (one device's predicted peak: a :class:`MemoryPlan`),
  :func:`plan_peaks_on_mesh` (per method),
  ``COLUMN_BLOCK_ELEMENTS`` (the layer-wise step's column blocks);
* results: :class:`RunResults` (a run's ``results.json``, typed) and
  :func:`read_results` (a run directory's, ``None`` before it finished);
* reports: :class:`StepTimes`, :func:`seed_summary` (mean and standard
  error over seeds), :func:`format_bytes`,
  :func:`write_json_atomic`;
* a whole CLI run: :func:`compile_first_step` (a :class:`CompiledRun`).
"""

import contextlib
import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

from flax import nnx
import jax

from examples.finetune import corpora
from examples.finetune import data as data_lib
from examples.finetune import evaluation as evaluation_lib
from examples.finetune import flags as flags_lib
from examples.finetune import losses as losses_lib
from examples.finetune import memory_plan
from examples.finetune import optimizers as optimizers_lib
from examples.finetune import preparation
from examples.finetune import report as report_lib
from examples.finetune import results as results_lib
from examples.finetune import seeds as seeds_lib
from examples.finetune import tasks as tasks_lib
from examples.finetune import trainers as trainers_lib
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import layered as layered_lib
from examples.finetune.model import sharding as sharding_lib

__all__ = [
    'Batch', 'ChoiceBatch', 'CompiledRun', 'GB', 'LayerwiseTacoTrainer',
    'MemoryPlan',
    'ModelConfig', 'StepTimes', 'TWEETS_LABEL_WORDS', 'TacoSettings',
    'TokenizedExample', 'balanced_split', 'compile_first_step',
    'BATCH_AXES', 'COLUMN_BLOCK_ELEMENTS', 'abstract_mesh',
    'device_bytes', 'make_mesh', 'parse_mesh', 'plan_memory_on_mesh',
    'seed_summary', 'with_shardings',
    'completion_loss', 'decoder_hints', 'encode', 'evaluate', 'format_bytes',
    'default_warmup', 'held_out_set', 'layered_model', 'linear_schedule',
    'load_model', 'task', 'RunResults', 'read_results', 'plan_peaks',
    'plan_peaks_on_mesh',
    'model_config', 'new_decoder', 'optimizer', 'peak_memory', 'plan_memory',
    'smollm2_tokenizer', 'tokenize', 'training_batches', 'training_tokens',
    'tree_bytes', 'tweets', 'write_json_atomic',
]

# The model.

ModelConfig = config_lib.ModelConfig
layered_model = layered_lib.layered_model
load_model = preparation.load_model


def model_config(hf_config, num_layers: Optional[int] = None) -> ModelConfig:
  """The :class:`ModelConfig` of a Hugging Face ``config.json`` dictionary,
  cut to ``num_layers`` layers when given."""
  config = ModelConfig.from_hf_config(hf_config)
  if num_layers is not None:
    config = dataclasses.replace(config, num_layers=num_layers)
  return config


def new_decoder(config: ModelConfig, *, dtype: Any, remat: bool = True,
                scan_layers: bool = False, seed: int = 0,
                abstract: bool = False) -> decoder_lib.DecoderLM:
  """A randomly initialised ``DecoderLM`` of ``config``.

  Args:
    config: the architecture.
    dtype: the parameters' and the computation's dtype.
    remat: recompute each block in the backward pass (``remat='block'``).
    scan_layers: stack the blocks for ``lax.scan``.
    seed: the initialisation's seed.
    abstract: only shapes (``nnx.eval_shape``): nothing is allocated.
  """
  build = lambda: decoder_lib.DecoderLM(
      config, dtype=dtype, param_dtype=dtype,
      remat='block' if remat else None, scan_layers=scan_layers,
      rngs=nnx.Rngs(seed))
  return nnx.eval_shape(build) if abstract else build()


def smollm2_tokenizer():
  """The tokenizer of the example's default model (SmolLM2-135M's GGUF),
  read from the file's metadata without loading its weights."""
  import gguf  # pylint: disable=g-import-not-at-top
  reader = gguf.GGUFReader(gguf_lib.smollm2_gguf_path())
  fields = {name: field.contents() for name, field in reader.fields.items()
            if name.startswith('tokenizer.')}
  return gguf_lib.gguf_tokenizer(fields)


# The optimizers.

TacoSettings = optimizers_lib.TacoSettings
decoder_hints = optimizers_lib.decoder_hints
linear_schedule = optimizers_lib.linear_schedule
default_warmup = preparation.default_warmup


def optimizer(name: str) -> optimizers_lib.OptimizerSpec:
  """The ``--optimizer`` entry ``name``: ``build(schedule, hints, taco)``,
  ``needs_loss``, and its default learning rate, ``default_rate(steps)``
  from ``rule`` (``reference``, ``steps_exponent``)."""
  return optimizers_lib.get(name)


# Data and evaluation.

def task(name: str) -> tasks_lib.Task:
  """The ``--task`` entry ``name`` (not ``text``, which the flags define):
  ``example(record)``, ``labels``, and for a task with its own records
  ``records()`` and ``split()``, the fixed train / held-out split."""
  return tasks_lib.TASKS[name]


TWEETS_LABEL_WORDS = tasks_lib.TWEETS_LABEL_WORDS
TokenizedExample = data_lib.TokenizedExample
Batch = data_lib.Batch
ChoiceBatch = data_lib.ChoiceBatch
balanced_split = corpora.balanced_split
encode = data_lib.encode
tokenize = data_lib.tokenize
training_batches = data_lib.training_batches
completion_loss = losses_lib.completion_loss
evaluate = evaluation_lib.evaluate


def tweets(test_per_class: int):
  """``(task, train records, held-out records)`` of the default tweets task,
  ``test_per_class`` held-out tweets of each label (a fixed split)."""
  tweets_task = dataclasses.replace(tasks_lib.TASKS['tweets'],
                                    test_per_class=test_per_class)
  return (tweets_task, *tweets_task.split())


def training_tokens(task, records, tokenizer) -> list[TokenizedExample]:
  """``records`` formatted by ``task`` and tokenised as training examples."""
  return [data_lib.tokenize(tokenizer, e.prompt, e.target)
          for e in map(task.example, records)]


def held_out_set(task, records, tokenizer) -> evaluation_lib.EvalSet:
  """``records`` formatted by ``task`` and tokenised for :func:`evaluate`."""
  return evaluation_lib.make_eval_set(
      task, [task.example(r) for r in records], tokenizer)


# Memory.

GB = memory_plan.GB
tree_bytes = memory_plan.tree_bytes
peak_memory = trainers_lib.peak_memory
LayerwiseTacoTrainer = trainers_lib.LayerwiseTacoTrainer


MemoryPlan = memory_plan.MemoryPlan
plan_memory = memory_plan.plan_memory
plan_peaks = memory_plan.plan


# Meshes.

BATCH_AXES = sharding_lib.BATCH_AXES
COLUMN_BLOCK_ELEMENTS = memory_plan.COLUMN_BLOCK_ELEMENTS
make_mesh = sharding_lib.make_mesh
parse_mesh = sharding_lib.parse_mesh
abstract_mesh = memory_plan.abstract_mesh
with_shardings = memory_plan.with_shardings
device_bytes = memory_plan.device_bytes


plan_memory_on_mesh = memory_plan.plan_memory_on_mesh
plan_peaks_on_mesh = memory_plan.plan_on_mesh


# Reports.

StepTimes = report_lib.StepTimes
seed_summary = seeds_lib.summary
RunResults = results_lib.RunResults
read_results = results_lib.find
format_bytes = report_lib.format_bytes
write_json_atomic = report_lib.write_json_atomic


# A whole CLI run.


class CompiledRun(NamedTuple):
  """A CLI run prepared and its train step compiled, not run.

  Attributes:
    compiled: the compiled train step (``memory_analysis()``, ``as_text()``).
    prepared: the run (``preparation.PreparedRun``: model, trainer, ...).
    mesh: the ``--mesh`` it was compiled on; ``None`` without one.
  """
  compiled: Any
  prepared: preparation.PreparedRun
  mesh: Optional[jax.sharding.Mesh]


def compile_first_step(words: Sequence[str],
                       log: Callable[[str], None] = lambda line: None
                       ) -> CompiledRun:
  """Prepares ``python -m examples.finetune WORDS`` and compiles its train
  step for its first batch, on its ``--mesh`` if it has one; nothing is
  trained. ``log`` receives the preparation's lines."""
  config = flags_lib.from_command_line(list(words))
  mesh = sharding_lib.make_mesh(config.mesh)
  with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
    prepared = preparation.prepare(config, log)
    batch = next(prepared.batches)
    if mesh:
      batch = sharding_lib.shard_batch(batch, mesh)
    compiled = prepared.trainer.compile(batch)
  return CompiledRun(compiled, prepared, mesh)
