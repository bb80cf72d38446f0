"""Tests of aqtr.calibrations.Constant (a static range)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations
from aqtr.calibrations import Constant


def _fake_quant(x, cal):
  t = aqtr.TensorConfig(calibration=cal)
  return jax.jit(functools.partial(aqtr.fake_quant, config=t))(x)


def _quantize(x, cal):
  t = aqtr.TensorConfig(calibration=cal)
  return jax.jit(functools.partial(aqtr.quantize, config=t))(x)


def test_bound_is_the_constant_per_group():
  x = jnp.arange(24.0).reshape(2, 3, 4)
  b = Constant(bound=3.0).calibrate(x, (2,))
  assert b.shape == (2, 3, 1) and b.dtype == x.dtype
  np.testing.assert_array_equal(b, 3.0)
  b = Constant(bound=3).calibrate(x.astype(jnp.bfloat16), (0, 2))
  assert b.shape == (1, 3, 1) and b.dtype == jnp.bfloat16


def test_scale_does_not_depend_on_the_data():
  x = jnp.asarray(
    np.random.default_rng(0).standard_normal((4, 16)), jnp.float32
  )
  for data in (x, 10 * x, jnp.zeros_like(x)):
    qt = _quantize(data, Constant(bound=2.0))
    np.testing.assert_allclose(qt.scale, 2.0 / 127, rtol=1e-6)
    assert jnp.isfinite(qt.dequant()).all()
  np.testing.assert_array_equal(
    _quantize(jnp.zeros((2, 4)), Constant()).dequant(), 0.0
  )


def test_values_beyond_the_bound_are_clipped():
  x = jnp.array([[-5.0, -1.0, 0.25, 1.0, 7.0]])
  y = _fake_quant(x, Constant(bound=1.0))
  np.testing.assert_allclose(y, [[-1.0, -1.0, 0.25, 1.0, 1.0]], atol=4e-3)


def test_nan_and_inf_make_the_bound_non_finite():
  x = jnp.ones((3, 4)).at[0, 1].set(jnp.nan).at[1, 0].set(jnp.inf)
  b = Constant(bound=2.0).calibrate(x, (1,))
  assert not jnp.isfinite(b[:2]).any()
  np.testing.assert_array_equal(b[2], 2.0)
  y = _fake_quant(x, Constant(bound=2.0))
  assert not jnp.isfinite(y[0]).any() and not jnp.isfinite(y[1]).any()
  np.testing.assert_allclose(y[2], 1.0, rtol=1e-2)


def test_po2_scale():
  qt = _quantize(jnp.ones((2, 4)), Constant(bound=3.0, po2_scale=True))
  np.testing.assert_array_equal(qt.scale, 2.0**-5)  # 3/127 -> 1/32


@pytest.mark.parametrize('bad', [0.0, -1.0, float('inf'), float('nan')])
def test_bound_out_of_range_names_the_field(bad):
  with pytest.raises(ValueError, match=r'Constant\.bound must be finite'):
    Constant(bound=bad)


@pytest.mark.parametrize('bad', [True, '1', None, [1.0]])
def test_bound_of_wrong_type_names_the_field(bad):
  with pytest.raises(TypeError, match=r'Constant\.bound must be a float'):
    Constant(bound=bad)


def test_registered_as_constant():
  assert calibrations.get('constant') is Constant
