"""Post-training quantization of a small digits MLP: mse vs absmax at W2.

The reduced form of benchmarks/catalogue.py's PTQ table (the main job's
digits MLP there): an MLP trained in float, its weights quantized to 2-bit
ints ({-s, 0, s}) with one scale per weight matrix, no retraining. The
MSE-optimal clip keeps most of the accuracy; absmax rounds most weights to
zero.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import optax
import pytest

import aqtr
from aqtr import calibrations, numerics, tilings
from aqtr.data import digits

# Not importorskip: importing sklearn (~1.5 s) at collection cost every
# pytest-xdist worker; digits imports it when the data is loaded.
pytestmark = pytest.mark.skipif(
  importlib.util.find_spec('sklearn') is None, reason='needs scikit-learn'
)


@functools.partial(jax.jit, static_argnums=(2,))
def _train(x, y, steps):
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {
    'w1': jax.random.normal(k1, (64, 64)) / 8.0,
    'w2': jax.random.normal(k2, (64, 10)) / 8.0,
  }
  tx = optax.adam(1e-2)

  def loss(p):
    logits = jax.nn.relu(x @ p['w1']) @ p['w2']
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(carry, _):
    p, s = carry
    g = jax.grad(loss)(p)
    u, s = tx.update(g, s, p)
    return (optax.apply_updates(p, u), s), None

  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), None, steps)
  return params


@functools.partial(jax.jit, static_argnums=(3,))
def _accuracy(params, x, y, t):
  w1, w2 = (
    aqtr.fake_quant(params[k], t, contracting_axes=(0,)) if t else params[k]
    for k in ('w1', 'w2')
  )
  return jnp.mean((jax.nn.relu(x @ w1) @ w2).argmax(-1) == y)


def test_mse_beats_absmax_at_w2():
  d = digits.load()
  x, y = jnp.asarray(d.x_train), jnp.asarray(d.y_train)
  xv, yv = jnp.asarray(d.x_val), jnp.asarray(d.y_val)
  params = _train(x, y, 150)
  acc = {'float': float(_accuracy(params, xv, yv, None))}
  for name in ('absmax', 'mse'):
    t = aqtr.TensorConfig(
      numerics=numerics.IntSymmetric(bits=2),
      calibration=calibrations.get(name)(),
      tiling=tilings.PerTensor(),
    )
    acc[name] = float(_accuracy(params, xv, yv, t))
  assert acc['float'] > 0.9, acc
  assert acc['mse'] > acc['absmax'] + 0.1, acc
