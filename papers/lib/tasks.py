"""The two small tasks of the reproductions: digits and teacher-student.

* 'digits': scikit-learn's 8x8 digits (offline), 10-way classification,
  metric: validation accuracy (higher is better).
* 'teacher': regression onto a fixed random tanh MLP (the teacher) from
  Gaussian inputs, metric: validation mean squared error (lower is better).
  A smooth target with no label noise floor exposes small numerical errors
  that classification accuracy hides.

Example:
  >>> from papers.lib import tasks
  >>> d = tasks.load(tasks.Task(name='teacher', train_size=64, val_size=32))
  >>> d.x_train.shape, d.y_val.shape, d.metric
  ((64, 32), (32, 8), 'mse')
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ['NAMES', 'Data', 'Task', 'load']

NAMES = ('digits', 'teacher')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
  """One training setting: data, student width, optimizer, seeds.

  Attributes:
    name: 'digits' or 'teacher'.
    hidden: the student MLP's hidden widths (ReLU).
    steps: Adam steps.
    batch_size: examples per step.
    learning_rate: peak learning rate (warmup, cosine decay to 10%).
    warmup_steps: linear warmup length.
    seeds: one run per seed (init and batch order); metrics are averaged.
    teacher_dims: 'teacher' only: input, hidden..., output widths (tanh).
    train_size: 'teacher' only: training examples.
    val_size: 'teacher' only: validation examples.
  """

  name: str = 'digits'
  hidden: tuple[int, ...] = (256, 256)
  steps: int = 300
  batch_size: int = 64
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  seeds: tuple[int, ...] = (0,)
  teacher_dims: tuple[int, ...] = (32, 64, 64, 8)
  train_size: int = 4096
  val_size: int = 2048

  def __post_init__(self):
    if self.name not in NAMES:
      raise ValueError(f'Task.name must be one of {NAMES}, got {self.name!r}.')
    for f in ('steps', 'batch_size', 'train_size', 'val_size'):
      if getattr(self, f) < 1:
        raise ValueError(f'Task.{f} must be >= 1, got {getattr(self, f)}.')
    if not self.seeds:
      raise ValueError('Task.seeds must name at least one seed, got ().')
    if any(h < 1 for h in self.hidden):
      raise ValueError(f'Task.hidden widths must be >= 1, got {self.hidden}.')
    if len(self.teacher_dims) < 2 or min(self.teacher_dims) < 1:
      raise ValueError(
        'Task.teacher_dims must be >= 2 positive widths (input ... output), '
        f'got {self.teacher_dims}.'
      )
    if not self.learning_rate > 0:
      raise ValueError(
        f'Task.learning_rate must be > 0, got {self.learning_rate}.'
      )


@dataclasses.dataclass(frozen=True)
class Data:
  """Arrays of one task; `metric` is 'accuracy' or 'mse'."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_val: np.ndarray
  y_val: np.ndarray
  metric: str
  out_dim: int


def _teacher(task: Task) -> Data:
  rng = np.random.default_rng(1234)  # The teacher is fixed across seeds.
  dims = task.teacher_dims
  ws = [
    rng.normal(size=(a, b)) * np.sqrt(2.0 / a)
    for a, b in zip(dims[:-1], dims[1:], strict=True)
  ]

  def f(x):
    for w in ws[:-1]:
      x = np.tanh(x @ w)
    return x @ ws[-1]

  n = task.train_size + task.val_size
  x = rng.normal(size=(n, dims[0]))
  y = f(x)
  y = y / y.std()
  x, y = x.astype(np.float32), y.astype(np.float32)
  t = task.train_size
  return Data(x[:t], y[:t], x[t:], y[t:], 'mse', dims[-1])


def load(task: Task) -> Data:
  """The data of `task` (deterministic; the digits split uses seed 0)."""
  if task.name == 'teacher':
    return _teacher(task)
  from aqtr.data import digits

  d = digits.load(seed=0)
  return Data(d.x_train, d.y_train, d.x_val, d.y_val, 'accuracy', 10)
