"""A comparison: several DotGeneralConfigs trained on the same tasks.

`Comparison` is the experiment of a claim that compares configs (runs) on
one or more tasks (`papers.lib.tasks.Task`); it is configured as a
`fdl.Config(Comparison)` with the `--config` flags of `aqtr-train`
(`config:NAME`, `set:tasks['digits'].steps=100`,
`fiddler:add_run('int6', 'fully_quantized', fwd_bits=6, bwd_bits=6)`).
`run` trains every (run, task, seed), and returns one row per run: the
mean and spread of each task's metric over seeds, its ratio to the first
run, and whether serving from frozen weights equals training.

Example:
  >>> import aqtr
  >>> from papers.lib import compare, tasks
  >>> exp = compare.Comparison(
  ...   runs={'float': aqtr.presets.float()},
  ...   tasks={'t': tasks.Task(name='teacher', hidden=(8,), steps=3,
  ...                          train_size=64, val_size=16)})
  >>> rows, curves = compare.run(exp)
  >>> rows[0]['run'], sorted(curves)
  ('float', [('float', 't')])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import fiddle as fdl
import numpy as np

import aqtr
from aqtr import fiddle as aqtr_fiddle
from papers.lib import mlp, tasks

__all__ = ['Comparison', 'add_run', 'columns', 'run']


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
  """Runs (name -> DotGeneralConfig) x tasks (name -> Task).

  Attributes:
    runs: the configs, the first one is the reference of the ratios.
    tasks: the training settings.
    serve: freeze the weights and compare serving with training outputs
      (first task, first seed; one compile more per run).
  """

  runs: dict[str, aqtr.DotGeneralConfig] = dataclasses.field(
    default_factory=lambda: {'float': aqtr.presets.float()}
  )
  tasks: dict[str, tasks.Task] = dataclasses.field(
    default_factory=lambda: {'digits': tasks.Task()}
  )
  serve: bool = True

  def __post_init__(self):
    if not self.runs or not self.tasks:
      raise ValueError('Comparison.runs and .tasks must each have >= 1 entry.')
    for name, c in self.runs.items():
      if not isinstance(c, aqtr.DotGeneralConfig):
        raise TypeError(
          f'Comparison.runs[{name!r}] must be a DotGeneralConfig, got {c!r}.'
        )


def add_run(
  cfg: fdl.Config, name: str, preset: str, *args: Any, **kwargs: Any
) -> None:
  """Fiddler: adds run `name` = `aqtr.presets.<preset>(*args, **kwargs)`.

  The run's tree is fully expanded, so `set:runs['NAME'].fwd.lhs...` and
  the path fiddlers of `aqtr.fiddlers` reach every leaf.

  Example:
    >>> cfg = fdl.Config(Comparison, runs={})
    >>> add_run(cfg, 'int6', 'fully_quantized', fwd_bits=6, bwd_bits=6)
    >>> cfg.runs['int6'].fwd.lhs.numerics.bits
    6
  """
  runs = dict(cfg.runs) if isinstance(cfg.runs, dict) else {}
  runs[name] = aqtr_fiddle.config(preset, *args, **kwargs)
  cfg.runs = runs


def columns(exp: Comparison) -> list[str]:
  """The table's columns: per task metric, spread and ratio, serving."""
  cols = ['run']
  for name in exp.tasks:
    cols += [name, f'{name} sd', f'{name} / ref']
  return cols + (['serve==train', 'serve KB'] if exp.serve else [])


def run(
  exp: Comparison, progress=None
) -> tuple[list[dict[str, Any]], dict[tuple[str, str], np.ndarray]]:
  """Trains every run on every task and seed.

  Args:
    exp: the comparison.
    progress: called with a line of text after each (run, task).

  Returns:
    (rows, curves): one row per run keyed by `columns(exp)` (accuracy in
    %, MSE as is; serving is checked on the first task's first seed: one
    compile more per run), and the seed-averaged train-loss curve of each
    (run, task).
  """
  say = progress or (lambda s: None)
  data = {n: tasks.load(t) for n, t in exp.tasks.items()}
  rows, curves, ref = [], {}, {}
  for rname, config in exp.runs.items():
    row: dict[str, Any] = {'run': rname}
    equal, kb, first = None, None, exp.serve
    for tname, task in exp.tasks.items():
      rs = [
        mlp.run(task, config, s, data[tname], check_serving=first and i == 0)
        for i, s in enumerate(task.seeds)
      ]
      first = False
      scale = 100.0 if data[tname].metric == 'accuracy' else 1.0
      vals = np.array([r['metric'] for r in rs]) * scale
      row[tname] = float(vals.mean())
      row[f'{tname} sd'] = float(vals.std())
      ref.setdefault(tname, row[tname])
      row[f'{tname} / ref'] = row[tname] / ref[tname]
      curves[(rname, tname)] = np.mean([r['curve'] for r in rs], axis=0)
      if 'serve_equal' in rs[0]:
        equal, kb = rs[0]['serve_equal'], rs[0]['serve_bytes'] / 1024
      say(f'{rname} on {tname}: {row[tname]:.4g} (sd {row[f"{tname} sd"]:.2g})')
    if exp.serve:
      row['serve==train'], row['serve KB'] = equal, kb
    rows.append(row)
  return rows, curves
