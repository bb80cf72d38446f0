"""Tests of aqtr.numerics.Mx (OCP MX v1.0) against hand-computed blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import numerics, tilings
from aqtr.numerics import Mx


def _t(n):
  return aqtr.TensorConfig(
    numerics=n, tiling=tilings.SubChannel(tile_size=n.block_size)
  )


def _block(values, fill=0.0):
  """A 32-element block holding `values` first, `fill` after."""
  b = np.full(32, fill, np.float32)
  b[: len(values)] = values
  return b


# (element, block values, expected shared scale X, expected dequantized).
# X = 2^(floor(log2 amax) - emax_elem); elements x/X rounded to the element
# format (nearest even), clamped to its max normal.
ORACLE = [
  # e2m1, emax 2. amax 5: X = 2^(2-2) = 1; 5 is a tie of 4 and 6 -> 4 (even
  # mantissa); 2.6 -> 3; 0.2 -> 0 (tie of 0 and 0.5 is below 0.25); -1.3 ->
  # -1.5 (nearest of 1, 1.5).
  ('fp4_e2m1', [5.0, 2.6, 0.2, -1.3], 1.0, [4.0, 3.0, 0.0, -1.5]),
  # amax 0.9: X = 2^(-1-2) = 1/8; 0.9/X = 7.2 is clamped to 6 -> 0.75.
  ('fp4_e2m1', [0.9, -0.3, 0.05], 0.125, [0.75, -0.25, 0.0625]),
  # e4m3, emax 8. amax 1000: X = 2^(9-8) = 2; 500 clamps to 448 -> 896;
  # 3 / 2 = 1.5 exact; 0.1 / 2 = 0.05 -> e4m3 0.05078125 (13 * 2^-8).
  ('fp8_e4m3', [1000.0, 3.0, 0.1], 2.0, [896.0, 3.0, 0.1015625]),
  # e5m2, emax 15. amax 1: X = 2^(0-15); 0.3 -> 0.3125 (1.25 * 2^-2).
  ('fp8_e5m2', [1.0, 0.3], 2.0**-15, [1.0, 0.3125]),
  # e2m3, emax 2. amax 7: X = 2^(2-2) = 1; 7 -> 7; 1.1 -> 1.125.
  ('fp6_e2m3', [7.0, 1.1], 1.0, [7.0, 1.125]),
  # e3m2, emax 4. amax 20: X = 2^(4-4) = 1; 20 -> 20; 0.3 -> 0.3125.
  ('fp6_e3m2', [20.0, 0.3], 1.0, [20.0, 0.3125]),
  # MXINT8: int8 with implicit 2^-6, emax 0. amax 3: X = 2^(1-0) = 2;
  # 3 / 2 = 1.5 -> 96/64; 0.01 -> 0; -2.5 / 2 -> -80/64.
  ('int8', [3.0, 0.01, -2.5], 2.0, [3.0, 0.0, -2.5]),
]


@pytest.mark.parametrize('element, values, scale, want', ORACLE)
def test_hand_computed_blocks(element, values, scale, want):
  n = Mx(element=element)
  # Two blocks: the oracle block, then one of 1s (X = 2^-emax) to show the
  # scale is per block.
  x = np.concatenate([_block(values), np.ones(32, np.float32)])[None]
  qt = jax.jit(lambda x: aqtr.quantize(x, _t(n)))(jnp.asarray(x))
  assert qt.qvalue.dtype == n.dtype
  np.testing.assert_array_equal(
    qt.scale.ravel() / n.unit, [scale, 2.0**-n.emax]
  )
  got = np.asarray(qt.dequant())[0]
  np.testing.assert_array_equal(got[: len(want)], want)
  np.testing.assert_array_equal(got[len(want) : 32], 0.0)
  np.testing.assert_array_equal(got[32:], 1.0)


def test_scales_are_e8m0_values():
  n = Mx(element='fp8_e4m3')
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 256)) * np.exp(rng.uniform(-20, 20, (8, 1)))
  s = jax.jit(lambda x: aqtr.quantize(x, _t(n)).scale)(jnp.asarray(x))
  s = np.asarray(s, np.float32)
  as_e8m0 = s.astype(jnp.float8_e8m0fnu).astype(np.float32)
  np.testing.assert_array_equal(as_e8m0, s)


@pytest.mark.parametrize(
  'element, emax, dtype, kind',
  [
    ('fp8_e4m3', 8, 'float8_e4m3fn', 'float'),
    ('fp8_e5m2', 15, 'float8_e5m2', 'float'),
    ('fp6_e2m3', 2, 'float8_e4m3fn', 'float'),
    ('fp6_e3m2', 4, 'float8_e4m3fn', 'float'),
    ('fp4_e2m1', 2, 'float8_e4m3fn', 'float'),
    ('int8', 0, 'int8', 'int'),
  ],
)
def test_element_formats(element, emax, dtype, kind):
  n = Mx(element=element)
  assert (n.emax, n.dtype, n.kind, n.block_size) == (emax, dtype, kind, 32)


def test_mxint8_dot_is_an_int8_dot():
  t = _t(Mx(element='int8'))
  cfg = aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=t, rhs=t))
  dn = (((1,), (0,)), ((), ()))
  jaxpr = jax.make_jaxpr(lambda x, w: aqtr.dot_general(x, w, dn, cfg))(
    jnp.ones((4, 64)), jnp.ones((64, 8))
  )
  assert 'preferred_element_type=int32' in str(jaxpr)


def test_tiling_and_contraction_are_validated():
  with pytest.raises(ValueError, match=r'TensorConfig.tiling.*tile_size=32'):
    aqtr.TensorConfig(numerics=Mx())
  with pytest.raises(ValueError, match=r'TensorConfig.tiling.*tile_size=32'):
    aqtr.TensorConfig(numerics=Mx(), tiling=tilings.SubChannel(tile_size=16))
  cfg = aqtr.fiddle.config('mxfp8')
  with pytest.raises(ValueError, match=r'fwd.lhs.tiling.*tile_size=32'):
    aqtr.validation.check_shapes(
      cfg, (32, 48), (48, 32), (((1,), (0,)), ((), ()))
    )


def test_stochastic_rounding_with_floor_scales_is_rejected():
  with pytest.raises(ValueError, match=r'TensorConfig.rounding.*Mx'):
    aqtr.TensorConfig(
      numerics=Mx(),
      tiling=tilings.SubChannel(tile_size=32),
      rounding=aqtr.Stochastic(),
    )


def test_registered():
  assert numerics.get('mx') is Mx
