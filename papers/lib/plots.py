"""Figures of the reproductions (matplotlib, Agg backend, PNG files).

Example:
  >>> import numpy as np, tempfile, pathlib
  >>> from papers.lib import plots
  >>> p = pathlib.Path(tempfile.mkdtemp()) / 'c.png'
  >>> plots.curves({('a', 't'): np.ones(5)}, p, 'demo').name
  'c.png'
"""

from __future__ import annotations

import pathlib

import numpy as np

__all__ = ['curves', 'pyplot', 'save', 'smooth']


def pyplot():
  """matplotlib.pyplot with the file-only Agg backend."""
  import matplotlib

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt

  return plt


def save(fig, path: str | pathlib.Path) -> pathlib.Path:
  """Lays out `fig`, writes it to the PNG `path`, closes it; returns path."""
  fig.tight_layout()
  path = pathlib.Path(path)
  fig.savefig(path, dpi=90)
  pyplot().close(fig)
  return path


def smooth(y: np.ndarray, n: int = 20) -> np.ndarray:
  """Moving average of `y` over `n` points (at most a tenth of its length)."""
  n = max(1, min(n, len(y) // 10))
  return np.convolve(y, np.ones(n) / n, mode='valid')


def curves(
  data: dict[tuple[str, str], np.ndarray],
  path: str | pathlib.Path,
  title: str,
  log: bool = True,
) -> pathlib.Path:
  """One panel per task: the smoothed train-loss curve of every run.

  Args:
    data: (run, task) -> per-step train loss.
    path: the PNG to write.
    title: the figure title.
    log: log-scale loss axis.
  """
  plt = pyplot()
  task_names = list(dict.fromkeys(t for _, t in data))
  fig, axes = plt.subplots(
    1, len(task_names), figsize=(5.5 * len(task_names), 4), squeeze=False
  )
  for ax, t in zip(axes[0], task_names, strict=True):
    for (r, tt), y in data.items():
      if tt == t:
        ax.plot(smooth(np.asarray(y)), label=r)
    ax.set(title=t, xlabel='step', ylabel='train loss (smoothed)')
    if log:
      ax.set_yscale('log')
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  return save(fig, path)
