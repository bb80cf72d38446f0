"""Weight formats: unbiased stochastic rounding, stable scales, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqtr import qt
from aqtr.qt import formats


@pytest.mark.parametrize(
  'fmt', [qt.int8(), qt.int4(32), qt.fp8()], ids=lambda f: f.kind
)
def test_stochastic_rounding_is_unbiased(fmt):
  # E[Q_SR(w + d)] = w + d: average the dequantized value over many keys.
  w = jax.random.normal(jax.random.key(0), (32, 4))
  w = w.at[0].set(4.0)  # Pins every channel's scale (max |w| = 4).
  d = 1e-3 * jax.random.normal(jax.random.key(1), (32, 4))
  p, _ = qt.quantize_params({'kernel': w}, [qt.Rule(fmt=fmt)])
  p = p['kernel']
  n = 2000

  def one(k):
    return qt.requantize(p, w + d, k).dequant()

  keys = jax.random.split(jax.random.key(2), n)
  mean = jax.jit(jax.vmap(one))(keys).mean(0)
  near = qt.requantize(p, w + d).dequant()
  err_sr = np.abs(np.asarray(mean - (w + d)))
  err_near = np.abs(np.asarray(near - (w + d)))
  step = 4.0 / fmt.qmax
  # Standard error of the mean is below step / (2 sqrt(n)); allow 5 sigma
  # (fp8 steps are at most 4 / 448 * 32 apart: use the int bound for int).
  bound = 5 * (step if fmt.kind != 'fp8' else 4.0 / 14) / (2 * np.sqrt(n))
  assert err_sr.max() < bound
  assert err_sr.mean() < err_near.mean() / 4


def test_nearest_rounding_loses_small_updates():
  w = jax.random.normal(jax.random.key(0), (64, 8))
  p, _ = qt.quantize_params({'kernel': w})
  p = p['kernel']
  w0 = p.dequant()
  again = qt.requantize(p, w0 + 1e-5)
  np.testing.assert_array_equal(again.qvalue, p.qvalue)


@pytest.mark.parametrize(
  'fmt', [qt.int8(), qt.int4(32), qt.fp8()], ids=lambda f: f.kind
)
def test_stable_scale_makes_products_exact(fmt):
  qmax = fmt.qmax  # 127, 7, 448.
  b = jnp.asarray(
    np.random.default_rng(0).lognormal(size=20000).astype(np.float32)
  )
  s = np.asarray(formats.weight_scale(b, fmt))
  assert np.all(s >= np.asarray(b) / np.float32(qmax) * (1 - 1e-7))
  assert np.all(np.abs(s / (np.asarray(b) / qmax) - 1) < 2**-14)
  np.testing.assert_array_equal((np.float32(qmax) * s) / np.float32(qmax), s)
  assert float(formats.weight_scale(jnp.zeros(()), fmt)) == 1.0


def test_fp8_stochastic_rounds_between_neighbours():
  v = jnp.full((20000,), 1.1)  # e4m3 neighbours: 1.0 and 1.125.
  fmt = qt.fp8()
  q = formats.quantize_values(v, fmt, jax.random.key(0)).astype(jnp.float32)
  assert set(np.unique(np.asarray(q)).tolist()) == {1.0, 1.125}
  assert abs(float(q.mean()) - 1.1) < 3e-3
  tiny = formats.quantize_values(
    jnp.full((20000,), -3e-3), fmt, jax.random.key(1)
  )
  assert abs(float(tiny.astype(jnp.float32).mean()) + 3e-3) < 1e-4


def test_format_validation():
  with pytest.raises(ValueError, match='kind must be one of'):
    qt.WeightFormat(kind='int2')
  with pytest.raises(ValueError, match='group_size must be one of'):
    qt.int4(group_size=48)
  with pytest.raises(ValueError, match='group_size must be 0'):
    qt.WeightFormat(kind='int8', group_size=32)
  with pytest.raises(TypeError, match='contracting_axes'):
    qt.WeightFormat(contracting_axes=[0])
  with pytest.raises(ValueError, match='activation_bits'):
    formats.dot_config(qt.int8(), activation_bits=4)


def test_too_small_to_group_names_the_parameter():
  params = {'Dense_0': {'kernel': jnp.ones((64, 8))}}
  with pytest.raises(ValueError, match="'Dense_0/kernel'.*group_size=128"):
    qt.quantize_params(params, [qt.Rule(fmt=qt.int4(128))])
  with pytest.raises(ValueError, match="'bias'.*contraction axis"):
    qt.quantize_params({'bias': jnp.ones(8)}, [qt.Rule(pattern='bias')])


def test_contracting_axes_out_of_range_or_repeated_are_named():
  # Axis 5 of a 2-D weight used to wrap to axis 1 (the wrong contraction).
  w = {'kernel': jnp.ones((64, 16))}
  with pytest.raises(
    ValueError, match=r"contracting_axes for parameter 'kernel' has axis 5"
  ):
    qt.quantize_params(w, [qt.Rule(fmt=qt.int8(contracting_axes=(5,)))])
  with pytest.raises(ValueError, match='contracting_axes repeats an axis'):
    qt.WeightFormat(contracting_axes=(0, 0))
  q, _ = qt.quantize_params(w, [qt.Rule(fmt=qt.int8(contracting_axes=(-2,)))])
  assert q['kernel'].layout.contract == (0,)
