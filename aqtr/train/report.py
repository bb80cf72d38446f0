"""The job's outputs: resolved config, metrics JSONL, loss plot, summary.

Files written in the output folder:

  config.txt      the resolved experiment, one line per leaf
                  (`aqtr.fiddle.to_text`), then each run's quantization
  config.json     the same experiment as Fiddle JSON (`aqtr.fiddle.dumps`;
                  rerun with --config=config_file:config.json)
  metrics.jsonl   one JSON object per line: train records {run, step,
                  train_loss, steps_per_s, time_s} and eval records {run,
                  step, val_loss, bpc | accuracy}
  loss.png        train and validation loss of every run (matplotlib, Agg)
  summary.md      the summary table (also printed); summary.json its rows
                  (with each run's 'status': 'ok' or why it diverged)
  INCOMPLETE      present while the job (top folder) or a run (its folder)
                  has not finished: an interrupted job leaves it behind

`prepare_out_dir` refuses a non-empty folder (stale results of an earlier
job would sit beside the new ones) unless asked to clear it.

Example:
  >>> from aqtr.train import report
  >>> rows = [{'run': 'float', 'val_loss': 2.0, 'bpc': 2.885}]
  >>> report.parse_table(report.table(rows, ['run', 'val_loss', 'bpc']))
  [{'run': 'float', 'val_loss': '2.0000', 'bpc': '2.8850'}]
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = [
  'INCOMPLETE',
  'Metrics',
  'OutDirError',
  'mark_incomplete',
  'parse_table',
  'plot',
  'prepare_out_dir',
  'table',
]

INCOMPLETE = 'INCOMPLETE'


class OutDirError(ValueError):
  """The output folder cannot be used; the message names it."""


def _is_job_output(path: pathlib.Path) -> bool:
  for name, start in (('config.txt', '# experiment'), (INCOMPLETE, 'aqtr')):
    f = path / name
    if f.is_file() and f.read_text(errors='replace').startswith(start):
      return True
  return False


def prepare_out_dir(
  path: str | pathlib.Path, overwrite: bool = False
) -> pathlib.Path:
  """Creates the output folder; a non-empty one only with `overwrite`.

  Args:
    path: the folder.
    overwrite: clear it first when it holds an earlier aqtr-train output
      (a folder with other content is never cleared).

  Returns:
    The folder, existing and empty.

  Raises:
    OutDirError: it is not empty (and not `overwrite`), or it cannot be
      created.
  """
  path = pathlib.Path(path)
  if path.is_dir() and any(path.iterdir()):
    if not overwrite:
      raise OutDirError(
        f'{path} is not empty (results of an earlier job?); pass '
        '--overwrite (overwrite=True) to replace them, or another folder.'
      )
    if not _is_job_output(path):
      raise OutDirError(
        f'{path} is not empty and holds no aqtr-train output; --overwrite '
        'only clears those: choose another folder.'
      )
    for child in path.iterdir():
      if child.is_dir() and not child.is_symlink():
        shutil.rmtree(child)
      else:
        child.unlink()
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise OutDirError(f'cannot create {path}: {e.strerror or e}') from e
  return path


def mark_incomplete(folder: pathlib.Path, what: str) -> pathlib.Path:
  """Writes `folder/INCOMPLETE` (remove it when `what` has finished)."""
  marker = folder / INCOMPLETE
  marker.write_text(
    f'aqtr-train: {what} has not finished (interrupted, or still '
    'running): the files here are partial.\n'
  )
  return marker


class Metrics:
  """Appends records to `metrics.jsonl`, one JSON object per line.

  Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / 'm.jsonl'
    >>> with Metrics(path) as m:
    ...   m.write({'run': 'float', 'step': 1, 'train_loss': 3.0})
    >>> path.read_text()
    '{"run": "float", "step": 1, "train_loss": 3.0}\\n'
  """

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    self._f: TextIO | None = None

  def __enter__(self) -> Metrics:
    self._f = self.path.open('w')
    return self

  def write(self, record: dict[str, Any]) -> None:
    """Writes one record and flushes (a crash keeps what was logged)."""
    self._f.write(json.dumps(record) + '\n')
    self._f.flush()

  def __exit__(self, *exc) -> None:
    self._f.close()


def _cell(value: Any, fmt: str) -> str:
  if isinstance(value, bool):
    return 'yes' if value else 'NO'
  if isinstance(value, float):
    return format(value, fmt)
  return '-' if value is None else str(value)


def table(
  rows: Sequence[dict[str, Any]],
  columns: Sequence[str],
  formats: dict[str, str] | None = None,
) -> str:
  """A Markdown table of `rows` restricted to `columns`.

  Args:
    rows: dicts keyed by column name.
    columns: the columns, in order.
    formats: float format per column (default '.4f'); booleans print as
      yes/NO and None as '-'.
  """
  formats = formats or {}
  cells = [
    [_cell(r.get(c), formats.get(c, '.4f')) for c in columns] for r in rows
  ]
  widths = [
    max([len(c)] + [len(row[i]) for row in cells])
    for i, c in enumerate(columns)
  ]

  def line(values):
    return (
      '| '
      + ' | '.join(
        v.ljust(w) if i == 0 else v.rjust(w)
        for i, (v, w) in enumerate(zip(values, widths, strict=True))
      )
      + ' |'
    )

  sep = '|' + '|'.join('-' * (w + 2) for w in widths) + '|'
  return '\n'.join([line(columns), sep] + [line(r) for r in cells])


def parse_table(text: str) -> list[dict[str, str]]:
  """The rows of the first Markdown table in `text`, as strings."""
  lines = [ln.strip() for ln in text.splitlines()]
  start = next(i for i, ln in enumerate(lines) if ln.startswith('|'))
  block = []
  for ln in lines[start:]:
    if not ln.startswith('|'):
      break
    block.append([c.strip() for c in ln.strip('|').split('|')])
  header, body = block[0], block[2:]
  return [dict(zip(header, row, strict=True)) for row in body]


def _finite(record: dict[str, Any], key: str) -> bool:
  value = record.get(key)
  return isinstance(value, int | float) and math.isfinite(value)


def _ema(values: list[float], alpha: float = 0.3) -> list[float]:
  out, acc = [], None
  for v in values:
    acc = v if acc is None else alpha * v + (1 - alpha) * acc
    out.append(acc)
  return out


def plot(
  records: Sequence[dict[str, Any]], path: str | pathlib.Path, title: str
) -> pathlib.Path:
  """Writes a PNG: train loss (smoothed) and validation loss per run.

  Args:
    records: metrics records (train records have 'train_loss', eval
      records 'val_loss'); non-finite values (a diverged run) are left out.
    path: the PNG file.
    title: the figure title.

  Returns:
    The path written.
  """
  import matplotlib

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt

  runs = list(dict.fromkeys(r['run'] for r in records))
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
  for i, run in enumerate(runs):
    color = f'C{i}'
    tr = [r for r in records if r['run'] == run and _finite(r, 'train_loss')]
    ev = [r for r in records if r['run'] == run and _finite(r, 'val_loss')]
    axes[0].plot(
      [r['step'] for r in tr],
      _ema([r['train_loss'] for r in tr]),
      color=color,
      label=run,
    )
    axes[1].plot(
      [r['step'] for r in ev],
      [r['val_loss'] for r in ev],
      color=color,
      marker='o',
      ms=3,
      label=run,
    )
  for ax, name in zip(
    axes, ('train loss (EMA)', 'validation loss'), strict=True
  ):
    ax.set_xlabel('step')
    ax.set_ylabel(f'{name}, nats')
    ax.grid(alpha=0.3)
    ax.legend()
  # Zoom on the end of training, where the runs differ.
  last = [
    r['val_loss'] for r in records if _finite(r, 'val_loss') and r['step']
  ]
  if last:
    axes[1].set_ylim(min(last) - 0.05, max(last) + 0.05)
  fig.suptitle(title)
  fig.tight_layout()
  path = pathlib.Path(path)
  fig.savefig(path)
  plt.close(fig)
  return path
