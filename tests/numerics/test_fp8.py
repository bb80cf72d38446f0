"""Tests of aqtr.numerics.Fp8 (Micikevicius et al. 2022, arXiv 2209.05433)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics
from aqtr.numerics import Fp8

FORMATS = [
  ('float8_e4m3fn', 448.0, ml_dtypes.float8_e4m3fn),
  ('float8_e5m2', 57344.0, ml_dtypes.float8_e5m2),
  ('float8_e4m3fnuz', 240.0, ml_dtypes.float8_e4m3fnuz),
  ('float8_e5m2fnuz', 57344.0, ml_dtypes.float8_e5m2fnuz),
]


def _t(n, calibration=None):
  return aqtr.TensorConfig(
    numerics=n, calibration=calibration or calibrations.AbsMax()
  )


def _quantize(x, t):
  return jax.jit(functools.partial(aqtr.quantize, config=t))(x)


@pytest.mark.parametrize('name, max_value, np_dtype', FORMATS)
def test_max_value_and_dtype(name, max_value, np_dtype):
  n = Fp8(dtype_name=name)
  assert n.max_value == max_value == float(ml_dtypes.finfo(np_dtype).max)
  assert n.dtype == jnp.dtype(np_dtype) and n.dot_dtype == n.dtype
  assert n.kind == 'float' and n.quantizes and n.unit == 1.0
  assert n.supports_stochastic_rounding


def test_default_is_e4m3():
  assert Fp8().dtype == jnp.float8_e4m3fn


@pytest.mark.parametrize('name, max_value, np_dtype', FORMATS)
def test_saturates_at_finfo_max_and_keeps_nan(name, max_value, np_dtype):
  n = Fp8(dtype_name=name)
  v = jnp.array([1e6, -1e6, jnp.inf, -jnp.inf, max_value, jnp.nan, 1.0])
  q = np.asarray(jax.jit(n.quantize)(v).astype(jnp.float32))
  m = max_value
  np.testing.assert_array_equal(q[:5], [m, -m, m, -m, m])
  assert np.isnan(q[5]) and q[6] == 1.0


@pytest.mark.parametrize('name, max_value, np_dtype', FORMATS)
def test_rounds_to_nearest_even_like_ml_dtypes(name, max_value, np_dtype):
  n = Fp8(dtype_name=name)
  rng = np.random.default_rng(0)
  v = rng.standard_normal(4096).astype(np.float32) * np.float32(max_value / 8)
  v = np.concatenate([v, rng.uniform(-2, 2, 4096).astype(np.float32)])
  q = jax.jit(n.quantize)(jnp.asarray(v))
  assert q.dtype == n.dtype
  np.testing.assert_array_equal(
    np.asarray(q).view(np.uint8), v.astype(np_dtype).view(np.uint8)
  )
  # Every finite value of the format is a fixed point.
  every = np.arange(256, dtype=np.uint8).view(np_dtype)
  every = every[np.isfinite(every.astype(np.float32))].astype(np.float32)
  back = jax.jit(n.quantize)(jnp.asarray(every)).astype(jnp.float32)
  np.testing.assert_array_equal(back, every)


@pytest.mark.parametrize(
  'name, mantissa_bits, min_subnormal',
  [('float8_e4m3fn', 3, 2.0**-9), ('float8_e5m2', 2, 2.0**-16)],
)
def test_quantize_maps_the_bound_to_max_with_relative_error(
  name, mantissa_bits, min_subnormal
):
  n = Fp8(dtype_name=name)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  qt = _quantize(x, _t(n))
  q = qt.qvalue.astype(jnp.float32).reshape(8, 64)
  np.testing.assert_array_equal(jnp.abs(q).max(axis=1), n.max_value)
  s = qt.scale.reshape(8, 1)
  err = jnp.abs(qt.dequant() - x)
  tol = jnp.maximum(jnp.abs(x) * 2.0 ** -(mantissa_bits + 1), s * min_subnormal)
  assert (err <= tol * (1 + 1e-6)).all()


def test_nan_and_inf_propagate_through_dot_general():
  x = jnp.ones((3, 16)).at[0, 2].set(jnp.nan).at[1, 5].set(jnp.inf)
  w = jnp.ones((16, 4))
  out = aqtr.dot_general(x, w, (((1,), (0,)), ((), ())), aqtr.presets.fp8())
  assert not jnp.isfinite(out[0]).any() and not jnp.isfinite(out[1]).any()
  np.testing.assert_allclose(out[2], 16.0, rtol=1e-6)


def test_fp8_dot_really_runs_in_fp8():
  cfg = aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=_t(Fp8()), rhs=_t(Fp8())),
  )
  jaxpr = jax.make_jaxpr(
    lambda x, w: aqtr.dot_general(x, w, (((1,), (0,)), ((), ())), cfg)
  )(jnp.ones((4, 8)), jnp.ones((8, 2)))
  assert 'f8_e4m3fn' in str(jaxpr)


@pytest.mark.parametrize('name', ['float8_e4m3fn', 'float8_e5m2fnuz'])
def test_stochastic_rounding_is_unbiased_over_many_keys(name):
  n = Fp8(dtype_name=name)
  t = aqtr.TensorConfig(
    numerics=n,
    calibration=calibrations.Constant(bound=n.max_value),
    rounding=aqtr.Stochastic(),
  )
  # Between grid points at several exponents, a subnormal, and the max.
  v = jnp.array([[0.3, -1.3, 2.7, 17.0, -100.0, 2.0**-12, n.max_value]])

  @jax.jit
  def draws(keys):
    return jax.vmap(lambda k: aqtr.quantize(v, t, key=k).qvalue)(keys)

  q = draws(jax.random.split(jax.random.key(0), 8192))
  assert q.dtype == n.dtype
  q = np.asarray(q.astype(jnp.float32)).reshape(8192, -1)
  grid = np.arange(256, dtype=np.uint8).view(n.dtype).astype(np.float32)
  grid = np.unique(grid[np.isfinite(grid)])
  for j, x in enumerate(np.asarray(v[0])):
    lo, hi = grid[grid <= x].max(), grid[grid >= x].min()
    assert set(np.unique(q[:, j])) <= {lo, hi}, (x, lo, hi)
    # E[q] = v: within 4 standard errors of the mean of 8192 draws.
    tol = 4 * (hi - lo) / 2 / np.sqrt(8192) + 1e-7
    assert abs(q[:, j].mean() - x) <= tol, (x, q[:, j].mean())
  # Saturates: the max never rounds up.
  assert (q[:, -1] == n.max_value).all()


def test_stochastic_rounding_in_dot_general_gradient():
  e5 = aqtr.TensorConfig(
    numerics=Fp8(dtype_name='float8_e5m2'), rounding=aqtr.Stochastic()
  )
  e4 = aqtr.TensorConfig(numerics=Fp8())
  cfg = aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=e4, rhs=e4),
    dlhs=aqtr.DotGeneralRaw(lhs=e5, rhs=e4, use_fwd_quant=True),
    drhs=aqtr.DotGeneralRaw(lhs=e5, rhs=e4, use_fwd_quant=True),
  )
  x = jnp.ones((4, 16))
  w = jnp.ones((16, 8))
  dn = (((1,), (0,)), ((), ()))
  f = jax.jit(
    jax.grad(
      lambda x, w, k: aqtr.dot_general(x, w, dn, cfg, key=k).sum(), (0, 1)
    )
  )
  dx, dw = f(x, w, jax.random.key(0))
  np.testing.assert_allclose(dx, 8.0, rtol=0.02)
  np.testing.assert_allclose(dw, 4.0, rtol=0.02)


def test_clip_gradient_masks_saturated_values():
  x = jnp.array([[-2.0, -1.0, 0.5, 1.0, 3.0]])
  for n, want in ((Fp8(clip_gradient=True), [[0, 1, 1, 1, 0]]), (Fp8(), 1)):
    t = _t(n, calibrations.Constant(bound=1.0))
    g = jax.jit(jax.grad(lambda x, t=t: aqtr.fake_quant(x, t).sum()))(x)
    np.testing.assert_array_equal(g, np.broadcast_to(want, x.shape))


@pytest.mark.parametrize('bad', ['float16', 'float8_e4m3', 'e5m2', None])
def test_dtype_name_validation_lists_the_choices(bad):
  with pytest.raises(ValueError, match=r'Fp8\.dtype_name must be one of'):
    Fp8(dtype_name=bad)


def test_registered_as_fp8():
  assert numerics.get('fp8') is Fp8
