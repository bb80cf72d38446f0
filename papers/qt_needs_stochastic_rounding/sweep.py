"""Quantized training (no float master copy): rounding x learning rate.

Every run trains the digits MLP of `papers.lib.mlp` with the same Adam
schedule; a run with `weights` stores every weight only in that
`aqtr.qt.WeightFormat` and re-quantizes it after each step with
`rounding` (`aqtr.qt.quantized_training`). An update smaller than half a
quantization step is lost under round-to-nearest; stochastic rounding
keeps it in expectation (Gupta et al. 2015, arXiv:1502.02551).

Example:
  >>> from aqtr import qt
  >>> from papers.lib.tasks import Task
  >>> s = RoundingSweep(runs={'int8_sr': QtRun(weights=qt.int8())},
  ...                   learning_rates=(1e-3,), task=Task(steps=2))
  >>> s.column(1e-3), s.runs['int8_sr'].label
  ('lr 0.001', 'int8 / stochastic')
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

import aqtr
from aqtr import qt
from papers.lib import mlp, tasks

__all__ = ['QtRun', 'RoundingSweep', 'run']

ROUNDINGS = ('stochastic', 'nearest')


@dataclasses.dataclass(frozen=True, kw_only=True)
class QtRun:
  """How a run stores its weights.

  Attributes:
    weights: the `aqtr.qt.WeightFormat` of every weight (no float copy),
      or None for float weights (the reference).
    rounding: of each step's re-quantization, 'stochastic' or 'nearest'.
  """

  weights: qt.WeightFormat | None = None
  rounding: str = 'stochastic'

  def __post_init__(self):
    if self.rounding not in ROUNDINGS:
      raise ValueError(
        f'QtRun.rounding must be one of {ROUNDINGS}, got {self.rounding!r}.'
      )
    if self.weights is not None and not isinstance(
      self.weights, qt.WeightFormat
    ):
      raise TypeError(
        f'QtRun.weights must be an aqtr.qt.WeightFormat or None, got '
        f'{self.weights!r}.'
      )

  @property
  def label(self) -> str:
    if self.weights is None:
      return 'float'
    return f'{self.weights.kind} / {self.rounding}'


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundingSweep:
  """Runs x learning rates on one task.

  Attributes:
    runs: name -> QtRun; the first is the reference (float).
    learning_rates: peak Adam learning rates, each > 0.
    task: the training setting (its learning_rate is replaced).
  """

  runs: dict[str, QtRun] = dataclasses.field(
    default_factory=lambda: {'float': QtRun()}
  )
  learning_rates: tuple[float, ...] = (1e-3, 3e-4, 1e-4)
  task: tasks.Task = dataclasses.field(default_factory=tasks.Task)

  def __post_init__(self):
    if not self.runs:
      raise ValueError('RoundingSweep.runs must have >= 1 entry.')
    if not self.learning_rates or min(self.learning_rates) <= 0:
      raise ValueError(
        'RoundingSweep.learning_rates must be >= 1 positive rates, got '
        f'{self.learning_rates}.'
      )

  def column(self, lr: float) -> str:
    """The table column of learning rate `lr`."""
    return f'lr {lr:g}'


def weight_bytes(task: tasks.Task, r: QtRun, data: tasks.Data) -> int:
  """Bytes of the stored parameters (values, scales and float biases)."""
  sizes = (data.x_train.shape[1], *task.hidden, data.out_dim)
  params = mlp.init(jax.random.key(0), sizes)
  if r.weights is not None:
    params = mlp.quantize_weights(params, r.weights)
  return qt.tree_bytes(params)


def run(
  exp: RoundingSweep, progress=None
) -> tuple[list[dict[str, Any]], dict[tuple[str, str], np.ndarray]]:
  """Trains every (run, learning rate, seed); one compile per run.

  Returns:
    (rows, curves): one row per run {'run', 'weights', 'params KB',
    'lr <rate>' (mean validation accuracy, %), 'sd <rate>'}, and the
    seed-averaged train-loss curve of each (run, 'lr <rate>').
  """
  say = progress or (lambda s: None)
  data = tasks.load(exp.task)
  float_cfg = aqtr.presets.float()
  rows, curves = [], {}
  for name, r in exp.runs.items():
    row: dict[str, Any] = {
      'run': name,
      'weights': r.label,
      'params KB': weight_bytes(exp.task, r, data) / 1024,
    }
    for lr in exp.learning_rates:
      task = dataclasses.replace(exp.task, learning_rate=lr)
      rs = [
        mlp.run(
          task,
          float_cfg,
          s,
          data,
          check_serving=False,
          weights=r.weights,
          rounding=r.rounding,
          trace_lr=True,
        )
        for s in task.seeds
      ]
      acc = 100 * np.array([x['metric'] for x in rs])
      col = exp.column(lr)
      row[col], row[f'sd {lr:g}'] = float(acc.mean()), float(acc.std())
      curves[(name, col)] = np.mean([x['curve'] for x in rs], axis=0)
      say(f'{name} at {col}: {row[col]:.2f}%')
    rows.append(row)
  return rows, curves
