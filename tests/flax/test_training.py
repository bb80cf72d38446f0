"""A small MLP and CNN train with the int8 preset and track float training.

Data: sklearn's digits (8x8 images, 10 classes) when scikit-learn is
installed, else a learnable stand-in (`flax_cases.digits`). Each model
trains the same steps from the same initial parameters in float and with
`aqtr.presets.int8()` (int8 forward, dlhs and drhs). Stated tolerance: the
int8 model's loss on the whole set is within 0.1 (absolute) of the float
model's, and both at least halve their initial loss. Measured (digits, 40
steps of 64, adam 3e-3; XLA:CPU): MLP 2.324 -> float 0.568, int8 0.571
(linen and nnx alike); CNN 2.371 -> float 0.522, int8 0.534.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax_cases import LinenCNN, LinenMLP, NnxMLP, digits

import aqtr

TOL = 0.1
STEPS, BATCH = 40, 64


def _batches(x, y):
  for i in range(STEPS):
    j = (i * BATCH) % (len(x) - BATCH)
    yield x[j : j + BATCH], y[j : j + BATCH]


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _train_linen(model, x, y):
  params = jax.jit(model.init)(jax.random.key(0), x[:2])['params']
  opt = optax.adam(3e-3)

  def loss(p, x, y):
    return _xent(model.apply({'params': p}, x), y)

  @jax.jit
  def step(p, s, x, y):
    g = jax.grad(loss)(p, x, y)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  evaluate = jax.jit(loss)
  first = float(evaluate(params, x, y))
  state = opt.init(params)
  for bx, by in _batches(x, y):
    params, state = step(params, state, bx, by)
  return first, float(evaluate(params, x, y))


@pytest.mark.parametrize('model_cls', [LinenMLP, LinenCNN])
def test_linen_int8_training_tracks_float(model_cls):
  x, y = digits()
  f0, f1 = _train_linen(model_cls(None), x, y)
  q0, q1 = _train_linen(model_cls(aqtr.presets.int8()), x, y)
  msg = f'float {f0:.3f} -> {f1:.3f}, int8 {q0:.3f} -> {q1:.3f}'
  assert q1 < 0.5 * q0 and f1 < 0.5 * f0, msg
  assert abs(q1 - f1) < TOL, msg


def test_nnx_int8_training_tracks_float():
  x, y = digits()

  def train(cfg):
    m = NnxMLP(cfg, nnx.Rngs(0))
    opt = nnx.Optimizer(m, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, x, y):
      g = nnx.grad(lambda m: _xent(m(x), y))(m)
      opt.update(m, g)

    evaluate = nnx.jit(lambda m, x, y: _xent(m(x), y))
    first = float(evaluate(m, x, y))
    for bx, by in _batches(x, y):
      step(m, opt, bx, by)
    return first, float(evaluate(m, x, y))

  f0, f1 = train(None)
  q0, q1 = train(aqtr.presets.int8())
  msg = f'float {f0:.3f} -> {f1:.3f}, int8 {q0:.3f} -> {q1:.3f}'
  assert q1 < 0.5 * q0 and f1 < 0.5 * f0, msg
  assert abs(q1 - f1) < TOL, msg
  assert jnp.isfinite(q1)
