"""Tests of aqtr.tilings.Block2d (2-D weight blocks, transpose-consistent)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import numerics, tilings
from aqtr.tilings import Block2d

_DN = (((1,), (0,)), ((), ()))


def _w(shape=(64, 48), seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_one_scale_per_block_equal_to_its_absmax():
  w = _w((8, 7))  # [K, N]: contraction 8 in tiles of 4, 7 rows in 3 + 3 + 1
  t = aqtr.TensorConfig(tiling=Block2d(tile_size=4, free_size=3))
  qt = jax.jit(lambda w: aqtr.quantize(w, t, contracting_axes=(0,)))(w)
  s = np.asarray(qt.scale).reshape(2, 7)  # [tile, n]
  a = np.abs(np.asarray(w))
  for j in range(2):
    for cols in (slice(0, 3), slice(3, 6), slice(6, 7)):
      block = a[4 * j : 4 * j + 4, cols]
      np.testing.assert_allclose(s[j, cols], block.max() / 127, rtol=1e-6)


@pytest.mark.parametrize(
  'n', [numerics.IntSymmetric(bits=4), numerics.Fp8(), numerics.NvFp4()]
)
def test_the_transposed_weight_quantizes_to_the_same_values(n):
  two = aqtr.TensorConfig(
    numerics=n, tiling=Block2d(tile_size=16, free_size=16)
  )
  # Sub-channel (1-D) tiles are not transpose-consistent.
  one = aqtr.TensorConfig(numerics=n, tiling=tilings.SubChannel(tile_size=16))

  @jax.jit
  def both_ways(w):
    return [
      [aqtr.quantize(w, t, contracting_axes=(a,)).dequant() for a in (0, 1)]
      for t in (two, one)
    ]

  (by_k, by_n), (by_k1, by_n1) = both_ways(_w())
  np.testing.assert_array_equal(by_k, by_n)
  assert not np.array_equal(by_k1, by_n1)


def test_forward_and_backward_use_the_same_quantized_weight():
  # dlhs quantizes the weight afresh (contracting N) instead of reusing the
  # forward QTensor: with 2-D blocks the gradient is the same.
  w8 = aqtr.TensorConfig(tiling=Block2d(tile_size=16, free_size=16))
  f = aqtr.TensorConfig(numerics=numerics.NoNumerics())

  def cfg(reuse):
    return aqtr.DotGeneralConfig(
      fwd=aqtr.DotGeneralRaw(lhs=f, rhs=w8),
      dlhs=aqtr.DotGeneralRaw(lhs=f, rhs=w8, use_fwd_quant=reuse),
      drhs=aqtr.DotGeneralRaw(lhs=f, rhs=f),
    )

  x, w = _w((32, 64), 1), _w((64, 48), 2)

  @jax.jit
  def dx(x, w):
    return [
      jax.grad(lambda x, c=c: aqtr.dot_general(x, w, _DN, c).sum())(x)
      for c in (cfg(True), cfg(False))
    ]

  reused, fresh = dx(x, w)
  np.testing.assert_allclose(fresh, reused, rtol=1e-6, atol=1e-6)


def test_block_formats_accept_2d_blocks_of_their_size():
  t = aqtr.TensorConfig(numerics=numerics.NvFp4(), tiling=Block2d(tile_size=16))
  assert t.tiling.free_size == 128
  with pytest.raises(ValueError, match=r'TensorConfig.tiling.*Block2d'):
    aqtr.TensorConfig(numerics=numerics.Mx(), tiling=Block2d(tile_size=16))


def test_contraction_must_be_a_multiple():
  cfg = aqtr.fiddle.config('int8')
  cfg.fwd.rhs.tiling = aqtr.fiddle.as_config(Block2d(tile_size=48))
  with pytest.raises(ValueError, match=r'fwd.rhs.tiling: Block2d.tile_size'):
    aqtr.validation.check_shapes(cfg, (8, 64), (64, 16), _DN)


def test_registered():
  assert tilings.get('block2d') is Block2d
