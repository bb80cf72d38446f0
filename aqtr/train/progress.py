"""A progress bar with loss and throughput (rich, or plain lines without it).

The bar writes to stderr so that stdout keeps only the job's report.

Example:
  >>> from aqtr.train import progress
  >>> with progress.Bar('int8', total=10, unit='tok', enabled=False) as bar:
  ...   bar.update(10, loss=1.5, steps_per_s=3.0, items_per_s=300.0)
"""

from __future__ import annotations

import sys
import time

__all__ = ['Bar']


class Bar:
  """One run's progress: steps done, latest loss, steps/s, items/s.

  Args:
    name: the run's name (shown left of the bar).
    total: number of steps.
    unit: what `items_per_s` counts ('tok', 'img').
    enabled: False shows nothing (tests, quiet mode).
  """

  def __init__(self, name: str, total: int, unit: str, enabled: bool = True):
    self.name, self.total, self.unit, self.enabled = name, total, unit, enabled
    self._rich = None
    self._last_print = 0.0

  def __enter__(self) -> Bar:
    if not self.enabled:
      return self
    try:
      from rich.console import Console
      from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
      )
    except ImportError:
      return self
    self._rich = Progress(
      TextColumn('{task.description:<8}'),
      BarColumn(bar_width=20),
      MofNCompleteColumn(),
      TextColumn('{task.fields[loss]}'),
      TextColumn('{task.fields[speed]}'),
      TimeElapsedColumn(),
      console=Console(stderr=True),
    )
    self._rich.start()
    self._task = self._rich.add_task(
      self.name, total=self.total, loss='-', speed=''
    )
    return self

  def status(self, text: str) -> None:
    """Shows `text` (e.g. 'compiling') where the loss goes."""
    if self._rich is not None:
      self._rich.update(self._task, loss=text)
    elif self.enabled:
      print(f'{self.name}: {text}', file=sys.stderr, flush=True)

  def update(
    self, step: int, *, loss: float, steps_per_s: float, items_per_s: float
  ) -> None:
    """Shows `step` steps done with the latest loss and throughput."""
    if not self.enabled:
      return
    speed = f'{steps_per_s:.2f} steps/s {items_per_s:,.0f} {self.unit}/s'
    if self._rich is not None:
      self._rich.update(
        self._task, completed=step, loss=f'loss {loss:.4f}', speed=speed
      )
      return
    now = time.monotonic()
    if now - self._last_print > 5 or step == self.total:
      self._last_print = now
      print(
        f'{self.name}: step {step}/{self.total} loss {loss:.4f} {speed}',
        file=sys.stderr,
        flush=True,
      )

  def __exit__(self, *exc) -> None:
    if self._rich is not None:
      self._rich.stop()
