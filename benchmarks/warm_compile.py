"""The example's train-step compile, cold and from the persistent cache.

Runs ``python -m examples.finetune`` twice with the same arguments and one
fresh cache folder (``--compilation-cache-dir``): the first run compiles its
train step and saves it, the second (another ``--output-dir``) loads it. Each
run's ``results.json`` says how long the step took to compile
(``compile_seconds``: tracing, lowering and XLA's compile, or the cache's
load) and whether it came from the cache (``compilation_cache.train_step``:
``miss`` or ``hit``, counted from JAX's cache events). The last line is
``cold_compile_s=... warm_compile_s=... warm_over_cold=...``.

  python -m benchmarks.warm_compile [--write docs/measured/warm_compile.md]
      [-- EXAMPLE ARGS...]   (default: --steps 3 --eval-size 8)

The train step's program depends on the model, batch and sequence length,
not on ``--steps`` or ``--eval-size``, so the short runs compile the default
run's step.
"""

import argparse
import os
import subprocess
import sys
import tempfile

from benchmarks import provenance
from examples.finetune import api

DEFAULT_EXAMPLE_ARGS = ('--steps', '3', '--eval-size', '8')


def run_example(example_args, cache_dir, output_dir) -> api.RunResults:
  """One example run; its ``results.json``."""
  command = [sys.executable, '-m', 'examples.finetune', *example_args,
             '--compilation-cache-dir', cache_dir, '--output-dir', output_dir]
  subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
  return api.read_results(output_dir)


def rows(results):
  """``[(run, train step, compile s, wall s)]`` of the runs' results."""
  return [(name, r.compilation_cache['train_step'], r.compile_seconds,
           r.wall_seconds) for name, r in results.items()]


def table(results):
  """The printed table and last line of the runs' results."""
  lines = [f'{"run":<8}{"train step":>12}{"compile s":>11}{"wall s":>9}']
  lines += [f'{name:<8}{step:>12}{compile_s:>11.1f}{wall_s:>9.1f}'
            for name, step, compile_s, wall_s in rows(results)]
  cold, warm = results['cold'].compile_seconds, results['warm'].compile_seconds
  lines.append(f'cold_compile_s={cold:.1f} warm_compile_s={warm:.1f} '
               f'warm_over_cold={warm / cold:.3f}')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--write', metavar='PATH', default=None,
                      help='also write the output, with its provenance, as '
                      'Markdown')
  parser.add_argument('example_args', nargs='*',
                      help='arguments of python -m examples.finetune '
                      '(after --)')
  args = parser.parse_args(argv)
  example_args = tuple(args.example_args) or DEFAULT_EXAMPLE_ARGS

  def measure():
    with tempfile.TemporaryDirectory() as scratch:
      cache = os.path.join(scratch, 'cache')
      results = {name: run_example(example_args, cache,
                                   os.path.join(scratch, name))
                 for name in ('cold', 'warm')}
    print(f'python -m examples.finetune {" ".join(example_args)}, one fresh '
          'cache folder')
    print(table(results))

  text = provenance.captured(measure)
  if args.write:
    command = ' '.join(['python -m benchmarks.warm_compile']
                       + (sys.argv[1:] if argv is None else list(argv)))
    provenance.write_report(args.write, 'Warm compiles', command, text)


if __name__ == '__main__':
  main()
