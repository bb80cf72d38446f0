"""Equal-bytes width sweep: accuracy against model bytes per precision.

Abdolrashidi, Wang, Agrawal, Malkin, Tiwari, "Pareto-Optimal Quantized
ResNet Is Mostly 4-bit", 2021, arXiv:2105.03536: at a fixed model size,
a wider 4-bit network is more accurate than a narrower 8-bit or bf16 one.

Example:
  >>> import aqtr
  >>> from papers.lib.tasks import Task
  >>> p = Pareto(runs={'int8': aqtr.presets.int8()}, bits={'int8': 8},
  ...            widths=(4,), task=Task(steps=2))
  >>> p.width('int8', 4), p.weight_bytes('int8', 4)
  (4, 296.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import aqtr
from papers.lib import mlp, tasks

__all__ = ['Pareto', 'run']


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pareto:
  """Runs x widths at matched weight bytes.

  Attributes:
    runs: name -> DotGeneralConfig of every layer.
    bits: name -> bits per weight used to count its bytes.
    widths: hidden widths of an 8-bit model; a `b`-bit run is `8 / b` as
      wide.
    task: the training setting (its `hidden` is replaced by the width).
  """

  runs: dict[str, aqtr.DotGeneralConfig] = dataclasses.field(
    default_factory=lambda: {'int8': aqtr.presets.int8()}
  )
  bits: dict[str, int] = dataclasses.field(default_factory=lambda: {'int8': 8})
  widths: tuple[int, ...] = (4, 8, 16)
  task: tasks.Task = dataclasses.field(default_factory=tasks.Task)

  def __post_init__(self):
    if set(self.runs) != set(self.bits):
      raise ValueError(
        f'Pareto.bits must name every run: runs {sorted(self.runs)}, '
        f'bits {sorted(self.bits)}.'
      )
    if not self.widths or min(self.widths) < 1:
      raise ValueError(f'Pareto.widths must be >= 1, got {self.widths}.')
    for name, b in self.bits.items():
      if b not in (1, 2, 4, 8, 16, 32):
        raise ValueError(
          f'Pareto.bits[{name!r}] must be one of 1, 2, 4, 8, 16, 32, got {b}.'
        )

  def width(self, name: str, w8: int) -> int:
    """Hidden width of run `name` at the budget of an 8-bit width `w8`."""
    return max(1, w8 * 8 // self.bits[name])

  def weight_bytes(self, name: str, w8: int, d_in=64, d_out=10) -> float:
    """Weight bytes of run `name` at budget `w8` (biases not counted)."""
    w = self.width(name, w8)
    return (d_in + d_out) * w * self.bits[name] / 8


def run(exp: Pareto, progress=None) -> list[dict[str, Any]]:
  """Trains every (run, budget, seed); one row per (run, budget).

  Returns:
    Rows {'run', 'bits', 'width', 'weight KB', 'accuracy' (mean %),
    'sd'}.
  """
  say = progress or (lambda s: None)
  data = tasks.load(exp.task)
  d_in, d_out = data.x_train.shape[1], data.out_dim
  rows = []
  for name, config in exp.runs.items():
    for w8 in exp.widths:
      w = exp.width(name, w8)
      task = dataclasses.replace(exp.task, hidden=(w,))
      acc = np.array(
        [
          mlp.run(task, config, s, data, check_serving=False)['metric']
          for s in task.seeds
        ]
      )
      rows.append(
        {
          'run': name,
          'bits': exp.bits[name],
          'width': w,
          'weight KB': exp.weight_bytes(name, w8, d_in, d_out) / 1024,
          'accuracy': 100 * float(acc.mean()),
          'sd': 100 * float(acc.std()),
        }
      )
      say(f'{name} width {w}: {rows[-1]["accuracy"]:.2f}%')
  return rows
