"""A two-hidden-layer MLP on scikit-learn's digits, trained with any optax
transformation, float or quantized (QT)."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from aqtr import qt
from aqtr.data import digits
from aqtr.qt import adam


def init(seed: int = 0, hidden=(256, 256)) -> dict:
  sizes = (64, *hidden, 10)
  keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
  params = {}
  for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
    w = jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a)
    params[f'Dense_{i}'] = {'kernel': w, 'bias': jnp.zeros(b)}
  return params


def apply(params, x):
  n = len(params)
  for i in range(n):
    p = params[f'Dense_{i}']
    x = x @ p['kernel'] + p['bias'][None]
    if i < n - 1:
      x = jax.nn.relu(x)
  return x


def loss_fn(params, x, y):
  logits = apply(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(tx, params, steps: int, batch: int = 64, seed: int = 0):
  """Trains; returns (params, opt_state, test accuracy, mean loss of the
  last 50 steps). QTParam leaves go through `qt.dequantize` /
  `qt.apply_updates`; the steps run in one `lax.scan`.
  """
  d = digits.load()
  state = tx.init(params)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(d.x_train), (steps, batch))
  xs, ys = jnp.asarray(d.x_train[idx]), jnp.asarray(d.y_train[idx])

  def step(carry, xy):
    params, state = carry
    loss, g = jax.value_and_grad(loss_fn)(qt.dequantize(params), *xy)
    u, state = tx.update(g, state, params)
    return (qt.apply_updates(params, u), state), loss

  run = jax.jit(lambda c, xs, ys: jax.lax.scan(step, c, (xs, ys)))
  (params, state), losses = run((params, state), xs, ys)
  logits = apply(qt.dequantize(params), d.x_val)
  acc = float((np.argmax(logits, -1) == d.y_val).mean())
  return params, state, acc, float(losses[-50:].mean())


def _adamw_4bit_nearest_m(lr, **kw):
  mu, nu = adam.ADAM_4BIT
  mu = dataclasses.replace(mu, rounding='nearest')
  return qt.lowbit_adamw(lr, mu_codec=mu, nu_codec=nu, **kw)


def optimizer(name: str, lr: float):
  """'adamw' (optax), 'adamw_8bit', 'adamw_4bit' or 'adamw_4bit_nearest_m'
  (the paper's nearest rounding of m), weight decay 1e-4."""
  make = {
    'adamw': optax.adamw,
    'adamw_8bit': qt.adamw_8bit,
    'adamw_4bit': qt.adamw_4bit,
    'adamw_4bit_nearest_m': _adamw_4bit_nearest_m,
  }[name]
  return make(lr, weight_decay=1e-4)


@functools.cache
def run(
  weights: str,
  lr: float,
  steps: int,
  rounding: str = 'stochastic',
  opt: str = 'adamw',
  seed: int = 0,
) -> tuple[float, float]:
  """(test accuracy, final loss) of one cached training run.

  weights: 'float', 'int8' or 'int4' (group 32, quantized training).
  seed: of the initial weights and of the batch order.
  """
  p0 = init(seed)
  tx = optimizer(opt, lr)
  if weights != 'float':
    fmt = qt.int8() if weights == 'int8' else qt.int4(32)
    p0, _ = qt.quantize_params(p0, [qt.Rule(fmt=fmt)])
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', qt.NearestRoundingWarning)
      tx = qt.quantized_training(tx, rounding=rounding, seed=0)
  return train(tx, p0, steps, seed=seed)[2:]
