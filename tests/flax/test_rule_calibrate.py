"""CALIBRATE through rules: static activation ranges on stock models."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
import aqtr.flax
from aqtr.rules import Rule

CFG = aqtr.freezers.configure(aqtr.presets.int8(), lhs='calibration')
X = jax.random.normal(jax.random.key(0), (4, 8))


class Mlp(nnx.Module):
  def __init__(self):
    self.up = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    self.down = nnx.Linear(16, 8, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def fwd(m, x):
  return nnx.jit(lambda m, x: m(x))(m, x)


def test_nnx_calibrate_convert_serve_static_ranges():
  q = aqtr.flax.quantize(Mlp(), Rule(CFG, weight=True))
  dynamic = fwd(q, 3 * X)
  aqtr.flax.calibrate(q, [X, 2 * X])
  st = q.up.aqtr_stats.get_value()['dot_general0']['lhs']
  assert int(st['count']) == 2
  want = (jnp.abs(X).max() + jnp.abs(2 * X).max()) / 2
  np.testing.assert_allclose(st['mean'], want, rtol=1e-6)
  # TRAIN now uses the static range too (as SERVE will): 3x is clipped.
  static = fwd(q, 3 * X)
  assert not np.array_equal(static, dynamic)
  served = aqtr.flax.convert(q, X)  # checks serve == train under jit
  np.testing.assert_array_equal(fwd(served, 3 * X), static)


def test_convert_before_calibrate_is_one_line():
  q = aqtr.flax.quantize(Mlp(), Rule(CFG, weight=True))
  with pytest.raises(ValueError) as e:
    aqtr.flax.convert(q, X)
  msg = str(e.value)
  assert msg.startswith('up/dot_general0: ') and '\n' not in msg
  assert 'CALIBRATE never ran' in msg and 'aqtr.flax.calibrate' in msg
  with pytest.raises(ValueError, match='batches is empty'):
    aqtr.flax.calibrate(q, [])


class LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name='down')(jax.nn.relu(nn.Dense(16, name='up')(x)))


def test_linen_calibrate_collection_and_serve_equals_train():
  q = aqtr.flax.quantize(LinenMlp(), Rule(CFG, weight=True))
  v = jax.jit(q.init)(jax.random.key(0), X)
  v = aqtr.flax.calibrate(q, [(X,), 2 * X], variables=v)
  assert int(v['aqtr_stats']['up']['dot_general0']['lhs']['count']) == 2
  sm, sv = aqtr.flax.convert(q, X, variables=v)
  np.testing.assert_array_equal(
    jax.jit(sm.apply)(sv, 3 * X), jax.jit(q.apply)(v, 3 * X)
  )
  with pytest.raises(ValueError, match=r"^up/dot_general0 .*'aqtr_stats'"):
    aqtr.flax.set_mode(q, aqtr.Mode.CALIBRATE).apply(v, X)
