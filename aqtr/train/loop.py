"""Training one run: optax Adam, jitted step, periodic evaluation.

Every run of an experiment starts from the same parameters (same init key;
the quantized model has the float model's parameter tree) and sees the same
batches (`Task.batches()` from the same seed). Compile time is measured
ahead of time (`jit(...).lower(...).compile()`); steps/s counts training
steps only (no compile, no evaluation).

Divergence: every step also reports whether its loss and all updated
parameters are finite; the flags are read every `CHECK_EVERY` steps (and at
every log or eval step). The first non-finite step ends the run early with
`RunResult.diverged` saying where; no NaN reaches the metrics.

Example:
  >>> import aqtr
  >>> from aqtr.train import experiment, loop, tasks
  >>> cfg = experiment.tiny()
  >>> cfg.steps = 2
  >>> exp, template, _ = experiment.split(cfg)
  >>> r = loop.train('int8', aqtr.presets.int8(), exp, tasks.make(exp),
  ...                template, show_progress=False)  # doctest: +SKIP
  >>> r.step  # doctest: +SKIP
  2
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import aqtr
import aqtr.pax
from aqtr import qt
from aqtr.core import slot_state
from aqtr.train import mesh as mesh_lib
from aqtr.train import models, progress, qt_runs
from aqtr.train.experiment import Experiment
from aqtr.train.high_precision import HighPrecision
from aqtr.train.tasks import Task, cross_entropy, evaluate_logits

__all__ = ['CHECK_EVERY', 'RunResult', 'init_params', 'optimizer', 'train']

CHECK_EVERY = 5  # Steps between two reads of the finite flags.

Record = dict[str, Any]


@dataclasses.dataclass
class RunResult:
  """What a run leaves: trained float params, metrics, timings.

  `param_opt_bytes`: bytes of the params and optimizer state as stored
  between steps (int8 for quantized-training runs).
  """

  name: str
  config: aqtr.DotGeneralConfig
  injected: Any
  report: Any
  params: Any
  step: int
  train_loss: float
  final: dict[str, float]
  history: list[Record]
  steps_per_s: float
  compile_s: float
  train_s: float
  logits_fn: Callable[[Any, np.ndarray], jax.Array]  # eval batches' shape
  diverged: str | None = None  # Why and where training stopped, if so.
  param_opt_bytes: int = 0
  # Other variable collections of the trained model, e.g. 'aqtr_state'
  # (stateful calibrations: amax histories, running statistics).
  collections: dict = dataclasses.field(default_factory=dict)


# Ctrl-C: the first SIGINT asks the job to stop at the next step boundary
# (raised from the loop, never from inside a garbage-collector callback,
# where Python would swallow it); a second one interrupts at once.
_stop_requested = threading.Event()


def request_stop(signum=None, frame=None) -> None:
  """SIGINT handler: stop at the next step; raise on the second call."""
  del signum, frame
  if _stop_requested.is_set():
    raise KeyboardInterrupt
  _stop_requested.set()


def check_stop() -> None:
  """Raises KeyboardInterrupt when a stop was requested."""
  if _stop_requested.is_set():
    _stop_requested.clear()
    raise KeyboardInterrupt


def optimizer(
  exp: Experiment, adam_bits: int | None = None
) -> optax.GradientTransformation:
  """Clipped AdamW with linear warmup and cosine decay to 10%.

  `adam_bits=8`: `aqtr.qt.adamw_8bit` (8-bit moments) instead of AdamW.
  """
  warmup = min(exp.warmup_steps, exp.steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    exp.learning_rate,
    warmup,
    max(exp.steps, warmup + 1),
    end_value=0.1 * exp.learning_rate,
  )
  adamw = qt.adamw_8bit if adam_bits == 8 else optax.adamw
  return optax.chain(
    optax.clip_by_global_norm(exp.grad_clip),
    adamw(schedule, weight_decay=exp.weight_decay),
  )


def init_params(template: Any, task: Task, seed: int) -> Any:
  """Initial params of the float model (the same tree for every config)."""
  module = models.build(template)
  x = jnp.asarray(next(task.batches())[0])
  return jax.jit(module.init)(jax.random.key(seed), x)['params']


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


def _bind_collections(fn, calib):
  """(params, x) -> fn(params, calib, x)."""
  return lambda params, x: fn(params, calib, x)


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
  exp: Experiment,
  task: Task,
  template: Any,
  *,
  params: Any = None,
  on_record: Callable[[Record], None] | None = None,
  show_progress: bool = True,
  spec: qt_runs.RunSpec | None = None,
  keep: HighPrecision | None = None,
) -> RunResult:
  """Trains the model of `template` quantized by `config`.

  Args:
    name: the run's name (records and progress bar).
    config: injected into every projection of the model.
    exp: steps, optimizer and evaluation settings.
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
  emit = on_record or (lambda r: None)
  batches = task.batches()
  x0, y0 = next(task.batches())
  if params is None:
    params = init_params(template, task, exp.seed)
  params, calib = stateful_init(module, config, params, x0, exp.seed)
  params = jax.tree.map(jnp.copy, params)  # The step donates its buffers.
  spec = spec or qt_runs.RunSpec()
  tx = optimizer(exp, spec.adam_bits)
  if spec.weights is not None:  # Weights kept only quantized.
    params, _ = qt.quantize_params(params, [qt.Rule(fmt=spec.weights)])
    tx = qt.quantized_training(tx, seed=exp.seed)
  mesh = mesh_lib.make(exp.mesh) if exp.mesh else None
  if mesh is not None:
    params = jax.device_put(params, mesh_lib.param_shardings(mesh, params))

  def place(x):
    """A batch split over the mesh's 'data' axis (one device: as is)."""
    return (
      x if mesh is None else jax.device_put(x, mesh_lib.batch_sharding(mesh))
    )

  x0, y0 = place(x0), place(y0)
  opt_state = tx.init(params)
  state_shardings = None  # One device: wherever jit puts them.
  if mesh is not None:  # The state keeps its shardings from step to step.
    opt_state = jax.device_put(
      opt_state, mesh_lib.state_shardings(mesh, opt_state)
    )
    state_shardings = (
      mesh_lib.state_shardings(mesh, params),
      mesh_lib.state_shardings(mesh, opt_state),
      None,
      None,
      None,
    )

  def apply(p, calib, x, step):
    """(logits, updated collections); stateful calibrations update."""
    rngs = _rngs(config, exp.seed, step)
    if not calib:
      return module.apply({'params': p}, x, rngs=rngs), calib
    return module.apply(
      {'params': p, **calib}, x, rngs=rngs, mutable=list(calib)
    )

  def step_fn(params, opt_state, calib, x, y, step):
    def loss_fn(p, c):
      logits, updated = apply(p, c, x, step)
      return cross_entropy(logits, y), updated

    (loss, updated), (grads, calib_grads) = jax.value_and_grad(
      loss_fn, (0, 1), has_aux=True
    )(qt.dequantize(params), calib)
    # The backward passes' calibration state arrives as the gradient.
    calib = aqtr.state.merge_tree(updated, calib_grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = qt.apply_updates(params, updates)
    leaves = [jnp.isfinite(p).all() for p in jax.tree.leaves(params)]
    finite = jnp.isfinite(loss) & jnp.stack(leaves).all()
    return params, opt_state, calib, loss, finite

  def logits_fn(params, calib, x):
    return apply(qt.dequantize(params), calib, x, 0)[0]

  history: list[Record] = []
  losses, window, flags, train_s = [], [], [], 0.0
  diverged, done = None, exp.steps
  with progress.Bar(name, exp.steps, task.unit, show_progress) as bar:
    bar.status('compiling')
    t0 = time.perf_counter()
    step_c = (
      jax.jit(step_fn, donate_argnums=(0, 1), out_shardings=state_shardings)
      .lower(params, opt_state, calib, x0, y0, jnp.int32(0))
      .compile()
    )
    eval_c = (
      jax.jit(logits_fn).lower(params, calib, task.eval_set[0][0]).compile()
    )
    compile_s = time.perf_counter() - t0

    def evaluate(step):
      rec = evaluate_logits(
        lambda x: eval_c(params, calib, x), task.eval_set, task.metric
      )
      rec = {'run': name, 'step': step, **rec}
      history.append(rec)
      emit(rec)
      return rec

    final = evaluate(0)
    t = time.perf_counter()
    for i in range(1, exp.steps + 1):
      check_stop()
      x, y = map(place, next(batches))
      params, opt_state, calib, loss, finite = step_c(
        params, opt_state, calib, x, y, jnp.int32(i)
      )
      window.append(loss)
      flags.append(finite)
      log = i % exp.log_every == 0 or i == exp.steps
      ev = i % exp.eval_every == 0 or i == exp.steps
      if not (log or ev or i % CHECK_EVERY == 0):
        continue
      ok = np.asarray(jax.device_get(flags))
      flags = []
      if not ok.all():
        train_s += time.perf_counter() - t
        done = i - len(ok) + 1 + int(np.argmin(ok))
        diverged = f'non-finite loss or parameters at step {done}'
        emit({'run': name, 'step': done, 'diverged': diverged})
        bar.status('diverged')
        break
      if not (log or ev):
        continue
      train_s += time.perf_counter() - t
      if log:
        losses.append(float(np.mean(jax.device_get(window))))
        window = []
        rec = {
          'run': name,
          'step': i,
          'train_loss': losses[-1],
          'steps_per_s': i / train_s,
          'time_s': train_s,
        }
        history.append(rec)
        emit(rec)
        bar.update(
          i,
          loss=losses[-1],
          steps_per_s=i / train_s,
          items_per_s=i * task.items_per_batch / train_s,
        )
      if ev:
        final = evaluate(i)
      t = time.perf_counter()
  stored = qt.tree_bytes(params) + qt.tree_bytes(opt_state)
  return RunResult(
    name=name,
    config=config,
    injected=injected,
    report=report,
    params=qt.dequantize(params),
    step=done,
    train_loss=float('nan') if diverged else losses[-1],
    final=final,
    history=history,
    steps_per_s=done / max(train_s, 1e-9),
    compile_s=compile_s,
    train_s=train_s,
    # QT runs: eval_c takes the quantized tree; this one the float params.
    logits_fn=_bind_collections(
      eval_c if spec.weights is None else jax.jit(logits_fn), calib
    ),
    param_opt_bytes=stored,
    diverged=diverged,
    collections=calib,
  )
