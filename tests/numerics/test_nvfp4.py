"""Tests of aqtr.numerics.NvFp4 against a hand-computed two-level scale."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import aqtr
from aqtr import numerics, tilings
from aqtr.numerics import NvFp4

_T = aqtr.TensorConfig(
  numerics=NvFp4(), tiling=tilings.SubChannel(tile_size=16)
)


def test_hand_computed_blocks():
  # Block 0 holds the tensor's amax 2688 = 448 * 6: s_t = 1; its block
  # scale e4m3(2688 / 6) = 448. Block 1's amax 30: 30/6 = 5 is e4m3 -> s = 5;
  # 13/5 = 2.6 -> e2m1 3 -> 15; -7/5 = -1.4 -> -1.5 -> -7.5. Block 2's amax
  # 0.7: 0.7/6 = 0.11667 -> e4m3 0.1171875 (15 * 2^-7); 0.7/s = 5.97 -> 6.
  x = np.zeros((1, 48), np.float32)
  x[0, 0], x[0, 1] = 2688.0, 1000.0
  x[0, 16:19] = [30.0, 13.0, -7.0]
  x[0, 32] = 0.7
  qt = jax.jit(lambda x: aqtr.quantize(x, _T))(jnp.asarray(x))
  np.testing.assert_array_equal(qt.scale.ravel(), [448.0, 5.0, 0.1171875])
  got = np.asarray(qt.dequant())[0]
  # 1000 / 448 = 2.23 -> 2 -> 896.
  np.testing.assert_array_equal(got[:2], [2688.0, 896.0])
  np.testing.assert_array_equal(got[16:19], [30.0, 15.0, -7.5])
  np.testing.assert_allclose(got[32], 6 * 0.1171875)
  assert (got[np.r_[2:16, 19:32, 33:48]] == 0).all()


def test_block_scales_are_e4m3_times_the_tensor_scale():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 64)).astype(np.float32) * 3
  qt = jax.jit(lambda x: aqtr.quantize(x, _T))(jnp.asarray(x))
  # s_t = amax / 2688 rounded up to 18 significant bits: s / s_t is exact.
  m, e = np.frexp(np.abs(x).max() / np.float32(448 * 6))
  s_t = np.ldexp(np.ceil(m * 2.0**18) / 2.0**18, e)
  d = np.asarray(qt.scale, np.float64).ravel() / s_t
  np.testing.assert_array_equal(
    d, d.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  )
  assert d.max() == pytest.approx(448.0, rel=1e-6)
  assert qt.qvalue.dtype == jnp.float8_e4m3fn
  q = np.unique(np.abs(np.asarray(qt.qvalue.astype(jnp.float32))))
  assert set(q) <= {0, 0.5, 1, 1.5, 2, 3, 4, 6}


def test_tiling_is_validated():
  with pytest.raises(ValueError, match=r'TensorConfig.tiling.*tile_size=16'):
    aqtr.TensorConfig(numerics=NvFp4())


def test_registered():
  assert numerics.get('nvfp4') is NvFp4
