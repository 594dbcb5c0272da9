"""Where a benchmark's figures come from: commit, date, machine, jax."""

import contextlib
import datetime
import io
import os
import subprocess
import sys

import jax


def commit() -> str:
  """The checked-out commit (short hash), ``unknown`` outside a git tree."""
  try:
    return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'],
                          capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return 'unknown'


def stamp() -> str:
  """``Commit abc1234, 2026-12-01, jax 0.x, <device>, N cores, load ...``."""
  load = ', '.join(f'{x:.1f}' for x in os.getloadavg())
  return (f'Commit {commit()}, {datetime.date.today().isoformat()}, jax '
          f'{jax.__version__}, {jax.devices()[0].device_kind}, '
          f'{os.cpu_count()} cores, load average {load}')


class Tee(io.StringIO):
  """Standard output that is also kept (for a script's ``--write``)."""

  def write(self, text):
    sys.__stdout__.write(text)
    return super().write(text)


def captured(run) -> str:
  """What ``run()`` prints, printed as it goes and returned."""
  output = Tee()
  with contextlib.redirect_stdout(output):
    run()
  return output.getvalue()


def write_report(path: str, title: str, command: str, text: str) -> None:
  """A script's printed ``text`` as Markdown, titled with its command and
  stamped with its provenance."""
  with open(path, 'w') as f:
    f.write(f'# {title} (written by `{command}`)\n\n{stamp()}.\n\n'
            f'```\n{text}```\n')
