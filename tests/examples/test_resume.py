"""``--resume`` through the CLI: stop a run, resume it, get the same bits.

Run A trains ``STEPS`` steps in one go; run B is stopped by a real signal
after step ``STOP`` (SIGINT for TACO's layer-wise step, SIGTERM for AdamW),
then resumed with ``--resume``. Parameters, the whole optimizer state and
every loss of B must equal A's bit for bit.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import checkpoint
from examples.finetune import resume
from tests.support import tiny_llama
from tests.support.bitwise import assert_bitwise_equal

STEPS, STOP, EVERY = 6, 3, 2
_CHECKPOINTS = resume.CHECKPOINT_DIR


def _args(workspace, output_dir, optimizer, *extra):
  args = tiny_llama.text_args(workspace, output_dir, '--optimizer', optimizer,
                              '--checkpoint-every', str(EVERY), *extra)
  args[args.index('--steps') + 1] = str(STEPS)
  args[args.index('--eval-every') + 1] = '0'
  args.remove('--no-progress')  # the progress lines are checked below
  return args


def _command(args):
  return [sys.executable, '-m', 'examples.finetune', *args]


def _env(**extra):
  return {**os.environ, 'JAX_PLATFORMS': 'cpu', **extra}


def _run(args, **env):
  return subprocess.run(_command(args), cwd=tiny_llama.REPO_ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=_env(**env))


def _interrupt(args, signal_number):
  """Runs ``args``, sends ``signal_number`` once step ``STOP`` is done."""
  process = subprocess.Popen(
      _command(args), cwd=tiny_llama.REPO_ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True,
      env=_env(**{resume.PAUSE_AFTER_STEP_ENV: str(STOP)}))
  seen = []
  try:
    for line in process.stderr:
      seen.append(line)
      if line.startswith(f'paused after step {STOP}'):
        process.send_signal(signal_number)
        break
    stderr = ''.join(seen) + process.stderr.read()
    stdout = process.stdout.read()
    process.wait(timeout=300)
  finally:
    process.kill()
  return process.returncode, stdout, stderr


def _results(output_dir):
  with open(os.path.join(output_dir, 'results.json')) as f:
    return json.load(f)


def _state(output_dir, step=None):
  """The saved arrays of the newest (or ``step``'s) checkpoint."""
  directory = os.path.join(output_dir, _CHECKPOINTS)
  found = checkpoint.latest(directory)
  assert found is not None and found.step == (step or found.step)
  return found, checkpoint.restore(found)


def _dtypes(tree):
  return {np.asarray(leaf).dtype.name for leaf in jax.tree.leaves(tree)}


@pytest.mark.long
@pytest.mark.parametrize('optimizer, signal_number', [
    ('taco', signal.SIGINT), ('adamw', signal.SIGTERM)],
                         ids=['taco-SIGINT', 'adamw-SIGTERM'])
def test_interrupted_and_resumed_run_equals_uninterrupted_run(
    workspace, optimizer, signal_number):
  uninterrupted = workspace['root'] / f'resume-a-{optimizer}'
  assert cli.main(_args(workspace, uninterrupted, optimizer)) == 0

  interrupted = workspace['root'] / f'resume-b-{optimizer}'
  args = _args(workspace, interrupted, optimizer)
  code, stdout, stderr = _interrupt(args, signal_number)
  assert code == 128 + signal_number, stdout + stderr
  directory = os.path.join(interrupted, _CHECKPOINTS)
  assert (f'interrupted at step {STOP}/{STEPS}; checkpoint saved to '
          f'{os.path.join(os.path.abspath(directory), "step_00000003")}; '
          'resume with --resume') in stdout, stdout + stderr
  assert not os.path.exists(interrupted / 'results.json')
  assert checkpoint.complete_steps(directory) == [EVERY, STOP]
  _, at_stop = _state(interrupted, STOP)

  # A save that died half-way (its directory never renamed) is ignored.
  partial = os.path.join(directory, 'step_00000005.partial')
  shutil.copytree(os.path.join(directory, 'step_00000003'), partial)
  os.remove(os.path.join(partial, 'manifest.json'))

  resumed = _run(args + ['--resume'])
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert f'resumed from step {STOP}' in resumed.stdout
  # Progress counts global steps.
  assert f'step {STOP + 1}/{STEPS}:' in resumed.stderr, resumed.stderr
  assert f'step 1/{STEPS - STOP}' not in resumed.stderr
  assert sorted(os.listdir(directory)) == ['step_00000004', 'step_00000006']

  expected, actual = _results(uninterrupted), _results(interrupted)
  assert actual['resumed_from_step'] == STOP
  # The resumed run loaded its train step from the compilation cache the
  # runs before it filled (tests/examples/conftest.py), and the bits below
  # are those of a step compiled afresh.
  assert actual['compilation_cache']['train_step'] == 'hit', actual
  assert len(expected['losses']) == STEPS
  assert actual['losses'] == expected['losses']
  assert actual['before'] == expected['before']
  assert actual['after'] == expected['after']
  expected_checkpoint, expected_state = _state(uninterrupted, STEPS)
  actual_checkpoint, actual_state = _state(interrupted, STEPS)
  assert actual_checkpoint.metadata == expected_checkpoint.metadata
  assert_bitwise_equal(actual_state, expected_state)
  # The comparison covers the whole optimizer state, and it moved.
  kinds = {'taco': {'float8_e4m3fn', 'int32', 'int8', 'float32'},
           'adamw': {'float32', 'int32'}}[optimizer]
  assert kinds <= _dtypes(actual_state)
  changed = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(at_stop),
                             jax.tree.leaves(actual_state))]
  assert sum(changed) > len(changed) // 2


def _tree_digest(path) -> dict:
  """Every file under ``path`` with its SHA-256: what "untouched" means."""
  digests = {}
  for folder, _, files in os.walk(path):
    for name in files:
      with open(os.path.join(folder, name), 'rb') as f:
        digests[os.path.relpath(os.path.join(folder, name), path)] = (
            hashlib.sha256(f.read()).hexdigest())
  return digests


def _one_line_error(args, capsys) -> str:
  assert cli.main(args) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), lines
  return lines[0]


@pytest.mark.long
def test_changed_settings_are_refused_by_name(workspace, capsys):
  output_dir = workspace['root'] / 'resume-refusals'
  args = _args(workspace, output_dir, 'adamw', '--no-progress')
  args[args.index('--steps') + 1] = '2'
  assert cli.main(args) == 0
  capsys.readouterr()
  untouched = _tree_digest(output_dir)

  def refused(*changes):
    return _one_line_error(args + ['--resume', *changes], capsys)

  assert refused('--taco-k', '8') == (
      'error: --resume: checkpoint has --taco-k 16, this run --taco-k 8 '
      '(pass --resume-allow-changes to resume with this run\'s settings)')
  message = refused('--lr', '0.001', '--seed', '1')
  assert 'this run --lr 0.001' in message and 'this run --seed 1' in message
  assert 'checkpoint has --optimizer adamw, this run --optimizer taco' in (
      refused('--optimizer', 'taco'))
  # --steps is the total: the checkpoint is at step 2 of 2.
  assert 'nothing left' in refused()
  # With the flag the settings may change, but the state must still fit.
  assert 'does not match this run\'s state' in refused(
      '--resume-allow-changes', '--optimizer', 'taco', '--steps', '3')
  assert _tree_digest(output_dir) == untouched, 'a refusal wrote something'

  assert cli.main(args + ['--resume', '--resume-allow-changes',
                          '--steps', '3']) == 0
  log = capsys.readouterr().out
  assert 'checkpoint has --steps 2, this run --steps 3' in log
  assert _results(output_dir)['resumed_from_step'] == 2
  assert checkpoint.complete_steps(output_dir / _CHECKPOINTS)[-1] == 3


def test_resume_without_a_checkpoint_is_refused(workspace, capsys):
  output_dir = workspace['root'] / 'never-resumed'
  message = _one_line_error(
      _args(workspace, output_dir, 'taco', '--no-progress', '--resume'),
      capsys)
  assert message.startswith('error: --resume: no checkpoint in ')
  assert not output_dir.exists()


def test_stop_request_catches_a_signal_and_restores_handlers():
  before = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
  with resume.StopRequest() as stop:
    assert stop.signal_number is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signal_number == signal.SIGTERM
    assert (stop.exit_code, stop.name) == (143, 'SIGTERM')
    # A second signal gets the default handling (here: pytest's SIGINT).
    assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
  assert {n: signal.getsignal(n) for n in before} == before


# A value other than the run's for every setting a resume must keep: the
# words after the flag (the base run is test_changed_settings_are_refused's,
# AdamW, 2 steps). A RunConfig field is either free (resume._FREE_FIELDS) or
# listed here, so a new flag cannot slip past the resume check unnoticed.
_OTHER_VALUES = {
    'optimizer': ['taco'], 'lr': ['0.002'], 'steps': ['3'],
    'batch_size': ['4'], 'grad_accum': ['2'], 'seq_len': ['20'],
    'warmup_steps': ['1'], 'eval_size': ['5'], 'eval_split': ['validation'],
    'seed': ['7'],
    'model': ['{root}/other-model'], 'dtype': ['bfloat16'],
    'rounding': ['nearest'], 'measure_landed': [], 'remat': ['off'],
    'remat_policy': ['dots_saveable'], 'scan_layers': ['on'],
    'task': ['tweets'], 'train_file': ['{root}/other-train.jsonl'],
    'test_file': ['{root}/other-test.jsonl'], 'label_words': ['neg=no,pos=yes'],
    'template': ['{text}! It was'], 'max_new_tokens': ['3'],
    'objective': ['completion'], 'taco_k': ['8'], 'taco_mu': ['0.9'],
    'taco_step': ['optax'], 'mesh': ['data=1'],
}


def test_every_setting_that_must_match_is_listed():
  import dataclasses  # pylint: disable=g-import-not-at-top

  from examples.finetune import flags  # pylint: disable=g-import-not-at-top
  fields = {f.name for f in dataclasses.fields(flags.RunConfig)}
  checked = fields - resume._FREE_FIELDS  # pylint: disable=protected-access
  assert checked == set(_OTHER_VALUES), (
      'a setting a resume must keep has no test value (or a free one is '
      f'listed): {sorted(checked ^ set(_OTHER_VALUES))}')


def _with(args, flag, words):
  """``args`` with ``flag`` set to ``words`` (replaced, or appended)."""
  args = list(args)
  if flag in args:
    at = args.index(flag)
    del args[at:at + 2]
  return args + [flag, *words]


def test_resume_refuses_another_value_of_every_setting(workspace, capsys):
  from examples.finetune import flags  # pylint: disable=g-import-not-at-top
  output_dir = workspace['root'] / 'resume-every-setting'
  args = _args(workspace, output_dir, 'adamw', '--no-progress')
  args[args.index('--steps') + 1] = '2'
  assert cli.main(args) == 0
  capsys.readouterr()
  untouched = _tree_digest(output_dir)
  accepted = []
  for name, words in _OTHER_VALUES.items():
    flag = flags.flag(name)
    words = [w.replace('{root}', str(workspace['root'])) for w in words]
    changed = _with(args, flag, words) if words else args + [flag]
    if name == 'steps':  # the total: 3 would leave a step to train
      changed = _with(args, flag, ['3'])
    if cli.main(changed + ['--resume']) != 2:
      accepted.append(flag)
      continue
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: --resume: '), (
        flag, lines)
    assert f'checkpoint has {flag} ' in lines[0], (flag, lines[0])
  assert not accepted, f'resumed with another value of {accepted}'
  assert _tree_digest(output_dir) == untouched, 'a refusal wrote something'


def test_resume_refuses_other_training_data_under_the_same_name(
    workspace, capsys):
  train = workspace['root'] / 'resume-data.jsonl'
  shutil.copy(workspace['train'], train)
  output_dir = workspace['root'] / 'resume-data'
  args = _with(_args(workspace, output_dir, 'adamw', '--no-progress'),
               '--train-file', [str(train)])
  args = _with(_with(args, '--steps', ['3']), '--checkpoint-every', ['1'])
  assert cli.main(args) == 0
  capsys.readouterr()
  # The newest checkpoint left is step 2 of 3: a step is left to train.
  shutil.rmtree(output_dir / _CHECKPOINTS / 'step_00000003')
  with open(train, 'a') as f:
    f.write(json.dumps({'text': 'new day', 'label': 'pos'}) + '\n')
  message = _one_line_error(args + ['--resume'], capsys)
  assert 'training data' in message, message
