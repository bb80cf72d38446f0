"""Tests of aqtr.numerics.Fp (emulated small floats) and FloatGrid."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics
from aqtr.numerics import Fp
from aqtr.numerics.fp import FloatGrid

# (exponent_bits, mantissa_bits, encoding, the ml_dtypes type, its storage).
FORMATS = [
  (2, 1, 'auto', ml_dtypes.float4_e2m1fn, 'float8_e4m3fn'),
  (2, 3, 'auto', ml_dtypes.float6_e2m3fn, 'float8_e4m3fn'),
  (3, 2, 'auto', ml_dtypes.float6_e3m2fn, 'float8_e4m3fn'),
  (4, 3, 'auto', ml_dtypes.float8_e4m3fn, 'float8_e4m3fn'),
  (5, 2, 'auto', ml_dtypes.float8_e5m2, 'float8_e5m2'),
  (4, 3, 'fnuz', ml_dtypes.float8_e4m3fnuz, 'float8_e4m3fnuz'),
  (5, 2, 'fnuz', ml_dtypes.float8_e5m2fnuz, 'float8_e5m2fnuz'),
  (4, 3, 'ieee', ml_dtypes.float8_e4m3, 'float8_e4m3fn'),
  (3, 4, 'ieee', ml_dtypes.float8_e3m4, 'float16'),
]


def _every_value(dtype):
  """Every finite value of an 8-bit (or smaller) ml_dtypes type, sorted."""
  v = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
  return np.unique(v[np.isfinite(v)])


@pytest.mark.parametrize('e, m, enc, dtype, storage', FORMATS)
def test_value_set_and_rounding_equal_ml_dtypes(e, m, enc, dtype, storage):
  n = Fp(exponent_bits=e, mantissa_bits=m, encoding=enc)
  every = _every_value(dtype)
  assert n.max_value == float(ml_dtypes.finfo(dtype).max) == every.max()
  assert n.dtype == jnp.dtype(storage)
  quantize = jax.jit(n.quantize)
  # Round trip: every value is a fixed point.
  back = np.asarray(quantize(jnp.asarray(every)).astype(jnp.float32))
  np.testing.assert_array_equal(back, every)
  # Nearest rounding (ties to even) equals ml_dtypes' cast: midpoints,
  # points near them and random values inside the range.
  rng = np.random.default_rng(e * 16 + m)
  mid = (every[1:] + every[:-1]) / 2
  near = mid[:, None] * (1 + np.array([-1e-3, 1e-3]))
  v = np.concatenate(
    [
      mid,
      near.ravel(),
      rng.uniform(-1, 1, 4096) * n.max_value,
      rng.standard_normal(4096) * 2.0 ** (1 - n.bias),
    ]
  ).astype(np.float32)
  q = np.asarray(quantize(jnp.asarray(v)).astype(jnp.float32))
  np.testing.assert_array_equal(q, v.astype(dtype).astype(np.float32))
  assert set(np.unique(q)) <= set(every)


@pytest.mark.parametrize('e, m, enc, dtype, storage', FORMATS[::4])
def test_saturates_and_keeps_nan(e, m, enc, dtype, storage):
  n = Fp(exponent_bits=e, mantissa_bits=m, encoding=enc)
  mx = n.max_value
  v = jnp.array([1e9, -1e9, jnp.inf, -jnp.inf, 2 * mx, jnp.nan])
  q = np.asarray(jax.jit(n.quantize)(v).astype(jnp.float32))
  np.testing.assert_array_equal(q[:5], [mx, -mx, mx, -mx, mx])
  assert np.isnan(q[5])


def test_e2m1_is_the_ocp_fp4_grid():
  every = Fp(exponent_bits=2, mantissa_bits=1).quantize(jnp.linspace(0, 7, 701))
  values = np.unique(np.asarray(every.astype(jnp.float32)))
  np.testing.assert_array_equal(values, [0, 0.5, 1, 1.5, 2, 3, 4, 6])


@pytest.mark.parametrize(
  'e, m, enc, max_value',
  [
    (2, 1, 'auto', 6.0),
    (4, 3, 'auto', 448.0),
    (5, 2, 'auto', 57344.0),
    (2, 2, 'ieee', 3.5),
    (5, 10, 'auto', 65504.0),
    (1, 2, 'auto', 3.5),
  ],
)
def test_max_value_by_encoding(e, m, enc, max_value):
  assert Fp(exponent_bits=e, mantissa_bits=m, encoding=enc).max_value == (
    max_value
  )


def test_stochastic_rounding_is_unbiased_over_many_keys():
  n = Fp(exponent_bits=2, mantissa_bits=1)
  t = aqtr.TensorConfig(
    numerics=n,
    calibration=calibrations.Constant(bound=n.max_value),
    rounding=aqtr.Stochastic(),
  )
  v = jnp.array([[0.1, 0.7, -1.2, 2.5, -3.3, 5.1, 6.0, -0.3]])

  @jax.jit
  def draws(keys):
    return jax.vmap(lambda k: aqtr.quantize(v, t, key=k).dequant())(keys)

  q = np.asarray(draws(jax.random.split(jax.random.key(0), 8192)))[:, 0]
  np.testing.assert_allclose(q.mean(0), v[0], atol=0.03)
  # Each draw is one of the two neighbours on the grid.
  assert set(np.unique(q[:, 3]).tolist()) == {2.0, 3.0}
  assert set(np.unique(q[:, 6]).tolist()) == {6.0}


def test_float_grid_stochastic_rounding_stays_in_range():
  g = FloatGrid.of_dtype(ml_dtypes.float8_e4m3fn)
  v = jnp.array([448.0, -448.0, 447.0, 1e6, 2.0**-9 * 0.25])
  u = jnp.full(v.shape, 0.5 - 2.0**-17)  # the largest noise value
  q = np.asarray(jax.jit(g.round)(v, u))
  np.testing.assert_array_equal(q, [448, -448, 448, 448, 2.0**-9])


def test_in_dot_general_stores_and_contracts_in_the_container():
  n = Fp(exponent_bits=2, mantissa_bits=1)
  t = aqtr.TensorConfig(numerics=n)
  raw = aqtr.DotGeneralRaw(lhs=t, rhs=t)
  cfg = aqtr.DotGeneralConfig(fwd=raw)
  dn = (((1,), (0,)), ((), ()))
  jaxpr = str(
    jax.make_jaxpr(
      functools.partial(aqtr.dot_general, dimension_numbers=dn, config=cfg)
    )(jnp.ones((4, 8)), jnp.ones((8, 2)))
  )
  assert 'f8_e4m3fn' in jaxpr


@pytest.mark.parametrize(
  'kwargs, field',
  [
    ({'exponent_bits': 0}, 'exponent_bits'),
    ({'exponent_bits': 6}, 'exponent_bits'),
    ({'mantissa_bits': -1}, 'mantissa_bits'),
    ({'mantissa_bits': 1.0}, 'mantissa_bits'),
    ({'encoding': 'e4m3'}, 'encoding'),
    ({'exponent_bits': 1, 'encoding': 'ieee'}, 'exponent_bits'),
    ({'mantissa_bits': 0, 'encoding': 'fn'}, 'mantissa_bits'),
    ({'clip_gradient': 1}, 'clip_gradient'),
  ],
)
def test_bad_fields_name_the_field(kwargs, field):
  with pytest.raises((TypeError, ValueError), match=rf'Fp\..*{field}'):
    Fp(**kwargs)


def test_registered_as_fp():
  assert numerics.get('fp') is Fp
