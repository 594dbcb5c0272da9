"""What the CLI shows and keeps: phase lines when piped, one directory per run,
``examples.finetune.compare``, results.json's permissions."""

import os
import re
import subprocess
import sys

import test_cli  # pylint: disable=g-bad-import-order  (the tiny model, data)
from test_cli import workspace  # pylint: disable=unused-import,g-bad-import-order

_REPO_ROOT = test_cli._REPO_ROOT  # pylint: disable=protected-access


def _cli(args, cwd):
  """Runs the CLI with stdout and stderr piped (not terminals)."""
  return subprocess.run(
      [sys.executable, '-m', 'examples.finetune', *args], cwd=cwd,
      capture_output=True, text=True, timeout=600,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': _REPO_ROOT})


def test_piped_run_says_what_each_phase_does(workspace):
  output_dir = workspace['root'] / 'run-phases'
  # With progress on: piped, there must be no bar and still every phase line.
  args = test_cli._text_args(workspace, output_dir)  # pylint: disable=protected-access
  args.remove('--no-progress')
  process = _cli(args, _REPO_ROOT)
  assert process.returncode == 0, process.stderr
  out = process.stdout
  phases = [f'loading the model {workspace["model"]}',
            'tokenising 24 training and 6 held-out examples',
            'setting up taco',
            'evaluating 6 held-out examples',
            'compiling the train step']
  position = 0
  for phase in phases:
    start = out.index(f'{phase} ...\n', position)
    match = re.compile(re.escape(phase) + r': \d+\.\d s\n').search(out, start)
    assert match, (phase, out)
    position = match.end()
  # The evaluation after training has its own pair of lines.
  assert len(re.findall(r'evaluating 6 held-out examples: \d+\.\d s\n',
                        out)) == 2, out
  # Mid-run evaluations and checkpoint saves go beside the step lines.
  err = process.stderr
  assert 'evaluating 6 held-out examples ...' in err, err
  assert 'step 3: saving a checkpoint ...' in err, err
  assert re.search(r'step 3: checkpoint saved to \S+ \(\d+\.\d s\)', err), err
  assert '\x1b[' not in out + err, 'no terminal control codes in a pipe'
