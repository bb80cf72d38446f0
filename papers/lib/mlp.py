"""A ReLU MLP whose every matmul is `aqtr.dot_general`, trained in one scan.

The whole training run (Adam steps over precomputed batch indices) is one
`jax.lax.scan` inside one `jit`, so a run costs one compile per (config,
shapes) and the seeds of a task reuse it. Every run of a comparison starts
from the same initial weights and sees the same batches for a given seed.

With a `qt.WeightFormat` (`weights=`), the weights are stored only
quantized (`aqtr.qt`: no float master copy): each step dequantizes them,
takes the Adam step and stores the result again with `rounding`
('stochastic' or 'nearest').

Serving (`serve`) freezes each weight with `aqtr.quantize_operand` (int8 /
fp8 values and scales, the float weight dropped) and runs the same layers
from the frozen values; `serve == train` means bit-identical outputs.

Example:
  >>> import aqtr
  >>> from papers.lib import mlp, tasks
  >>> task = tasks.Task(name='teacher', hidden=(16,), steps=5,
  ...                   train_size=64, val_size=32)
  >>> r = mlp.run(task, aqtr.presets.int8(), seed=0)  # doctest: +SKIP
  >>> sorted(r)  # doctest: +SKIP
  ['curve', 'metric', 'serve_bytes', 'serve_equal']
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import aqtr
from aqtr import qt
from papers.lib.tasks import Data, Task, load

__all__ = [
  'apply',
  'apply_jit',
  'init',
  'model_bytes',
  'optimizer',
  'quantize_weights',
  'run',
  'serve',
  'train',
]

DN = (((1,), (0,)), ((), ()))

Params = list[dict[str, jax.Array]]


def init(key: jax.Array, sizes: tuple[int, ...]) -> Params:
  """He-normal weights [in, out], zero biases, for layer widths `sizes`."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {
      'w': jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a),
      'b': jnp.zeros((b,)),
    }
    for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
  ]


def apply(params: Params, x: jax.Array, config: aqtr.DotGeneralConfig):
  """Logits / predictions; `params[i]['w']` may be a frozen QTensor."""
  return apply_state(params, x, config, None)[0]


def apply_state(params: Params, x, config, states):
  """(outputs, new states): `apply` with one calibration state per layer
  (`init_states`; None for stateless configs)."""
  new = None if states is None else []
  for i, layer in enumerate(params):
    if states is None:
      y = aqtr.dot_general(x, layer['w'], DN, config)
    else:
      y, s = aqtr.dot_general(x, layer['w'], DN, config, state=states[i])
      new.append(s)
    x = y + layer['b'][None]
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x, new


def init_states(params: Params, x: jax.Array, config) -> list | None:
  """The layers' calibration states (`aqtr.state.init`), or None when the
  config keeps no state (e.g. `fp8_delayed` keeps amax histories)."""
  states, h = [], x
  for layer in params:
    states.append(aqtr.state.init(h, layer['w'], DN, config))
    h = jnp.zeros((h.shape[0], layer['w'].shape[1]), h.dtype)
  return states if any(states) else None


def _loss(metric: str, out: jax.Array, y: jax.Array) -> jax.Array:
  if metric == 'mse':
    return jnp.mean((out - y) ** 2)
  logp = jax.nn.log_softmax(out)
  return -jnp.take_along_axis(logp, y[:, None], axis=-1).mean()


def _score(metric: str, out: jax.Array, y: jax.Array) -> jax.Array:
  if metric == 'mse':
    return jnp.mean((out - y) ** 2)
  return jnp.mean(out.argmax(-1) == y)


def _optimizer(task: Task, lr=None) -> optax.GradientTransformation:
  warmup = min(task.warmup_steps, task.steps // 2)
  steps = max(task.steps, warmup + 1)
  if lr is None:
    lr = optax.warmup_cosine_decay_schedule(
      0.0,
      task.learning_rate,
      warmup,
      steps,
      end_value=0.1 * task.learning_rate,
    )
  else:  # `lr * shape(t)`, `lr` traced: one compile for every rate.
    shape = optax.warmup_cosine_decay_schedule(
      0.0, 1.0, warmup, steps, end_value=0.1
    )
    lr = functools.partial(lambda peak, t: peak * shape(t), lr)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))


def quantize_weights(params: Params, weights: qt.WeightFormat) -> Params:
  """Every `w` stored as a `qt.QTParam` in `weights` (nearest rounding)."""
  rule = qt.Rule(pattern=r'(^|/)w$', fmt=weights)
  return qt.quantize_params(params, [rule], strict=True)[0]


def optimizer(
  task: Task,
  weights: qt.WeightFormat | None = None,
  rounding: str = 'stochastic',
  lr=None,
) -> optax.GradientTransformation:
  """Clipped Adam, warmup and cosine decay to 10 % of the peak learning rate.

  Args:
    task: steps, warmup and learning rate.
    weights: wrap it in `qt.quantized_training(rounding=rounding)` (seed
      0) for weights stored in this format.
    rounding: 'stochastic' or 'nearest'.
    lr: the peak learning rate as an array (traced under jit), instead of
      the task's.
  """
  tx = _optimizer(task, lr)
  if weights is None:
    return tx
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', qt.NearestRoundingWarning)
    return qt.quantized_training(tx, rounding=rounding, seed=0)


@functools.partial(
  jax.jit,
  static_argnames=('config', 'task', 'metric', 'weights', 'rounding'),
)
def train(
  params,
  x,
  y,
  idx,
  x_val,
  lr=None,
  *,
  config,
  task,
  metric,
  weights=None,
  rounding='stochastic',
):
  """Trains on batches `x[idx[i]]`; returns (params, losses, val outputs).

  The validation forward pass is part of the same program (one compile).
  `lr`: the peak learning rate as an array, replacing the task's (whose
  `learning_rate` should then be a fixed placeholder: one compile for
  every learning rate). With `weights`, `params` holds QTParams
  (`quantize_weights`) and stays so.
  """
  tx = optimizer(task, weights, rounding, lr)
  states = init_states(qt.dequantize(params), x[idx[0]], config)

  def step(carry, i):
    p, s, st = carry

    def loss_fn(w, st):
      out, new = apply_state(w, x[i], config, st)
      return _loss(metric, out, y[i]), new

    (loss, new), (g, gst) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
      qt.dequantize(p), st
    )
    if st is not None:  # The backward passes' stats come as gradients.
      st = [aqtr.state.merge(n, gs) for n, gs in zip(new, gst, strict=True)]
    u, s = tx.update(g, s, p)
    return (qt.apply_updates(p, u), s, st), loss

  carry = (params, tx.init(params), states)
  (params, _, states), losses = jax.lax.scan(step, carry, idx)
  out = apply_state(qt.dequantize(params), x_val, config, states)[0]
  return params, losses, out, states


def _batches(n: int, task: Task, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  per_epoch = n // task.batch_size
  epochs = -(-task.steps // per_epoch)
  perms = [
    rng.permutation(n)[: per_epoch * task.batch_size] for _ in range(epochs)
  ]
  idx = np.concatenate(perms).reshape(-1, task.batch_size)
  return idx[: task.steps]


def serve(params: Params, config: aqtr.DotGeneralConfig, states=None):
  """The serving weights: each `w` frozen by the forward rhs of `config`
  (at its calibration state, for stateful configs)."""
  if not config.fwd.rhs.quantized:
    return params
  sts = [None] * len(params) if states is None else states
  return [
    {
      'w': aqtr.quantize_operand(
        p['w'], DN, config, state=(st or {}).get('fwd.rhs')
      ),
      'b': p['b'],
    }
    for p, st in zip(params, sts, strict=True)
  ]


def served_states(states):
  """The states a served model reads: none for the frozen weights."""
  if states is None:
    return None
  return [{k: v for k, v in s.items() if k != 'fwd.rhs'} for s in states]


def model_bytes(params: Params) -> int:
  """Bytes of the arrays in `params` (frozen weights: values + scales)."""
  leaves = jax.tree.leaves(params)
  return int(sum(a.size * a.dtype.itemsize for a in leaves))


apply_jit = jax.jit(apply, static_argnames=('config',))
apply_state_jit = jax.jit(apply_state, static_argnames=('config',))


def run(
  task: Task,
  config: aqtr.DotGeneralConfig,
  seed: int,
  data: Data | None = None,
  check_serving: bool = True,
  weights: qt.WeightFormat | None = None,
  rounding: str = 'stochastic',
  trace_lr: bool = False,
) -> dict[str, Any]:
  """Trains one seed of `task` under `config`, evaluates, serves.

  Args:
    task: the setting.
    config: applied to every layer's matmul (weight = rhs).
    seed: initial weights and batch order.
    data: `tasks.load(task)`, when already loaded.
    check_serving: also freeze the weights and serve (one more compile);
      not with `weights`.
    weights: store the weights only in this format (quantized training).
    rounding: of the quantized-training update, 'stochastic' or 'nearest'.
    trace_lr: pass the learning rate as an argument of the compiled
      program, so a learning-rate sweep compiles once (the schedule is
      then computed as `lr * shape(t)`: equal to the default up to float
      rounding, not bit for bit).

  Returns:
    {'metric': validation accuracy or MSE, 'curve': per-step train loss,
    'params': the trained parameters, and with `check_serving`:
    'serve_equal' (frozen-weight outputs == training outputs bit for bit),
    'serve_bytes' (the frozen model)}.
  """
  data = data or load(task)
  sizes = (data.x_train.shape[1], *task.hidden, data.out_dim)
  params = init(jax.random.key(seed), sizes)
  if weights is not None:
    if check_serving:
      raise ValueError('mlp.run: check_serving must be False with weights=.')
    params = quantize_weights(params, weights)
  idx = _batches(len(data.x_train), task, seed)
  params, losses, out, states = train(
    params,
    jnp.asarray(data.x_train),
    jnp.asarray(data.y_train),
    jnp.asarray(idx),
    jnp.asarray(data.x_val),
    jnp.float32(task.learning_rate) if trace_lr else None,
    config=config,
    task=dataclasses.replace(task, learning_rate=1.0) if trace_lr else task,
    metric=data.metric,
    weights=weights,
    rounding=rounding,
  )
  result = {
    'metric': float(_score(data.metric, out, jnp.asarray(data.y_val))),
    'curve': np.asarray(losses),
    'params': params,
  }
  if check_serving:
    frozen = serve(params, config, states)
    served = apply_state_jit(
      frozen,
      jnp.asarray(data.x_val),
      config=config,
      states=served_states(states),
    )[0]
    result['serve_equal'] = bool(
      np.array_equal(np.asarray(out), np.asarray(served))
    )
    result['serve_bytes'] = model_bytes(frozen)
  return result
