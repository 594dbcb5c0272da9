"""Checkpoints that resume bit-exactly, and refuse to resume wrongly.

A checkpoint is one directory per step::

  <directory>/step_00000100/
    state/           params, optimizer state (orbax)
    checkpoint.json  step, the run's settings, its history, the tree's layout
    manifest.json    SHA-256 of every other file, written last

A save is written to ``step_XXXXXXXX.partial`` and renamed into place only
when complete, so an interrupted save leaves no ``step_*`` directory and
:func:`latest` finds the newest complete one. A complete checkpoint whose
bytes changed is refused with a :class:`CheckpointError`, and so is one whose
tree layout (paths, shapes, dtypes) is not this run's; settings that differ
are listed by :func:`changed_settings`, one phrase per setting, for the
caller to refuse or accept.

Arrays are written by orbax/tensorstore in their own dtypes (float8 history
values included) and restored byte for byte, with the shardings of the
abstract state passed to :func:`restore`. Typed PRNG keys cannot be written:
store ``jax.random.key_data(key)`` and rebuild the key with
``jax.random.wrap_key_data``.

:class:`RunCheckpoints` is one training run's use of them: its settings
stored with every save and compared on resume, its history kept.
"""

import json
import os
import re
import shutil
from typing import Any, Mapping, NamedTuple, Optional

import jax
import orbax.checkpoint as ocp

from examples.finetune import checkpoint_files as files_lib
from examples.finetune import processes as processes_lib

_STEP_DIR = re.compile(r'^step_(\d{8,})$')
_PARTIAL = '.partial'
# 3: parameters stored by module path (``params/layers/0/attn/q/kernel``);
# 2: the layer-wise trainer's ``(outer, layers)`` pair by position.
FORMAT = 3
_READABLE_FORMATS = (2, FORMAT)
_STATE, _INFO, _MANIFEST = 'state', 'checkpoint.json', files_lib.MANIFEST


CheckpointError = files_lib.CheckpointError
# The manifest's digests (tests replace it).
_file_digests = files_lib.file_digests


class Checkpoint(NamedTuple):
  """A complete, verified checkpoint (its arrays not yet read).

  Attributes:
    path: its directory.
    step: the number of steps done when it was saved.
    metadata: the run's settings, as given to :func:`save`.
    history: what the run had recorded so far (losses, evaluations, ...).
    layout: ``[path, shape, dtype]`` of every saved array.
    format: the format it was written in (``2``: parameters by position;
      :func:`named_params` reads both).
  """
  path: str
  step: int
  metadata: dict[str, Any]
  history: dict[str, Any]
  layout: list[list[Any]]
  format: int = FORMAT


def _step_dir(directory: str, step: int) -> str:
  return os.path.join(directory, f'step_{step:08d}')


def complete_steps(directory: str) -> list[int]:
  """Steps with a complete checkpoint in ``directory``, ascending."""
  if not os.path.isdir(directory):
    return []
  steps = []
  for name in os.listdir(directory):
    match = _STEP_DIR.match(name)
    if match and os.path.isdir(os.path.join(directory, name)):
      steps.append(int(match.group(1)))
  return sorted(steps)


def _tree_layout(tree: Any) -> list[list[Any]]:
  """``[path, shape, dtype]`` of every leaf: what a restore must match."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [[jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)]
          for path, leaf in leaves]


def _json_normalized(value: Any) -> Any:
  return json.loads(json.dumps(value))


def _prune(directory: str, step: int, keep: Optional[int]):
  """Drops leftovers of interrupted saves, checkpoints after ``step`` (an
  abandoned trajectory: a fresh run in the same folder) and, if ``keep`` is
  set, all but the newest ``keep``."""
  for name in os.listdir(directory):
    if name.endswith(_PARTIAL) and _STEP_DIR.match(name[:-len(_PARTIAL)]):
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
  steps = complete_steps(directory)
  stale = [s for s in steps if s > step]
  if keep is not None:
    stale += [s for s in steps if s <= step][:-keep]
  for old in stale:
    shutil.rmtree(_step_dir(directory, old))


def save(directory: str, step: int, state_tree: Any,
         metadata: Mapping[str, Any], *,
         history: Optional[Mapping[str, Any]] = None,
         keep: Optional[int] = None) -> str:
  """Writes ``state_tree`` as the checkpoint of ``step``, atomically.

  Args:
    directory: folder holding the run's checkpoints (created if needed).
    step: the number of steps done; a later save of the same step replaces
      the earlier one, and checkpoints of later steps are deleted (they
      belong to a trajectory this one abandoned).
    state_tree: a pytree of arrays (sharded or not): params, optimizer state,
      RNG key data, ... Everything a resume needs.
    metadata: JSON-serialisable settings of the run that a resume compares
      with its own (model, ``k``, learning rate, ...).
    history: JSON-serialisable record of the run so far (losses, ...),
      handed back by :func:`latest` and not compared.
    keep: if set, delete all but the newest ``keep`` complete checkpoints.

  Returns:
    The checkpoint's directory.
  """
  directory = os.path.abspath(directory)
  final = _step_dir(directory, step)
  partial = final + _PARTIAL
  leader = jax.process_index() == 0
  if leader:
    os.makedirs(directory, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)  # an earlier interrupted try
  processes_lib.barrier('taco_checkpoint_start')
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(partial, _STATE), state_tree)
  checkpointer.wait_until_finished()
  checkpointer.close()
  if leader:
    files_lib.write_json(os.path.join(partial, _INFO), {
        'format': FORMAT,
        'step': int(step),
        'metadata': _json_normalized(dict(metadata)),
        'history': _json_normalized(dict(history or {})),
        'tree': _tree_layout(state_tree),
    })
    files_lib.write_json(os.path.join(partial, _MANIFEST),
                         _file_digests(partial))
    if os.path.exists(final):
      replaced = final + '.replaced'
      os.replace(final, replaced)
      os.replace(partial, final)
      shutil.rmtree(replaced)
    else:
      os.replace(partial, final)
    _prune(directory, step, keep)
  processes_lib.barrier('taco_checkpoint_done')
  return final


def latest(directory: str) -> Optional[Checkpoint]:
  """The newest complete checkpoint in ``directory``, its files verified.

  Reads only its JSON (settings, history, layout) and hashes its files; the
  arrays are read by :func:`restore`. Interrupted saves are ignored.

  Returns:
    The :class:`Checkpoint`, or ``None`` if there is none.

  Raises:
    CheckpointError: its files do not match its manifest, or it was written
      in another format.
  """
  directory = os.path.abspath(directory)
  steps = complete_steps(directory)
  if not steps:
    return None
  return read(_step_dir(directory, steps[-1]))


def is_checkpoint(path: str) -> bool:
  """Whether ``path`` is one checkpoint's directory (``step_N``)."""
  return os.path.isfile(os.path.join(path, _INFO))


def read(path: str) -> Checkpoint:
  """The checkpoint in directory ``path``, its files verified (see
  :func:`latest`); a format-2 one is read too (``Checkpoint.format``)."""
  path = os.path.abspath(path)
  files_lib.verify_files(path)
  with open(os.path.join(path, _INFO)) as f:
    info = json.load(f)
  if info.get('format') not in _READABLE_FORMATS:
    raise CheckpointError(f'Checkpoint {path} has format '
                          f'{info.get("format")!r}; expected {FORMAT}.')
  return Checkpoint(path, info['step'], info['metadata'], info['history'],
                    info['tree'], info['format'])


def named_params(checkpoint: Checkpoint, tree: Any) -> dict[str, Any]:
  """The parameters of a restored ``tree`` keyed by module path.

  Format 3 stores them so (``tree['params']``); format 2 stored the
  layer-wise trainer's ``(outer, layers)`` pair and ``nnx.Optimizer``'s
  ``(model, optimizer)`` pair by position, read here by that layout.
  """
  if checkpoint.format != 2:
    return tree['params']
  if 'params' in tree:  # the layer-wise trainer: (outer, layers)
    params = tree['params']
    outer, layers = params['0'] if isinstance(params, dict) else params[0], (
        params['1'] if isinstance(params, dict) else params[1])
    return {**outer, 'layers': layers}
  return tree['0'] if '0' in tree else tree[0]  # nnx: (model, optimizer)


def _shown(value: Any) -> str:
  if isinstance(value, bool):
    return 'on' if value else 'off'
  if value is None:
    return 'default'
  return str(value)


def changed_settings(stored: Mapping[str, Any],
                     current: Mapping[str, Any]) -> list[str]:
  """One phrase per setting of ``current`` that ``stored`` has otherwise.

  Keys are shown as they are, so name them as the user knows them, e.g.
  ``'--taco-k'`` gives ``'checkpoint has --taco-k 16, this run --taco-k 8'``.
  """
  current = _json_normalized(dict(current))
  return [f'checkpoint has {key} {_shown(stored.get(key, "<missing>"))}, '
          f'this run {key} {_shown(value)}'
          for key, value in current.items() if stored.get(key) != value]


def _check_layout(path: str, stored: list[list[Any]], abstract_state: Any):
  expected = _json_normalized(_tree_layout(abstract_state))
  if stored == expected:
    return
  stored_by_path = {entry[0]: entry[1:] for entry in stored}
  expected_by_path = {entry[0]: entry[1:] for entry in expected}
  only_stored = sorted(set(stored_by_path) - set(expected_by_path))
  only_expected = sorted(set(expected_by_path) - set(stored_by_path))
  changed = [
      f'{p}: checkpoint {stored_by_path[p][1]}{stored_by_path[p][0]}, this run '
      f'{expected_by_path[p][1]}{expected_by_path[p][0]}'
      for p in sorted(set(stored_by_path) & set(expected_by_path))
      if stored_by_path[p] != expected_by_path[p]]
  parts = []
  if changed:
    parts.append(f'{len(changed)} arrays differ ({"; ".join(changed[:3])})')
  if only_stored:
    parts.append(f'only in the checkpoint: {only_stored[:3]}')
  if only_expected:
    parts.append(f'only in this run: {only_expected[:3]}')
  if not parts:
    parts.append('the leaves are in another order')
  raise CheckpointError(
      f'Checkpoint {path} does not match this run\'s state (other model or '
      f'optimizer settings?): ' + '; '.join(parts) + '.')


def _as_abstract(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  return jax.ShapeDtypeStruct(x.shape, x.dtype,
                              sharding=getattr(x, 'sharding', None))


def restore(checkpoint: Checkpoint, abstract_state: Any = None) -> Any:
  """Reads the arrays of ``checkpoint``.

  Args:
    checkpoint: from :func:`latest`.
    abstract_state: a tree like the saved one of arrays or
      :class:`jax.ShapeDtypeStruct`; their shardings (if any) place the
      restored arrays, e.g. from ``taco_optax.state_shardings``. ``None``
      reads the tree whole onto this process's first device (any topology).

  Raises:
    CheckpointError: the tree layout differs from ``abstract_state``'s, or
      orbax cannot read it.
  """
  target = None
  if abstract_state is not None:
    _check_layout(checkpoint.path, checkpoint.layout, abstract_state)
    target = jax.tree.map(_as_abstract, abstract_state)
  checkpointer = ocp.StandardCheckpointer()
  try:
    if target is None:  # the saved shapes and dtypes, on one device
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      target = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
          checkpointer.metadata(os.path.join(checkpoint.path, _STATE)
                                ).item_metadata.tree)
    return checkpointer.restore(os.path.join(checkpoint.path, _STATE), target)
  except Exception as error:  # pylint: disable=broad-except
    raise CheckpointError(f'Checkpoint {checkpoint.path} could not be read: '
                          f'{error}') from error
  finally:
    checkpointer.close()


class RunCheckpoints:
  """The checkpoints of one training run: what it resumes from, what it saves.

  Every checkpoint stores the run's settings (what its trajectory depends
  on, named as the user knows them, e.g. ``'--taco-k'``) and its history
  (losses, evaluations, ...), so that a resume can refuse other settings and
  report the whole run.

  Args:
    directory: where the run's checkpoints go.
    settings: the settings known before anything heavy is done; more come
      through :meth:`check`.
    resume: continue from the newest checkpoint in ``directory``.
    allow_changes: on resume, accept (and log) settings that differ instead
      of refusing them.
    every: save every ``every`` steps (0: only when :meth:`save` is called
      otherwise: at the end of a run, when it is stopped).
    keep: complete checkpoints kept (the newest first).
    log: where an accepted change of settings is reported.

  Raises:
    CheckpointError: ``resume`` and there is no checkpoint, the newest one
      is corrupt, or its settings differ and ``allow_changes`` is not set.
  """

  def __init__(self, directory: str, settings: Mapping[str, Any], *,
               resume: bool, allow_changes: bool = False, every: int = 0,
               keep: int = 2, log=print):
    self.directory = os.path.abspath(directory)
    self.every, self._keep, self._log = every, keep, log
    self._allow_changes = allow_changes
    self.resumed_from = latest(self.directory) if resume else None
    if resume and self.resumed_from is None:
      raise CheckpointError(f'no checkpoint in {self.directory}')
    self.history = dict(self.resumed_from.history if resume else {})
    self._saved_any = False
    self._settings = {}
    self.check(settings)

  @property
  def start_step(self) -> int:
    return self.resumed_from.step if self.resumed_from else 0

  def check(self, settings: Mapping[str, Any]) -> None:
    """Adds ``settings``; refuses them if they differ from the resumed run's.
    """
    self._settings.update(_json_normalized(dict(settings)))
    if self.resumed_from is None:
      return
    changes = changed_settings(self.resumed_from.metadata, settings)
    if changes and not self._allow_changes:
      raise CheckpointError('; '.join(changes) + ' (pass '
                            '--resume-allow-changes to resume with this '
                            'run\'s settings)')
    if changes:
      self._log('resuming with changed settings: ' + '; '.join(changes))

  def restore(self, abstract_state: Any) -> Any:
    """The resumed checkpoint's arrays, placed like ``abstract_state``'s."""
    return restore(self.resumed_from, abstract_state)

  def due(self, step: int) -> bool:
    """Whether a periodic save falls on ``step``."""
    return bool(self.every) and step % self.every == 0

  def save(self, step: int, state_tree: Any,
           history: Mapping[str, Any]) -> str:
    """Saves ``step``; the first save of a fresh run drops any other run's.
    """
    self.history = dict(history)
    keep = self._keep if self._saved_any or self.resumed_from else 1
    self._saved_any = True
    return save(self.directory, step, state_tree, self._settings,
                history=self.history, keep=keep)

