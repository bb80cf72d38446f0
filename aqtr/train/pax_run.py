"""The runs of a Pax-style template quantized by one DotGeneralConfig.

`train` injects the config into every weight op of the job's template
(`aqtr.train.models.inject`, blocks a `HighPrecision` keeps float), adds
the learned calibration parameters and state collections of stateful
configs (`stateful_init`), keeps the weights quantized for quantized-
training runs (`aqtr.train.qt_runs`), places params and batches on the
experiment's mesh, and trains with the job's loop (`aqtr.train.loop.fit`).

Example:
  >>> import aqtr
  >>> from aqtr.train import experiment, pax_run, tasks
  >>> cfg = experiment.tiny()
  >>> cfg.steps = 2
  >>> exp, template, _ = experiment.split(cfg)
  >>> r = pax_run.train('int8', aqtr.presets.int8(), exp, tasks.make(exp),
  ...                   template, show_progress=False)  # doctest: +SKIP
  >>> r.step  # doctest: +SKIP
  2
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import aqtr
import aqtr.pax
from aqtr import qt
from aqtr.core import slot_state
from aqtr.train import loop, models, qt_runs
from aqtr.train import mesh as mesh_lib
from aqtr.train.high_precision import HighPrecision
from aqtr.train.loop import Record, RunResult, init_params
from aqtr.train.tasks import Task

__all__ = ['stateful_init', 'train']


def _rngs(config, seed: int, step) -> dict[str, jax.Array] | None:
  """Stochastic rounding keys (the 'quant' stream), only when used."""
  if not aqtr.pax.needs_key(config):
    return None
  return {'quant': jax.random.fold_in(jax.random.key(seed + 1), step)}


def _with_quant_params(float_params: Any, quant_params: Any) -> Any:
  """The float params plus the quantized model's own (e.g. LSQ steps)."""
  if not isinstance(quant_params, dict):
    return float_params
  out = dict(float_params)
  for k, v in quant_params.items():
    out[k] = _with_quant_params(out[k], v) if k in out else v
  return out


def stateful_init(module, config, params, x, seed: int) -> tuple[Any, dict]:
  """(params, collections) of a model whose calibrations keep state.

  Stateless configs: (params, {}), without tracing anything. Otherwise the
  model is initialised once for its learned calibration parameters (added
  to `params`, which keep their float values) and its 'aqtr_state'
  collection.
  """
  if not slot_state.paths(config):
    return params, {}
  v = jax.jit(module.init)(jax.random.key(seed), x)
  collections = {k: c for k, c in v.items() if k != 'params'}
  return _with_quant_params(params, v['params']), collections


def train(
  name: str,
  config: aqtr.DotGeneralConfig,
  exp: Any,
  task: Task,
  template: Any,
  *,
  params: Any = None,
  on_record: Callable[[Record], None] | None = None,
  show_progress: bool = True,
  spec: qt_runs.RunSpec | None = None,
  keep: HighPrecision | None = None,
) -> RunResult:
  """Trains the model of `template` quantized by `config` (`loop.fit`).

  Args:
    name: the run's name (records and progress bar).
    config: injected into every projection of the model.
    exp: the Experiment (steps, optimizer, evaluation, mesh, seed).
    task: data and metric.
    template: the float model template.
    params: initial params (copied; default: `init_params`).
    on_record: called with each metrics record as it is made.
    show_progress: draw the progress bar.
    spec: a quantized-training / low-bit-optimizer run (`qt_runs`).
    keep: blocks left float (`aqtr.train.high_precision`), or None.

  Returns:
    A RunResult with the trained (float) params and the metrics.
  """
  injected, report = models.inject(template, config, keep)
  module = models.build(injected)
  x0 = next(task.batches())[0]
  if params is None:
    params = init_params(template, task, exp.seed)
  params, calib = stateful_init(module, config, params, x0, exp.seed)
  params = jax.tree.map(jnp.copy, params)  # The step donates its buffers.
  spec = spec or qt_runs.RunSpec()
  tx = loop.optimizer(exp, spec.adam_bits)
  if spec.weights is not None:  # Weights kept only quantized.
    params, _ = qt.quantize_params(params, [qt.Rule(fmt=spec.weights)])
    tx = qt.quantized_training(tx, seed=exp.seed)
  mesh = mesh_lib.make(exp.mesh) if exp.mesh else None
  if mesh is not None:
    params = jax.device_put(params, mesh_lib.param_shardings(mesh, params))

  def apply(p, calib, frozen, x, step):
    """(logits, updated collections); stateful calibrations update."""
    del frozen
    rngs = _rngs(config, exp.seed, step)
    if not calib:
      return module.apply({'params': p}, x, rngs=rngs), calib
    return module.apply(
      {'params': p, **calib}, x, rngs=rngs, mutable=list(calib)
    )

  trainee = loop.Trainee(params=params, apply=apply, state=calib, mesh=mesh)
  f = loop.fit_task(
    name,
    trainee,
    tx,
    task.batches(),
    exp,
    task,
    on_record=on_record,
    show_progress=show_progress,
  )
  stored = qt.tree_bytes(f.params) + qt.tree_bytes(f.opt_state)
  return RunResult.of(
    f,
    name=name,
    config=config,
    injected=injected,
    report=report,
    params=qt.dequantize(f.params),
    logits_fn=f.logits,  # (float params, x), the trained collections.
    param_opt_bytes=stored,
    collections=f.state,
  )
