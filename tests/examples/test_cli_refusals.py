"""Careless flag values are refused before any model work, naming the flag.

Each case runs the CLI's ``main`` in an empty working directory: exit code
2, exactly one ``error:`` line on stderr naming the flag and its accepted
range, and nothing written there; two of them also as ``python -m
examples.finetune`` in a fresh process. The refusal comes from building the
``RunConfig``, before the model or data are read.
"""

import dataclasses
import os
import re
import subprocess
import sys
import typing

import docstring_parser
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import flags

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

_REFUSALS = [
    (['--lr', '-1'], '--lr must be a finite number > 0, got -1.0'),
    (['--lr', '0'], '--lr must be a finite number > 0, got 0.0'),
    (['--lr', 'nan'], '--lr must be a finite number > 0, got nan'),
    (['--lr', 'inf'], '--lr must be a finite number > 0, got inf'),
    (['--taco-k', '0'], '--taco-k must be an integer >= 1, got 0'),
    (['--taco-mu', '1.5'],
     '--taco-mu must be a finite number in [0, 1), got 1.5'),
    (['--taco-mu', 'nan'],
     '--taco-mu must be a finite number in [0, 1), got nan'),
    (['--eval-size', '0'], '--eval-size must be an integer >= 1, got 0'),
    (['--steps', '0'], '--steps must be an integer >= 1, got 0'),
    (['--batch-size', '-2'], '--batch-size must be an integer >= 1, got -2'),
]

_HELP = '; python -m examples.finetune --help lists the flags'
# Words no value comes from, and flags that do not exist.
_MALFORMED = [
    (['--steps', 'abc'], "--steps must be an integer, got 'abc'" + _HELP),
    (['--steps', '1e3'], "--steps must be an integer, got '1e3'" + _HELP),
    (['--lr', 'x'], "--lr must be a number, got 'x'" + _HELP),
    (['--warmup-steps', 'x'],
     "--warmup-steps must be an integer, got 'x'" + _HELP),
    (['--optimizer', 'sgd'],
     "--optimizer must be one of 'taco', 'adamw', 'adafactor', 'lion', "
     "'muon', 'sophia', 'galore', got 'sgd'" + _HELP),
    (['--optimizr', 'adamw'],
     'unknown flag(s): --optimizr, adamw (did you mean --optimizer?)' + _HELP),
    (['--remat', 'maybe'], "--remat: expected on or off, got 'maybe'" + _HELP),
    (['--steps'], '--steps needs a value' + _HELP),
]


@pytest.mark.parametrize('args,message', _REFUSALS + _MALFORMED,
                         ids=[' '.join(args) for args, _ in
                              _REFUSALS + _MALFORMED])
def test_refused_before_anything_is_written(tmp_path, monkeypatch, capsys,
                                            args, message):
  monkeypatch.chdir(tmp_path)
  assert cli.main(args) == 2
  out, err = capsys.readouterr()
  assert err.splitlines() == [f'error: {message}']
  assert out == ''
  assert not list(tmp_path.iterdir()), 'nothing may be written'


@pytest.mark.parametrize('args,message', [_REFUSALS[0], _MALFORMED[0]],
                         ids=['refused', 'malformed'])
def test_a_fresh_process_exits_2_with_one_line(tmp_path, args, message):
  # As a user meets it: the process's exit code and streams (the cases above
  # run the same main() in this process).
  process = subprocess.run(
      [sys.executable, '-m', 'examples.finetune', *args],
      cwd=tmp_path, capture_output=True, text=True, timeout=120,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': _REPO_ROOT})
  assert process.returncode == 2, process.stderr
  assert process.stderr.splitlines() == [f'error: {message}']
  assert process.stdout == ''
  assert not list(tmp_path.iterdir()), 'nothing may be written'


def _ranged_fields():
  """``(field name, int or float, Range)`` for every ranged field."""
  hints = typing.get_type_hints(flags.RunConfig, include_extras=True)
  for name, annotation in hints.items():
    if typing.get_origin(annotation) is not typing.Annotated:
      continue
    kind, *metadata = typing.get_args(annotation)
    kind = next(arg for arg in typing.get_args(kind) or (kind,)
                if arg is not type(None))
    for accepted in metadata:
      if isinstance(accepted, flags.Range):
        yield name, kind, accepted


def test_every_ranged_field_refuses_just_outside_its_bounds():
  checked = set()
  for name, kind, accepted in _ranged_fields():
    outside = '^' + re.escape(flags.flag(name)) + ' must be '
    for bound, is_open, away in ((accepted.low, accepted.low_open, -1),
                                 (accepted.high, accepted.high_open, 1)):
      if bound is None:
        continue
      edge = kind(bound)
      beyond = edge + away if kind is int else edge + away * 1e-3
      with pytest.raises(flags.FinetuneError, match=outside):
        flags.RunConfig(**{name: beyond})
      if is_open:
        with pytest.raises(flags.FinetuneError, match=outside):
          flags.RunConfig(**{name: edge})
      else:
        assert getattr(flags.RunConfig(**{name: edge}), name) == edge
      for not_finite in (float('nan'), float('inf')) if kind is float else ():
        with pytest.raises(flags.FinetuneError, match=outside):
          flags.RunConfig(**{name: not_finite})
    checked.add(name)
  assert checked >= {'lr', 'steps', 'batch_size', 'seq_len', 'warmup_steps',
                     'eval_every', 'eval_size', 'eval_batch_size', 'seed',
                     'max_new_tokens', 'taco_k', 'taco_mu', 'memory_limit_gb'}


@pytest.mark.parametrize('args,message', [
    (['--seed', '--lr', '1'], '--seed needs a value'),
    (['--steps', '1', '2'], "--steps takes one value, got '1 2'"),
    (['--no-progres'],
     'unknown flag(s): --no-progres (did you mean --no-progress?)'),
    (['--no-checkpint'],
     'unknown flag(s): --no-checkpint (did you mean --no-checkpoint?)'),
    # A switch that is on by default and has no --X of its own.
    (['--compilation-cache'], 'unknown flag(s): --compilation-cache (did '
     'you mean --no-compilation-cache?)'),
    (['--steps', 'abc', '--lr', '-1'], "--steps must be an integer, got "
     "'abc'"),  # words no value comes from before a value out of range
])
def test_words_a_flag_cannot_take_are_refused_naming_it(args, message):
  with pytest.raises(flags.FinetuneError) as error:
    flags.from_command_line(args)
  assert str(error.value) == message + _HELP


def test_choices_and_types_are_checked_for_python_callers():
  with pytest.raises(flags.FinetuneError) as error:
    flags.RunConfig(optimizer='sgd')
  assert str(error.value).startswith(
      "--optimizer must be one of taco, adamw, ")
  assert str(error.value).endswith(", got 'sgd'")
  with pytest.raises(flags.FinetuneError) as error:
    flags.RunConfig(steps=2.5)
  assert str(error.value) == '--steps must be an integer, got 2.5'
  with pytest.raises(flags.FinetuneError) as error:
    flags.RunConfig(taco_mu=1.0)
  assert str(error.value) == (
      '--taco-mu must be a finite number in [0, 1), got 1.0')
  assert flags.RunConfig(taco_mu=0.0).taco.mu == 0.0


def test_command_line_spells_the_documented_flags():
  config = flags.from_command_line([
      '--optimizer', 'adamw', '--lr', '1e-4', '--steps', '2',
      '--batch-size', '3', '--taco-k', '8', '--taco-mu', '0.9',
      '--eval-size', '8', '--remat', 'off', '--scan-layers', 'on',
      '--mesh', 'data=2', '--resume', '--no-checkpoint', '--no-progress'])
  assert config == flags.RunConfig(
      optimizer='adamw', lr=1e-4, steps=2, batch_size=3, taco_k=8,
      taco_mu=0.9, eval_size=8, remat=False, scan_layers=True, mesh='data=2',
      resume=True, save_checkpoint=False, progress=False)
  assert config.taco == flags.optimizers_lib.TacoSettings(k=8, mu=0.9)
  assert flags.from_command_line([]) == flags.RunConfig()


def test_help_documents_every_flag_with_its_default(capsys):
  with pytest.raises(SystemExit) as exit_info:
    flags.from_command_line(['--help'])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  documented = {param.arg_name: param.description for param in
                docstring_parser.parse(flags.RunConfig.__doc__).params}
  for field in dataclasses.fields(flags.RunConfig):
    assert documented.get(field.name), f'{field.name} has no docstring'
    # tyro keeps a line break before a line that starts with a non-letter.
    assert all(line[:1].isalpha()
               for line in documented[field.name].splitlines()), field.name
    assert flags.flag(field.name) in text
  fields = dataclasses.fields(flags.RunConfig)
  assert text.count('(default:') == len(fields)
