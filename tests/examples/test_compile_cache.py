"""Warm compiles: the CLI keeps what it compiles in JAX's persistent cache.

A run with an empty cache folder compiles its train step and saves it; the
same run again loads it from the folder; with ``--no-compilation-cache``
JAX keeps nothing. Whether the step came from the cache is what JAX's own
events said during its compile (``examples/finetune/compile_cache.py``), not
a timing.
"""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import compile_cache
from examples.finetune import flags
from examples.finetune import report
from taco_optax._src.kernels import cpu_kernel
from tests.support import tiny_llama


def _run(workspace, output_dir, *extra) -> dict:
  """One step of the tiny model, two held-out examples, no checkpoint."""
  args = tiny_llama.text_args(workspace, output_dir, '--no-checkpoint', *extra)
  for flag, value in (('--steps', '1'), ('--eval-every', '0'),
                      ('--eval-size', '2'), ('--eval-batch-size', '2')):
    args[args.index(flag) + 1] = value
  assert cli.main(args) == 0
  with open(output_dir / 'results.json') as f:
    return json.load(f)


def _entries(folder) -> list[str]:
  return sorted(name for name in os.listdir(folder)
                if name.endswith('-cache'))


def test_second_run_loads_the_train_step_from_the_cache(
    workspace, tmp_path, capsys):
  folder = tmp_path / 'jax-cache'
  before = jax.config.jax_compilation_cache_dir
  first = _run(workspace, tmp_path / 'first', '--compilation-cache-dir',
               str(folder))
  assert first['compilation_cache'] == {
      'directory': str(folder), 'train_step': 'miss', 'requests': 1,
      'hits': 0, 'writes': 1}
  assert any(name.startswith('jit_') for name in _entries(folder))
  assert (f'train step compiled (not in the cache), saved to {folder}'
          in capsys.readouterr().out)
  # The CLI leaves JAX's settings as it found them.
  assert jax.config.jax_compilation_cache_dir == before

  second = _run(workspace, tmp_path / 'second', '--compilation-cache-dir',
                str(folder))
  assert second['compilation_cache'] == {
      'directory': str(folder), 'train_step': 'hit', 'requests': 1,
      'hits': 1, 'writes': 0}
  assert (f'train step loaded from the cache in {folder}'
          in capsys.readouterr().out)
  assert second['losses'] == first['losses']
  assert second['peak_memory_bytes'] == first['peak_memory_bytes']


def test_no_compilation_cache_keeps_nothing(tmp_path):
  # What main() does around a run (the run itself is the test above's).
  folder = tmp_path / 'jax-cache'
  config = flags.from_command_line(['--no-compilation-cache',
                                    '--compilation-cache-dir', str(folder)])
  with compile_cache.used(config) as used:
    with compile_cache.Lookups() as lookups:
      jax.jit(lambda x: x * 3 + 1).lower(jnp.arange(5.0)).compile()
  assert used is None
  assert lookups.result.as_json() == {
      'directory': None, 'train_step': 'off', 'requests': 0, 'hits': 0,
      'writes': 0}
  assert report.compile_cache(lookups.result.as_json()) == (
      'off: train step compiled, nothing kept')
  assert not folder.exists()


def test_a_file_for_a_folder_is_refused(tmp_path, capsys):
  file = tmp_path / 'not-a-folder'
  file.write_text('')
  assert cli.main(['--compilation-cache-dir', str(file),
                   '--output-dir', str(tmp_path / 'never')]) == 2
  assert capsys.readouterr().err == (
      f'error: --compilation-cache-dir {file} is a file, not a folder\n')
  assert not (tmp_path / 'never').exists()


@pytest.mark.parametrize('variables', [
    {'TACO_OPTAX_CACHE_DIR': 'mine', 'XDG_CACHE_HOME': 'xdg'},
    {'XDG_CACHE_HOME': 'xdg'}, {}])
def test_default_folder_is_a_jax_folder_beside_the_kernel(
    tmp_path, monkeypatch, variables):
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  for name in ('TACO_OPTAX_CACHE_DIR', 'XDG_CACHE_HOME'):
    monkeypatch.delenv(name, raising=False)
  for name, value in variables.items():
    monkeypatch.setenv(name, str(tmp_path / value))
  assert compile_cache.default_dir() == str(cpu_kernel.cache_dir() / 'jax')
  assert compile_cache.directory(flags.RunConfig()) == str(
      cpu_kernel.cache_dir() / 'jax')
  assert compile_cache.directory(
      flags.RunConfig(compilation_cache=False)) is None


def test_help_says_how_to_turn_it_off_and_where_it_goes(capsys):
  with pytest.raises(SystemExit):
    flags.from_command_line(['--help'])
  text = ' '.join(capsys.readouterr().out.replace('│', ' ').split())
  assert '--no-compilation-cache JAX\'s persistent compilation cache' in text
  assert '(default: on)' in text
  assert '--compilation-cache-dir PATH' in text
  assert '~/.cache/taco_optax/jax. (default: None)' in text
  assert flags.from_command_line([
      '--no-compilation-cache', '--compilation-cache-dir', 'here']) == (
          flags.RunConfig(compilation_cache=False,
                          compilation_cache_dir='here'))


@pytest.mark.parametrize('shared_keys', [True, False])
def test_several_processes_compile_where_jax_keys_the_cache_per_process(
    tmp_path, monkeypatch, shared_keys):
  """jax 0.12 keys the cache per process, and a step one process loads hangs
  beside the one another compiles: there a run of several processes is off
  (tests/examples/test_multiprocess_cli.py runs one warm)."""
  monkeypatch.setattr(compile_cache, '_SHARED_KEYS', shared_keys)
  config = flags.RunConfig(compilation_cache_dir=str(tmp_path))
  assert compile_cache.directory(config) == str(tmp_path)
  assert compile_cache.directory(config, 1) == str(tmp_path)
  assert compile_cache.directory(config, 2) == (
      str(tmp_path) if shared_keys else None)
  assert compile_cache.directory(
      flags.RunConfig(compilation_cache=False), 2) is None

