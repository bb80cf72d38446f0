"""Tests of aqtr.calibrations.AbsMax."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations
from aqtr.calibrations import AbsMax


def _x(seed=0, shape=(4, 32)):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * 2.0, jnp.float32)


def _fake_quant(x, cal):
  t = aqtr.TensorConfig(calibration=cal)
  return jax.jit(functools.partial(aqtr.fake_quant, config=t))(x)


def _quantize(x, cal, **kw):
  t = aqtr.TensorConfig(calibration=cal)
  return jax.jit(functools.partial(aqtr.quantize, config=t, **kw))(x)


@pytest.mark.parametrize('clip_scale', [1.0, 0.5, 2, 1.25])
def test_bound_is_clip_scale_times_absmax(clip_scale):
  x = _x()
  b = AbsMax(clip_scale=clip_scale).calibrate(x, (1,))
  want = clip_scale * np.abs(np.asarray(x)).max(axis=1, keepdims=True)
  np.testing.assert_allclose(b, want, rtol=1e-6)
  b = AbsMax(clip_scale=clip_scale).calibrate(x, (0, 1))
  assert b.shape == (1, 1)
  np.testing.assert_allclose(b, clip_scale * np.abs(np.asarray(x)).max())


def test_scale_is_bound_over_max_value():
  x = _x(1)
  s = _quantize(x, AbsMax()).scale.ravel()
  np.testing.assert_allclose(s, jnp.max(jnp.abs(x), axis=1) / 127, rtol=1e-6)


def test_all_zero_input_gives_scale_one_without_nan():
  for cal in (AbsMax(), AbsMax(po2_scale=True), AbsMax(clip_scale=0.5)):
    x = jnp.zeros((3, 8)).at[2].set(1.0)
    qt = _quantize(x, cal)
    s = qt.scale.ravel()
    np.testing.assert_array_equal(s[:2], 1.0)
    np.testing.assert_array_equal(qt.dequant()[:2], 0.0)
    assert jnp.isfinite(qt.dequant()).all()
    np.testing.assert_allclose(
      qt.dequant()[2], 1.0 if cal.clip_scale == 1 else 0.5
    )


def test_subnormal_bounds_give_a_finite_scale():
  # Subnormal values (zero to XLA:CPU, which flushes them): no inf, no NaN.
  x = jnp.full((2, 4), 1e-42)
  qt = _quantize(x, AbsMax())
  assert jnp.isfinite(qt.scale).all() and (qt.scale > 0).all()
  assert jnp.isfinite(qt.dequant()).all()
  np.testing.assert_allclose(qt.dequant(), x, atol=1.2e-38)


def test_nan_and_inf_make_the_bound_non_finite():
  x = _x(2).at[0, 1].set(jnp.nan).at[1, 2].set(-jnp.inf)
  b = AbsMax().calibrate(x, (1,))
  # NaN counts as larger than any value: its group's bound is inf.
  assert b[0, 0] == jnp.inf and b[1, 0] == jnp.inf
  assert jnp.isfinite(b[2:]).all()
  out = _fake_quant(x, AbsMax())
  assert not jnp.isfinite(out[0]).any() and not jnp.isfinite(out[1]).any()
  assert jnp.isfinite(out[2:]).all()


def test_clip_scale_below_one_clips_the_largest_values():
  x = _x(3)
  y = _fake_quant(x, AbsMax(clip_scale=0.5))
  half = 0.5 * jnp.max(jnp.abs(x), axis=1)
  np.testing.assert_allclose(jnp.max(jnp.abs(y), axis=1), half, rtol=1e-6)


def test_po2_scale_is_the_next_power_of_two():
  x = _x(4)
  s = _quantize(x, AbsMax(po2_scale=True)).scale.ravel()
  exact = np.abs(np.asarray(x)).max(axis=1) / 127.0
  np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))
  assert (s >= exact * (1 - 1e-6)).all() and (s < 2 * exact).all()


@pytest.mark.parametrize('bad', [0.0, -0.5, float('nan'), float('inf')])
def test_clip_scale_out_of_range_names_the_field(bad):
  with pytest.raises(ValueError, match=r'AbsMax\.clip_scale must be finite'):
    AbsMax(clip_scale=bad)


@pytest.mark.parametrize('bad', [True, '1.0', None, (1.0,)])
def test_clip_scale_of_wrong_type_names_the_field(bad):
  with pytest.raises(TypeError, match=r'AbsMax\.clip_scale must be a float'):
    AbsMax(clip_scale=bad)


def test_registered_as_absmax():
  assert calibrations.get('absmax') is AbsMax
  assert aqtr.TensorConfig().calibration == AbsMax()
