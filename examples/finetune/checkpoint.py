"""Checkpoints that resume bit-exactly, and refuse to resume wrongly.

A checkpoint is one directory per step::

  <directory>/step_00000100/
    state/           params, optimizer state, data position, RNG (orbax)
    checkpoint.json  step, run metadata (model, k, ...), the tree's layout
    manifest.json    SHA-256 of every other file, written last

A save is written to ``step_XXXXXXXX.partial`` and renamed into place only
when complete, so an interrupted save leaves no ``step_*`` directory and
:func:`restore_latest` uses the latest complete one. A complete checkpoint
whose bytes changed, or that belongs to another run (other model, other
``k``, other tree layout), is refused with a :class:`CheckpointError` rather
than restored.

Arrays are written by orbax/tensorstore in their own dtypes (float8 history
values included) and restored byte for byte, with the shardings of the
abstract state passed to :func:`restore_latest`. Typed PRNG keys cannot be
written: store ``jax.random.key_data(key)`` and rebuild the key with
``jax.random.wrap_key_data``.
"""

import hashlib
import json
import os
import re
import shutil
from typing import Any, Mapping, Optional

import jax
import orbax.checkpoint as ocp

_STEP_DIR = re.compile(r'^step_(\d{8,})$')
_PARTIAL = '.partial'
_FORMAT = 1
_STATE, _INFO, _MANIFEST = 'state', 'checkpoint.json', 'manifest.json'


class CheckpointError(ValueError):
  """A checkpoint is corrupt or does not match the run restoring it."""


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


def _file_digests(root: str) -> dict[str, str]:
  digests = {}
  for folder, _, files in os.walk(root):
    for name in files:
      path = os.path.join(folder, name)
      relative = os.path.relpath(path, root)
      if relative == _MANIFEST:
        continue
      digest = hashlib.sha256()
      with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
          digest.update(chunk)
      digests[relative] = digest.hexdigest()
  return digests


def _write_json(path: str, value: Any):
  with open(path, 'w') as f:
    json.dump(value, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())


def _sync_processes(name: str):
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def save(directory: str, step: int, state_tree: Any,
         metadata: Mapping[str, Any], *, keep: Optional[int] = None) -> str:
  """Writes ``state_tree`` as the checkpoint of ``step``.

  Args:
    directory: folder holding the run's checkpoints (created if needed).
    step: the number of steps done; a later save of the same step replaces
      the earlier one.
    state_tree: a pytree of arrays (sharded or not): params, optimizer state,
      data position, RNG key data, ... Everything a resume needs.
    metadata: JSON-serialisable facts about the run that a resume must match
      (model name, ``k``, learning rate, ...).
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
  _sync_processes('taco_checkpoint_start')
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(partial, _STATE), state_tree)
  checkpointer.wait_until_finished()
  checkpointer.close()
  if leader:
    _write_json(os.path.join(partial, _INFO), {
        'format': _FORMAT,
        'step': int(step),
        'metadata': _json_normalized(dict(metadata)),
        'tree': _tree_layout(state_tree),
    })
    _write_json(os.path.join(partial, _MANIFEST), _file_digests(partial))
    if os.path.exists(final):
      replaced = final + '.replaced'
      os.replace(final, replaced)
      os.replace(partial, final)
      shutil.rmtree(replaced)
    else:
      os.replace(partial, final)
    if keep is not None:
      for old in complete_steps(directory)[:-keep]:
        shutil.rmtree(_step_dir(directory, old))
  _sync_processes('taco_checkpoint_done')
  return final


def _verify_files(path: str):
  manifest_path = os.path.join(path, _MANIFEST)
  if not os.path.exists(manifest_path):
    raise CheckpointError(f'Checkpoint {path} is corrupt: {_MANIFEST} is '
                          'missing.')
  with open(manifest_path) as f:
    expected = json.load(f)
  found = _file_digests(path)
  missing = sorted(set(expected) - set(found))
  changed = sorted(name for name in expected
                   if name in found and found[name] != expected[name])
  if missing or changed:
    raise CheckpointError(
        f'Checkpoint {path} is corrupt: '
        + (f'missing files {missing[:5]}' if missing else '')
        + ('; ' if missing and changed else '')
        + (f'contents changed in {changed[:5]}' if changed else '')
        + '. Delete it to resume from an earlier checkpoint.')


def _check_metadata(path: str, stored: Mapping[str, Any],
                    expected: Mapping[str, Any]):
  expected = _json_normalized(dict(expected))
  different = [
      f'{key}: checkpoint has {stored.get(key, "<missing>")!r}, this run '
      f'has {value!r}'
      for key, value in sorted(expected.items()) if stored.get(key) != value]
  if different:
    raise CheckpointError(
        f'Checkpoint {path} belongs to another run: ' + '; '.join(different)
        + '.')


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


def restore_latest(directory: str, abstract_state: Any,
                   expected_metadata: Mapping[str, Any]
                   ) -> Optional[tuple[int, Any, dict[str, Any]]]:
  """Restores the newest complete checkpoint in ``directory``.

  Args:
    directory: the folder given to :func:`save`.
    abstract_state: a tree like the saved ``state_tree`` of arrays or
      :class:`jax.ShapeDtypeStruct`; their shardings (if any) place the
      restored arrays, e.g. from ``taco_optax.state_shardings``.
    expected_metadata: every key must equal the saved metadata's value.

  Returns:
    ``(step, state, metadata)``, or ``None`` if there is no complete
    checkpoint (interrupted saves are ignored).

  Raises:
    CheckpointError: the newest checkpoint is corrupt, or its metadata or
      tree layout (paths, shapes, dtypes) differs from this run's.
  """
  directory = os.path.abspath(directory)
  steps = complete_steps(directory)
  if not steps:
    return None
  path = _step_dir(directory, steps[-1])
  _verify_files(path)
  with open(os.path.join(path, _INFO)) as f:
    info = json.load(f)
  if info.get('format') != _FORMAT:
    raise CheckpointError(f'Checkpoint {path} has format '
                          f'{info.get("format")!r}; expected {_FORMAT}.')
  _check_metadata(path, info['metadata'], expected_metadata)
  _check_layout(path, info['tree'], abstract_state)
  checkpointer = ocp.StandardCheckpointer()
  try:
    state = checkpointer.restore(os.path.join(path, _STATE),
                                 jax.tree.map(_as_abstract, abstract_state))
  except Exception as error:  # pylint: disable=broad-except
    raise CheckpointError(f'Checkpoint {path} could not be read: '
                          f'{error}') from error
  finally:
    checkpointer.close()
  return info['step'], state, info['metadata']
