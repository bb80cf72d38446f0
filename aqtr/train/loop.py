"""The training loop of every run: jitted step, evaluation, divergence.

`fit` is the one loop: every run of `aqtr-train` (the Pax LM / MLP runs,
the stock nnx LM runs, the LoRA fine-tunes) and `aqtr.train.lora_runs`
train through it. What differs between runs is the `Trainee` they hand
it: the trained leaves, the state carried from step to step (stateful
calibrations), the frozen leaves (a LoRA base), and `apply`, the forward.
`aqtr.train.pax_run.train` builds the trainee of a Pax-style template
quantized by one DotGeneralConfig; `stock_lm`, `lora_job` theirs.

Every run of an experiment starts from the same parameters (same init key;
the quantized model has the float model's parameter tree) and sees the same
batches (`Task.batches()` from the same seed). Compile time is measured
ahead of time (`jit(...).lower(...).compile()`; `Trainee.aot=False`: the
first step's time); steps/s counts training steps only (no compile, no
evaluation).

Divergence: every step also reports whether its loss and all updated
parameters are finite; the flags are read every `CHECK_EVERY` steps (and at
every log or eval step). The first non-finite step ends the run early with
`RunResult.diverged` saying where; no NaN reaches the metrics.

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

import dataclasses
import itertools
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
from aqtr.train import mesh as mesh_lib
from aqtr.train import models, progress
from aqtr.train.tasks import Task, cross_entropy, evaluate_logits

__all__ = [
  'CHECK_EVERY',
  'Fitted',
  'RunResult',
  'Schedule',
  'Trainee',
  'fit',
  'fit_task',
  'init_params',
  'optimizer',
]

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

  @classmethod
  def of(cls, fitted: Fitted, **fields) -> RunResult:
    """The result of a run `fit` trained: its metrics and timings, its
    params and logits unless `fields` (name, config, injected, report,
    and any other field) say otherwise."""
    got = {
      'params': fitted.params,
      'step': fitted.step,
      'train_loss': fitted.train_loss,
      'final': fitted.final,
      'history': fitted.history,
      'steps_per_s': fitted.steps_per_s,
      'compile_s': fitted.compile_s,
      'train_s': fitted.train_s,
      'logits_fn': fitted.logits,
      'diverged': fitted.diverged,
    }
    return cls(**(got | fields))


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
  exp: Any, adam_bits: int | None = None
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
  """How long `fit` trains and when it logs, evaluates and checks.

  Attributes:
    steps: optimizer steps.
    log_every: record the mean train loss every this many steps.
    eval_every: evaluate every this many steps (and at 0 and the end);
      0: only at the end.
  """

  steps: int = 1
  log_every: int = 10
  eval_every: int = 0

  @classmethod
  def of(cls, exp: Any) -> Schedule:
    """The schedule of an `Experiment` (steps, log_every, eval_every)."""
    return cls(
      steps=exp.steps, log_every=exp.log_every, eval_every=exp.eval_every
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trainee:
  """What `fit` trains.

  Attributes:
    params: the trained leaves (a pytree; QT runs: `aqtr.qt` QTParams,
      updated by `aqtr.qt.apply_updates`). Donated to the step.
    apply: (float params, state, frozen, x, step) -> (logits, updated
      state).
    state: collections carried from step to step (stateful calibrations;
      their gradient is the backward passes' state, merged by
      `aqtr.state.merge_tree`); {}: none.
    frozen: leaves read but not trained (a LoRA base), not donated.
    aot: compile ahead of time; False: plain jit, the first step's time
      is the compile time (e.g. trees whose layouts the first call fixes).
    mesh: a device mesh (`aqtr.train.mesh`): batches split over its
      'data' axis, params and optimizer state keep their shardings from
      step to step; None: one device.
  """

  params: Any = None
  apply: Callable[..., tuple[jax.Array, Any]] | None = None
  state: Any = dataclasses.field(default_factory=dict)
  frozen: Any = None
  aot: bool = True
  mesh: Any = None


@dataclasses.dataclass
class Fitted:
  """What `fit` leaves: trained leaves, metrics and timings."""

  params: Any
  state: Any
  opt_state: Any
  step: int
  train_loss: float
  final: dict[str, float]
  history: list[Record]
  compile_s: float
  train_s: float
  steps_per_s: float
  logits: Callable[[Any, Any], jax.Array]  # (params, x) -> logits, jitted
  diverged: str | None = None


def fit(
  name: str,
  trainee: Trainee,
  tx: optax.GradientTransformation,
  batches,
  schedule: Schedule,
  *,
  eval_set=(),
  metric: str = 'bpc',
  unit: str = 'tok',
  items_per_batch: int = 1,
  on_record: Callable[[Record], None] | None = None,
  show_progress: bool = True,
  loss: Callable[[jax.Array, jax.Array], jax.Array] = cross_entropy,
) -> Fitted:
  """Trains `trainee` on `batches` with `tx`: the loop of every run.

  Evaluates on `eval_set` at step 0, every `schedule.eval_every` steps and
  at the end (records {'run', 'step', 'val_loss', metric}); records the
  mean train loss every `log_every` steps ({'run', 'step', 'train_loss',
  'steps_per_s', 'time_s'}); stops at the first non-finite loss or
  parameter (`Fitted.diverged`, a {'run', 'step', 'diverged'} record).

  Args:
    name: the run's name (records, progress bar).
    trainee: what to train (`Trainee`).
    tx: the optimizer.
    batches: an iterator of (x, y) batches.
    schedule: steps, logging and evaluation.
    eval_set: (x, y) validation batches; (): no evaluation.
    metric: 'bpc' or 'accuracy' (`tasks.evaluate_logits`).
    unit: the progress bar's item unit ('tok', 'img').
    items_per_batch: items per batch (progress bar throughput).
    on_record: called with each metrics record.
    show_progress: draw the progress bar.
    loss: (logits, labels) -> the scalar loss.

  Returns:
    A `Fitted`.
  """
  emit = on_record or (lambda r: None)
  mesh = trainee.mesh
  apply, frozen = trainee.apply, trainee.frozen
  # The step donates its params: train on a copy, so the caller's arrays
  # (shared with the model they came from) are never deleted under it.
  params = jax.tree.map(jnp.copy, trainee.params)
  state = trainee.state
  opt_state = tx.init(params)
  out_shardings = None  # One device: wherever jit puts them.
  if mesh is not None:
    opt_state = jax.device_put(
      opt_state, mesh_lib.state_shardings(mesh, opt_state)
    )
    out_shardings = (
      mesh_lib.state_shardings(mesh, params),
      mesh_lib.state_shardings(mesh, opt_state),
      None,
      None,
      None,
    )

  def place(x):
    """A batch split over the mesh's 'data' axis (one device: as is)."""
    return (
      x if mesh is None else jax.device_put(x, mesh_lib.batch_sharding(mesh))
    )

  def step_fn(params, opt_state, state, frozen, x, y, step):
    def loss_fn(p, s):
      logits, updated = apply(p, s, frozen, x, step)
      return loss(logits, y), updated

    (value, updated), (grads, state_grads) = jax.value_and_grad(
      loss_fn, (0, 1), has_aux=True
    )(qt.dequantize(params), state)
    # The backward passes' calibration state arrives as the gradient.
    state = aqtr.state.merge_tree(updated, state_grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = qt.apply_updates(params, updates)
    leaves = [jnp.isfinite(p).all() for p in jax.tree.leaves(params)]
    finite = jnp.isfinite(value) & jnp.stack(leaves).all()
    return params, opt_state, state, value, finite

  def logits_fn(params, state, frozen, x):
    return apply(qt.dequantize(params), state, frozen, x, 0)[0]

  step_j = jax.jit(step_fn, donate_argnums=(0, 1), out_shardings=out_shardings)
  history: list[Record] = []
  losses, window, flags, train_s, compile_s = [], [], [], 0.0, 0.0
  diverged, done, steps = None, schedule.steps, schedule.steps
  final: dict[str, float] = {}
  with progress.Bar(name, steps, unit, show_progress) as bar:
    bar.status('compiling')
    t0 = time.perf_counter()
    if trainee.aot:
      x0, y0 = map(place, next(batches))
      step_c = step_j.lower(
        params, opt_state, state, frozen, x0, y0, jnp.int32(0)
      ).compile()
      batches = itertools.chain([(x0, y0)], batches)
    else:
      step_c = step_j
    eval_j = jax.jit(logits_fn)
    if trainee.aot and eval_set:
      x_eval = eval_set[0][0]
      eval_c = eval_j.lower(params, state, frozen, x_eval).compile()
    else:
      eval_c = eval_j
    compile_s = time.perf_counter() - t0

    def evaluate(step):
      if not eval_set:
        return {}
      rec = evaluate_logits(
        lambda x: eval_c(params, state, frozen, x), eval_set, metric
      )
      history.append({'run': name, 'step': step, **rec})
      emit(history[-1])
      return rec

    every = schedule.eval_every or steps
    final = evaluate(0) if schedule.eval_every else {}
    t = time.perf_counter()
    for i in range(1, steps + 1):
      check_stop()
      x, y = map(place, next(batches))
      params, opt_state, state, value, finite = step_c(
        params, opt_state, state, frozen, x, y, jnp.int32(i)
      )
      if i == 1 and not trainee.aot:  # The first call compiles.
        jax.block_until_ready(value)
        compile_s = time.perf_counter() - t0
        t = time.perf_counter()
      window.append(value)
      flags.append(finite)
      log = i % schedule.log_every == 0 or i == steps
      ev = i % every == 0 or i == steps
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
      timed = i if trainee.aot else i - 1
      if log:
        losses.append(float(np.mean(jax.device_get(window))))
        window = []
        rate = timed / max(train_s, 1e-9)
        rec = {'run': name, 'step': i, 'train_loss': losses[-1]}
        rec |= {'steps_per_s': rate, 'time_s': train_s}
        history.append(rec)
        emit(rec)
        bar.update(
          i,
          loss=losses[-1],
          steps_per_s=rate,
          items_per_s=rate * items_per_batch,
        )
      if ev:
        final = evaluate(i)
      t = time.perf_counter()
  timed = done if trainee.aot else done - 1
  return Fitted(
    params=params,
    state=state,
    opt_state=opt_state,
    step=done,
    train_loss=float('nan') if diverged else losses[-1],
    final=final,
    history=history,
    compile_s=compile_s,
    train_s=train_s,
    steps_per_s=timed / max(train_s, 1e-9),
    logits=lambda p, x: eval_j(p, state, frozen, x),
    diverged=diverged,
  )


def fit_task(
  name: str,
  trainee: Trainee,
  tx: optax.GradientTransformation,
  batches,
  exp: Any,
  task: Task,
  **kwargs: Any,
) -> Fitted:
  """`fit` on a job task: its eval set, metric, unit and batch size, with
  the schedule of experiment `exp` (`Schedule.of`); `kwargs` go to `fit`.
  """
  return fit(
    name,
    trainee,
    tx,
    batches,
    Schedule.of(exp),
    eval_set=task.eval_set,
    metric=task.metric,
    unit=task.unit,
    items_per_batch=task.items_per_batch,
    **kwargs,
  )
