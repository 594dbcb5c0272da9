"""A run's ``results.json``, typed: :class:`RunResults`.

The CLI writes one per run (:func:`loop.run`); :mod:`compare`, ``--eval-only``
and the benchmarks read it back with :meth:`RunResults.read`. The JSON keys
are the field names (and :class:`MasterWeightBytes`' inside
``master_weight_bytes``), in this order. A file written before a key existed
reads with that field ``None``.
"""

import dataclasses
import json
import os
from typing import Any, Mapping, Optional, Sequence

FILE_NAME = 'results.json'


@dataclasses.dataclass(frozen=True)
class MasterWeightBytes:
  """What float32 master weights add, measured from the shapes (0, 0 when
  the run keeps none)."""
  parameters: int
  state: int


@dataclasses.dataclass(frozen=True)
class RunResults:
  """What one fine-tuning run measured.

  Attributes:
    optimizer: ``--optimizer``.
    learning_rate: the schedule's peak rate.
    learning_rate_source: where that rate came from (``--lr`` or the rule).
    warmup_steps: the schedule's warm-up.
    model: the model file or directory trained.
    family: its architecture family.
    task: the task's name.
    metric: the headline score's name (a key of :attr:`before`).
    before: the held-out scores before training.
    after: the held-out scores after the last step.
    evals: ``{'step', scores...}`` of each evaluation during training.
    losses: every step's training loss.
    optimizer_state_bytes: the optimizer state's persistent bytes.
    parameter_bytes: the parameters' persistent bytes.
    rounding: how 16-bit updates landed (``stochastic``, ``nearest``,
      ``master``, or ``none`` in float32).
    compute_dtype: the computation dtype's name.
    parameter_dtype: the stored parameters' dtype name.
    master_weight_bytes: what float32 master weights add.
    updates_16bit: all that in words.
    landed_updates: with ``--measure-landed``, per group the updates that
      changed a weight, those made and the share (:mod:`landed`).
    peak_memory_bytes: the step's peak memory; ``peak_memory_source`` says
      whose figure (the device allocator's or the compiled step's estimate).
    peak_memory_source: see :attr:`peak_memory_bytes`.
    process_peak_rss_bytes: this process's peak resident set (loading,
      compiling and running), as ``top`` sees it.
    device_peak_bytes_in_use: the device allocator's peak, where kept.
    process_peak_rss_bytes_per_process: every process's peak RSS by index.
    tokens_per_second: steady state, every step but this process's first
      (:class:`report.StepTimes`).
    train_seconds: every step's time.
    compile_seconds: the train step's compile time.
    compilation_cache: the persistent cache's folder and the train step's
      verdict (``hit``, ``miss``, ``off``, ``unused``) with its lookups,
      hits and writes (:class:`compile_cache.Lookup`).
    wall_seconds: this process, start to end.
    step_path: the step that trained (the trainer's ``path``).
    mesh: the device mesh's axis sizes (``None``: one device).
    process_count: the processes of the run.
    objective: the training loss's name.
    resumed_from_step: the steps done before this process.
    backend: jax's default backend.
    config: the flags (:class:`flags.RunConfig` as a dictionary).
    exported_to: the exported model's directory (``None``: ``--no-export``).
    eval_split: the set :attr:`before`, :attr:`after` and :attr:`evals` are
      scored on (``--eval-split``): ``'test'``, the held-out set, or
      ``'validation'``; ``None`` in a file written before the flag existed,
      which scored the held-out set (:attr:`split`).
  """
  optimizer: str
  learning_rate: float
  learning_rate_source: str
  warmup_steps: int
  model: str
  family: str
  task: str
  metric: str
  before: Mapping[str, float]
  after: Mapping[str, float]
  evals: Sequence[Mapping[str, float]]
  losses: Sequence[float]
  optimizer_state_bytes: int
  parameter_bytes: int
  rounding: Optional[str] = None
  compute_dtype: Optional[str] = None
  parameter_dtype: Optional[str] = None
  master_weight_bytes: Optional[MasterWeightBytes] = None
  updates_16bit: Optional[str] = None
  landed_updates: Optional[Mapping[str, Any]] = None
  peak_memory_bytes: Optional[int] = None
  peak_memory_source: Optional[str] = None
  process_peak_rss_bytes: Optional[int] = None
  device_peak_bytes_in_use: Optional[int] = None
  process_peak_rss_bytes_per_process: Optional[Sequence[int]] = None
  tokens_per_second: Optional[float] = None
  train_seconds: Optional[float] = None
  compile_seconds: Optional[float] = None
  compilation_cache: Optional[Mapping[str, Any]] = None
  wall_seconds: Optional[float] = None
  step_path: Optional[str] = None
  mesh: Optional[Mapping[str, int]] = None
  process_count: Optional[int] = None
  objective: Optional[str] = None
  resumed_from_step: Optional[int] = None
  backend: Optional[str] = None
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  exported_to: Optional[str] = None
  eval_split: Optional[str] = None

  @property
  def split(self) -> str:
    """The set the scores are on; ``'test'`` for a file from before
    ``--eval-split``, when every run scored the held-out set."""
    return self.eval_split or 'test'

  @property
  def headline_before(self) -> float:
    """The headline score before training."""
    return self.before[self.metric]

  @property
  def headline_after(self) -> float:
    """The headline score after the last step."""
    return self.after[self.metric]

  def to_json(self) -> dict:
    """The ``results.json`` dictionary: one key per field, in order."""
    payload = {field.name: getattr(self, field.name)
               for field in dataclasses.fields(self)}
    if self.master_weight_bytes is not None:
      payload['master_weight_bytes'] = dataclasses.asdict(
          self.master_weight_bytes)
    return payload

  @classmethod
  def from_json(cls, payload: Mapping[str, Any]) -> 'RunResults':
    """The results of a ``results.json`` dictionary.

    Raises:
      ValueError: a key that no field holds, or a required one missing.
    """
    names = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(payload) - names)
    if unknown:
      raise ValueError(f'results.json: unknown key(s) {unknown}')
    values = dict(payload)
    if values.get('master_weight_bytes') is not None:
      values['master_weight_bytes'] = MasterWeightBytes(
          **values['master_weight_bytes'])
    try:
      return cls(**values)
    except TypeError as e:
      raise ValueError(f'results.json: {e}') from e

  @classmethod
  def read(cls, path: str) -> 'RunResults':
    """Reads ``path``: a ``results.json`` or the run directory holding one."""
    if os.path.isdir(path):
      path = os.path.join(path, FILE_NAME)
    with open(path, encoding='utf-8') as f:
      return cls.from_json(json.load(f))


def find(directory: str) -> Optional[RunResults]:
  """The results in ``directory``, or ``None`` when the run has none (yet)."""
  path = os.path.join(directory, FILE_NAME)
  return RunResults.read(path) if os.path.isfile(path) else None
