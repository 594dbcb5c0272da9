"""Formatting helpers of the quality report: numbers, run lookups, plots."""

import os
from typing import Optional

import numpy as np

MIB = 2.0 ** 20


def load_average(session, when, meta=None) -> str:
  """A session's 1-minute load average at its ``start`` or ``end``."""
  load = session.get(f'load_average_at_{when}')
  if not load and meta is not None:  # Sessions before per-session records.
    load = meta.get(f'load_average_at_{when}')
  return 'n/a' if not load else f'{load[0]:.1f}'


def mib(n: Optional[float]) -> str:
  return 'n/a' if n is None else f'{n / MIB:,.1f}'


def pct(x: Optional[float]) -> str:
  return 'n/a' if x is None else f'{100 * x:.1f}'


def mean_std(values):
  values = [v for v in values if v is not None]
  if not values:
    return None, None
  return float(np.mean(values)), (float(np.std(values, ddof=1))
                                  if len(values) > 1 else 0.0)


def runs(data, **key):
  return [r for r in data['runs']
          if all(r.get(k) == v for k, v in key.items())]


def tail_loss(run):
  losses = run['losses']
  return float(np.mean(losses[-max(1, len(losses) // 4):]))


def plt():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save(fig, out_dir, name) -> str:
  path = os.path.join(out_dir, 'results', name)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt().close(fig)
  return f'results/{name}'


def variant_label(optimizer: str) -> str:
  """The label of an optimizer's default variant (TACO's names k, mu, r)."""
  from benchmarks import _quality_runs  # pylint: disable=g-import-not-at-top
  return _quality_runs.Variant(optimizer).label


def finish(axis, *, xlabel: str, ylabel: str, title: str,
           legend_size: Optional[int] = 8) -> None:
  """Labels, title, legend and grid of one report plot."""
  axis.set_xlabel(xlabel)
  axis.set_ylabel(ylabel)
  axis.set_title(title)
  axis.legend(fontsize=legend_size)
  axis.grid(alpha=0.3)


def image(fig, out_dir: str, name: str, alt: str) -> str:
  """Saves ``fig`` as ``results/name``; the markdown line that shows it."""
  return f'![{alt}]({save(fig, out_dir, name)})\n'
