"""Scales over the whole float32 range (aqtr/core/scale.py).

Tiny and huge magnitudes quantize with the same relative error as values
near 1, for float32, bfloat16 and float16 inputs; bounds so small that
`bound / max_value` would be subnormal use the smallest normal scale (never
0, which XLA:CPU's flushing would make of a subnormal); only an exactly
zero group falls back to s = 1; po2 scales are exact powers of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr import calibrations, numerics
from aqtr.core import scale as scale_lib

MK_KN = (((1,), (0,)), ((), ()))
_NUMERICS = {
  'int8': numerics.IntSymmetric(bits=8),
  'int4_half': numerics.IntSymmetric(bits=4, preserve_zero=False),
  'e4m3': numerics.Fp8(dtype_name='float8_e4m3fn'),
  'e5m2': numerics.Fp8(dtype_name='float8_e5m2'),
}


def _rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def _randn(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize('num', list(_NUMERICS.values()), ids=list(_NUMERICS))
def test_relative_error_does_not_depend_on_magnitude(num):
  t = aqtr.TensorConfig(numerics=num)
  x = _randn(0, (4, 64))
  fq = jax.jit(lambda x: aqtr.fake_quant(x, t))
  base = _rel_err(fq(x), x)
  for c in (1e-30, 1e-20, 1e20, 1e30):
    xc = x * np.float32(c)
    err = _rel_err(fq(xc), xc)
    assert err == pytest.approx(base, rel=0.02), (c, err, base)


@pytest.mark.parametrize(
  'dtype, scales',
  [('bfloat16', (1e-30, 1e30)), ('float16', (2.0**-8, 2.0**8))],
)
def test_half_precision_inputs_keep_the_relative_error(dtype, scales):
  cfg = aqtr.presets.int8()
  run = jax.jit(lambda x, w: aqtr.dot_general(x, w, MK_KN, cfg))
  x, w = _randn(1, (8, 32)), _randn(2, (32, 8))
  ref = lax.dot_general(x, w, MK_KN)
  base = _rel_err(run(x.astype(dtype), w.astype(dtype)), ref)
  for c in scales:
    xc = (x * np.float32(c)).astype(dtype)
    got = run(xc, w.astype(dtype))
    assert got.dtype == jnp.dtype(dtype)
    err = _rel_err(np.asarray(got, np.float32) / np.float32(c), ref)
    assert err < 1.5 * base + 1e-2, (c, err, base)


def test_issue_example_tiny_times_huge_is_not_zero():
  x, w = _randn(3, (16, 32)), _randn(4, (32, 128))
  xs, ws = x * np.float32(1e-37), w * np.float32(1e30)
  got = jax.jit(
    lambda x, w: aqtr.dot_general(x, w, MK_KN, aqtr.presets.int8())
  )(xs, ws)
  want = lax.dot_general(xs, ws, MK_KN)
  assert (np.asarray(got) != 0).all()
  # 1e-37 is below 127 * 2^-126: the smallest normal scale, fewer levels.
  assert _rel_err(got, want) < 0.1


def test_scale_from_bound_edge_cases():
  num = numerics.IntSymmetric(bits=8)
  tiny = scale_lib.TINY
  bounds = jnp.array([0.0, 1e-37, 127 * tiny, 1.0, 3e38, jnp.inf, jnp.nan])
  for po2 in (False, True):
    s = np.asarray(
      jax.jit(scale_lib.scale_from_bound, static_argnums=(1, 2))(
        bounds, num, po2
      )
    )
    assert s[0] == 1.0  # an all-zero group
    assert s[1] == tiny and s[2] == tiny  # never subnormal, never 0
    assert np.isnan(s[5:]).all()  # non-finite groups
    assert np.isfinite(s[:5]).all() and (s[:5] > 0).all()
    if po2:
      np.testing.assert_array_equal(s[:5], 2.0 ** np.round(np.log2(s[:5])))
      assert (s[:5] * 127 >= np.asarray(bounds[:5])).all()
    else:
      np.testing.assert_allclose(s[3:5], np.asarray(bounds[3:5]) / 127)


@pytest.mark.parametrize('po2', [False, True])
def test_only_an_exactly_zero_group_gets_scale_one(po2):
  cal = calibrations.AbsMax(po2_scale=po2)
  t = aqtr.TensorConfig(calibration=cal)
  x = np.zeros((3, 8), np.float32)
  x[1, 2] = 1e-37
  x[2, 5] = -3e-30
  qt = jax.jit(lambda x: aqtr.quantize(x, t))(x)
  s = np.asarray(qt.scale).ravel()
  assert s[0] == 1.0 and s[1] < 1e-37 and s[2] < 1e-31
  dq = np.asarray(qt.dequant())
  np.testing.assert_array_equal(dq[0], 0.0)
  assert dq[1, 2] != 0 and dq[2, 5] != 0
  np.testing.assert_allclose(dq[2], x[2], rtol=1e-6 if not po2 else 0.5)


def test_po2_ceil_is_exact_where_exp2_is_not():
  e = np.arange(-126, 127)
  s = jnp.asarray(2.0**e, jnp.float32)
  got = np.asarray(jax.jit(scale_lib.po2_ceil)(s))
  np.testing.assert_array_equal(got, s)  # powers of two are kept
  up = np.asarray(jax.jit(scale_lib.po2_ceil)(s[:-1] * 1.5))
  np.testing.assert_array_equal(up, np.asarray(s[1:]))


@pytest.mark.parametrize('max_value', [127.0, 7.0, 448.0, 7.5])
def test_requantizable_scales_make_the_top_product_exact(max_value):
  b = np.random.default_rng(0).lognormal(size=20000).astype(np.float32)
  s0 = scale_lib.scale_from_bound(jnp.asarray(b), numerics.IntSymmetric(bits=8))
  s0 = np.asarray(s0) * np.float32(127.0 / max_value)
  s = np.asarray(scale_lib.requantizable(jnp.asarray(s0), max_value))
  odd = float(max_value).as_integer_ratio()[0]
  while odd % 2 == 0:
    odd //= 2
  assert np.all(s >= s0)
  assert np.all(s / s0 - 1 < 2.0 ** -(23 - odd.bit_length()))
  top = np.float32(max_value) * s  # Exact: s keeps 24 - bits(odd) bits.
  np.testing.assert_array_equal(
    top.astype(np.float64), np.float64(max_value) * s.astype(np.float64)
  )


def test_requantizable_keeps_special_scales():
  s = jnp.array([1.0, scale_lib.TINY, 0.5, jnp.nan], jnp.float32)
  out = np.asarray(scale_lib.requantizable(s, 127.0))
  np.testing.assert_array_equal(out[:3], np.asarray(s)[:3])
  assert np.isnan(out[3])
  nan = lax.bitcast_convert_type(jnp.uint32(0x7FFFFFFF), jnp.float32)
  assert bool(jnp.isnan(scale_lib.requantizable(nan, 127.0)))
