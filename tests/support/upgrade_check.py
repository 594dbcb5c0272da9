"""The integration tests on the newest tunix, optax, flax and jax, one table.

  python -m tests.support.upgrade_check --tunix-source PATH [--tunix-commit SHA]
      [--layer-on .venv] [--envs DIR] [--rows release,...]
      [--write docs/tunix.md]

Builds one virtual environment per row and runs the integration tests in it:

* ``release``: the newest releases the package index serves of google-tunix,
  optax, flax and jax (taco_optax's own pins set aside);
* ``tunix-source``: the same, with tunix installed from ``--tunix-source`` (a
  copy of google/tunix's main, which no index serves);
* ``optax-floor``: the oldest optax the runtime pin allows, the rest newest.

Each environment is made fresh (``pip install -e ".[test]"``, then the row's
versions), which takes minutes; ``--layer-on VENV`` instead layers each row on
an existing environment (its site-packages on the path, the row's packages
installed over them without dependencies), which takes seconds. The table
(versions, tunix's commit, passed / failed / skipped per row) is printed, and
with ``--write`` it replaces the block between the markers in that page.
"""

import argparse
import datetime
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import xml.etree.ElementTree as ElementTree

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEWEST = ('jax', 'jaxlib', 'flax', 'optax', 'google-tunix')
OPTAX_FLOOR = '0.2.6'  # pyproject.toml: optax>=0.2.6,<0.2.9
TUNIX_TESTS = ('tests/test_tunix.py', 'tests/test_inject_routing.py',
               'tests/test_nnx_routing.py')
OPTAX_TESTS = ('tests/test_inject_routing.py', 'tests/test_nnx_routing.py',
               'tests/test_composability.py')
BEGIN, END = '<!-- upgrade-check: begin -->', '<!-- upgrade-check: end -->'
REPORTED = ('google-tunix', 'optax', 'flax', 'jax')


def _run(command, **kwargs):
  print('+', ' '.join(map(str, command)), flush=True)
  return subprocess.run(command, check=True, **kwargs)


def _python(env: pathlib.Path) -> pathlib.Path:
  return env / 'bin' / 'python'


def _make_env(env: pathlib.Path, layer_on: pathlib.Path | None) -> None:
  _run([sys.executable, '-m', 'venv', '--clear', env])
  if layer_on is None:
    _run([_python(env), '-m', 'pip', 'install', '-q', '-e', f'{ROOT}[test]'])
    return
  site = subprocess.run(
      [_python(layer_on), '-c', 'import sysconfig; '
       'print(sysconfig.get_paths()["purelib"])'],
      check=True, capture_output=True, text=True).stdout.strip()
  own = subprocess.run(
      [_python(env), '-c', 'import sysconfig; '
       'print(sysconfig.get_paths()["purelib"])'],
      check=True, capture_output=True, text=True).stdout.strip()
  # Processed after the row's own site-packages, so its packages come first.
  pathlib.Path(own, 'zz_layered_on.pth').write_text(
      f'import site; site.addsitedir({site!r})\n')


def _install(env: pathlib.Path, packages: list[str], layered: bool) -> None:
  """The row's packages; a source tree without its dependencies (tunix's
  main asks for ``jax[tpu]``, which would pull libtpu; the release's
  dependencies, installed first, are the same otherwise)."""
  sources = [p for p in packages if pathlib.Path(p).exists()]
  released = [p for p in packages if p not in sources]
  pip = [_python(env), '-m', 'pip', 'install', '-q', '--upgrade']
  _run(pip + (['--no-deps'] if layered else []) + released)
  if sources:
    _run(pip + ['--no-deps'] + sources)


def _versions(env: pathlib.Path) -> dict[str, str]:
  code = ('import importlib.metadata as m\n'
          f'for name in {REPORTED!r}:\n'
          '  print(name, m.version(name))\n')
  out = subprocess.run([_python(env), '-c', code], check=True,
                       capture_output=True, text=True).stdout
  return dict(line.split() for line in out.splitlines())


def _test(env: pathlib.Path, tests: tuple[str, ...],
          report: pathlib.Path) -> dict[str, int]:
  command = [_python(env), '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
             f'--junitxml={report}', *tests]
  if os.cpu_count() and os.cpu_count() > 1:
    command[4:4] = ['-n', str(min(os.cpu_count(), 4))]
  subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
  suite = ElementTree.parse(report).getroot()
  suite = suite if suite.tag == 'testsuite' else suite.find('testsuite')
  counts = {key: int(suite.get(key, 0))
            for key in ('tests', 'failures', 'errors', 'skipped')}
  counts['passed'] = (counts['tests'] - counts['failures'] - counts['errors']
                      - counts['skipped'])
  return counts


def _rows(args) -> list[tuple[str, list[str], tuple[str, ...]]]:
  rows = [('release', list(NEWEST), TUNIX_TESTS)]
  if args.tunix_source:
    rows.append(('tunix-source', [*NEWEST, str(args.tunix_source)],
                 TUNIX_TESTS))
  rows.append(('optax-floor', [*NEWEST[:-2], f'optax=={OPTAX_FLOOR}'],
               OPTAX_TESTS))
  return [row for row in rows if not args.rows or row[0] in args.rows]


def _table(results, args) -> str:
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
  if subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'],
                    cwd=ROOT, capture_output=True, text=True).stdout.strip():
    commit += ' with uncommitted changes'
  lines = [
      f'Written by `python -m tests.support.upgrade_check`. taco_optax commit '
      f'{commit or "unknown"}, {datetime.date.today()}, python '
      f'{sysconfig.get_python_version()}'
      + (', rows layered on an existing environment' if args.layer_on
         else ', fresh environments') + '.', '',
      '| row | google-tunix | optax | flax | jax | tests | passed | failed '
      '| skipped |',
      '|---|---|---|---|---|---|---:|---:|---:|']
  for name, versions, tests, counts in results:
    tunix = versions['google-tunix']
    if name == 'tunix-source' and args.tunix_commit:
      tunix += f' (main at {args.tunix_commit})'
    failed = counts['failures'] + counts['errors']
    lines.append(
        f'| {name} | {tunix} | {versions["optax"]} | {versions["flax"]} | '
        f'{versions["jax"]} | {", ".join(t.split("/")[-1] for t in tests)} '
        f'| {counts["passed"]} | {failed} | {counts["skipped"]} |')
  return '\n'.join(lines)


def _write(page: pathlib.Path, table: str) -> None:
  text = page.read_text()
  if BEGIN not in text or END not in text:
    raise SystemExit(f'{page} has no {BEGIN} ... {END} block to replace.')
  before, rest = text.split(BEGIN, 1)
  _, after = rest.split(END, 1)
  page.write_text(f'{before}{BEGIN}\n{table}\n{END}{after}')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--tunix-source', type=pathlib.Path,
                      help='a copy of google/tunix (its main) to install')
  parser.add_argument('--tunix-commit', help='its commit, for the table '
                      '(read with git when the copy is a work tree)')
  parser.add_argument('--layer-on', type=pathlib.Path,
                      help='an environment to layer each row on (fast)')
  parser.add_argument('--envs', type=pathlib.Path,
                      default=pathlib.Path(tempfile.gettempdir(),
                                           'taco-upgrade-check'))
  parser.add_argument('--rows', type=lambda text: text.split(','),
                      help='the rows to run (default: all), e.g. release')
  parser.add_argument('--write', type=pathlib.Path,
                      help='the page whose upgrade-check block to replace')
  args = parser.parse_args(argv)
  if args.tunix_source and not args.tunix_commit:
    args.tunix_commit = subprocess.run(
        ['git', 'rev-parse', '--short', 'HEAD'], cwd=args.tunix_source,
        capture_output=True, text=True).stdout.strip() or None
  results = []
  for name, packages, tests in _rows(args):
    env = args.envs / name
    _make_env(env, args.layer_on)
    _install(env, packages, layered=args.layer_on is not None)
    counts = _test(env, tests, args.envs / f'{name}.xml')
    results.append((name, _versions(env), tests, counts))
  table = _table(results, args)
  print(table)
  if args.write:
    _write(args.write, table)
  return 0 if all(c['failures'] + c['errors'] == 0
                  for *_, c in results) else 1


if __name__ == '__main__':
  sys.exit(main())
