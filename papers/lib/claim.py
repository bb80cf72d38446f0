"""What the claims' config.py and run.py share: tasks, outputs, runners.

A claim's `config.py` builds its experiment from `digits()` / `teacher()`
(the standard full-size tasks, overridable field by field); its `run.py`
is `comparison(cfg, out, title)` for a `compare.Comparison`, or its own
loop finished by `finish(out, cfg, report.table(rows, columns, formats))`.

Example:
  >>> digits(steps=7).steps, teacher().teacher_dims
  (7, (8, 32, 4))
"""

from __future__ import annotations

import pathlib
from typing import Any

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from aqtr.train import report
from papers.lib import cli, compare, plots
from papers.lib.tasks import Task

__all__ = ['FORMATS', 'comparison', 'digits', 'finish', 'teacher']

# Number formats of the Comparison table's columns.
FORMATS = {
  'digits': '.2f',
  'digits sd': '.2f',
  'digits / ref': '.4f',
  'teacher': '.3e',
  'teacher sd': '.1e',
  'teacher / ref': '.2f',
  'serve KB': '.1f',
}


def digits(**overrides: Any) -> fdl.Config:
  """The digits task at full size: MLP 64-256-256-10, 300 steps, 3 seeds."""
  kw = dict(name='digits', hidden=(256, 256), steps=300, seeds=(0, 1, 2))
  return fdl.Config(Task, **(kw | overrides))


def teacher(**overrides: Any) -> fdl.Config:
  """The teacher-student regression at full size: 8-32-4 tanh teacher,
  student 8-128-128-4, 2000 steps of 128, 3 seeds."""
  kw = dict(
    name='teacher',
    hidden=(128, 128),
    steps=2000,
    batch_size=128,
    teacher_dims=(8, 32, 4),
    train_size=8192,
    seeds=(0, 1, 2),
  )
  return fdl.Config(Task, **(kw | overrides))


def finish(
  out: str | pathlib.Path, cfg: fdl.Config, *tables: str, echo: bool = True
) -> str:
  """Writes results.md (the tables, e.g. `report.table(rows, columns,
  formats)`) and config.txt to `out`; prints and returns the text."""
  text = '\n\n'.join(tables)
  cli.write(pathlib.Path(out), cfg, text)
  if echo:
    print(text)
  return text


def comparison(
  cfg: fdl.Config, out: str | pathlib.Path, title: str, echo: bool = True
) -> list[dict[str, Any]]:
  """Runs a `compare.Comparison` config; writes table, curves and config.

  Returns:
    The rows of `compare.run`.
  """
  exp = aqtr_fiddle.build(cfg)
  rows, curves = compare.run(exp, progress=print if echo else None)
  finish(out, cfg, report.table(rows, compare.columns(exp), FORMATS), echo=echo)
  plots.curves(curves, pathlib.Path(out) / 'results.png', title)
  return rows
