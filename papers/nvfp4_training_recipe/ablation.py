"""The NVFP4 recipe ablation: MLPs trained with per-layer configs.

One MLP per run; each layer's matmul is an `aqtr.dot_general` with the
run's config, except the layers in `float_layers`, which stay float (the
recipe's high-precision layers). Stochastic rounding draws from a key
per step and layer. A whole run is one `lax.scan` in one `jit`; every run
of a seed starts from the same weights and sees the same batches. The
validation MSE is measured with the float forward pass of the trained
weights (what the run learned, not how a quantized forward serves it).

Example:
  >>> import aqtr
  >>> from papers.lib import tasks
  >>> t = tasks.Task(name='teacher', hidden=(32,), steps=3, batch_size=16,
  ...                teacher_dims=(16, 8, 16), train_size=64, val_size=32)
  >>> rows = run(Ablation(task=t, runs={'float': Run()}))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import aqtr
from papers.lib import tasks

__all__ = ['Ablation', 'Run', 'run']

DN = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
  """`config` on every layer but `float_layers` (indices; -1: the last).

  Attributes:
    config: the DotGeneralConfig of the quantized layers.
    float_layers: layer indices kept float.
  """

  config: aqtr.DotGeneralConfig = dataclasses.field(
    default_factory=aqtr.presets.float
  )
  float_layers: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ablation:
  """Runs compared on one teacher-student task (`papers.lib.tasks`).

  Attributes:
    task: the task (name 'teacher'); every width a multiple of 16.
    runs: name -> Run; the first is the reference (float).
  """

  task: tasks.Task = dataclasses.field(default_factory=tasks.Task)
  runs: dict[str, Run] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.task.name != 'teacher':
      raise ValueError(
        f"Ablation.task.name must be 'teacher', got {self.task.name!r}."
      )
    if not self.runs:
      raise ValueError('Ablation.runs must name at least one run, got {}.')


def _configs(r: Run, n: int) -> tuple[aqtr.DotGeneralConfig, ...]:
  keep = {i % n for i in r.float_layers}
  return tuple(
    aqtr.presets.float() if i in keep else r.config for i in range(n)
  )


def _init(key: jax.Array, sizes: tuple[int, ...]) -> list[dict]:
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {'w': jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a), 'b': jnp.zeros(b)}
    for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def _apply(params, x, configs, key):
  keys = jax.random.split(key, len(params))
  for i, (layer, cfg) in enumerate(zip(params, configs, strict=True)):
    k = keys[i] if cfg.needs_key else None
    x = aqtr.dot_general(x, layer['w'], DN, cfg, key=k) + layer['b'][None]
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


@functools.partial(jax.jit, static_argnames=('configs', 'task'))
def _train(params, x, y, idx, x_val, key, *, configs, task):
  sched = optax.warmup_cosine_decay_schedule(
    0.0,
    task.learning_rate,
    task.warmup_steps,
    task.steps,
    end_value=0.1 * task.learning_rate,
  )
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched))

  def step(carry, i):
    p, s = carry

    def loss(p):
      out = _apply(p, x[idx[i]], configs, jax.random.fold_in(key, i))
      return jnp.mean((out - y[idx[i]]) ** 2)

    v, g = jax.value_and_grad(loss)(p)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), v

  (params, _), losses = jax.lax.scan(
    step, (params, tx.init(params)), jnp.arange(task.steps)
  )
  floats = tuple(aqtr.presets.float() for _ in configs)
  return losses, _apply(params, x_val, floats, key)


def run(exp: Ablation, progress=None) -> list[dict[str, Any]]:
  """One row per run: validation MSE (mean and per seed), gap to the first.

  Args:
    exp: the ablation.
    progress: called with a line per finished run, or None.
  """
  task = exp.task
  data = tasks.load(task)
  sizes = (data.x_train.shape[1], *task.hidden, data.y_train.shape[1])
  rows = []
  for name, r in exp.runs.items():
    configs = _configs(r, len(sizes) - 1)
    mses = []
    for seed in task.seeds:
      rng = np.random.default_rng(seed)
      idx = rng.integers(0, len(data.x_train), (task.steps, task.batch_size))
      _, val = _train(
        _init(jax.random.key(seed), sizes),
        data.x_train,
        data.y_train,
        jnp.asarray(idx),
        data.x_val,
        jax.random.key(1000 + seed),
        configs=configs,
        task=task,
      )
      mses.append(float(jnp.mean((val - data.y_val) ** 2)))
    mse = float(np.mean(mses))
    ref = rows[0]['val MSE'] if rows else mse
    rows.append(
      {
        'run': name,
        'float layers': ','.join(map(str, r.float_layers)) or '-',
        'val MSE': mse,
        'sd': float(np.std(mses)),
        'gap to float': mse / ref - 1,
      }
    )
    if progress is not None:
      progress(f'{name}: val MSE {mse:.4e} ({rows[-1]["gap to float"]:+.1%})')
  return rows
