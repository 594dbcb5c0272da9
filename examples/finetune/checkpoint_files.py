"""The files of one checkpoint: the manifest of their digests, JSON written
durably. :mod:`checkpoint` writes a manifest last and verifies it first."""

import hashlib
import json
import os
from typing import Any

MANIFEST = 'manifest.json'


class CheckpointError(ValueError):
  """A checkpoint is corrupt or does not match the run restoring it."""


def file_digests(root: str) -> dict[str, str]:
  digests = {}
  for folder, _, files in os.walk(root):
    for name in files:
      path = os.path.join(folder, name)
      relative = os.path.relpath(path, root)
      if relative == MANIFEST:
        continue
      digest = hashlib.sha256()
      with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
          digest.update(chunk)
      digests[relative] = digest.hexdigest()
  return digests


def write_json(path: str, value: Any):
  with open(path, 'w') as f:
    json.dump(value, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())


def verify_files(path: str):
  manifest_path = os.path.join(path, MANIFEST)
  if not os.path.exists(manifest_path):
    raise CheckpointError(f'Checkpoint {path} is corrupt: {MANIFEST} is '
                          'missing.')
  with open(manifest_path) as f:
    expected = json.load(f)
  found = file_digests(path)
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
