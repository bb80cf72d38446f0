"""Tests of aqtr.tilings.SubChannel: one scale per block of the contraction."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr import numerics, tilings
from aqtr.tilings import SubChannel

_DN = (((1,), (0,)), ((), ()))


def _x(shape, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _t(tiling, **kw):
  return aqtr.TensorConfig(tiling=tiling, **kw)


def _quantize(x, t, contract, batch=()):
  quantize = functools.partial(
    aqtr.quantize, config=t, contracting_axes=contract, batch_axes=batch
  )
  return jax.jit(quantize)(x)


def _fwd_config(lhs, rhs):
  f = aqtr.TensorConfig(numerics=numerics.NoNumerics())
  bwd = aqtr.DotGeneralRaw(lhs=f, rhs=f, use_fwd_quant=True)
  return aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=lhs, rhs=rhs), dlhs=bwd, drhs=bwd
  )


@pytest.mark.parametrize(
  'tiling, k, size',
  [
    (SubChannel(tile_size=128), 1024, 128),
    (SubChannel(tile_count=4), 1024, 256),
    (SubChannel(tile_size=3), 12, 3),
    (SubChannel(tile_count=1), 12, 12),
    (SubChannel(), 256, SubChannel.DEFAULT_TILE_SIZE),
  ],
)
def test_tile(tiling, k, size):
  assert tiling.tile(k) == size


def test_default_is_tiles_of_128():
  assert SubChannel.DEFAULT_TILE_SIZE == 128
  assert SubChannel() == SubChannel(tile_size=0, tile_count=0)
  with pytest.raises(ValueError, match=r'SubChannel\.tile_size=128'):
    SubChannel().tile(100)


@pytest.mark.parametrize(
  'kwargs, field',
  [
    ({'tile_size': -1}, 'tile_size'),
    ({'tile_size': 2.0}, 'tile_size'),
    ({'tile_size': True}, 'tile_size'),
    ({'tile_size': None}, 'tile_size'),
    ({'tile_count': -3}, 'tile_count'),
    ({'tile_count': '4'}, 'tile_count'),
  ],
)
def test_bad_values_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=rf'SubChannel\.{field} must be an int'):
    SubChannel(**kwargs)


def test_tile_size_and_tile_count_are_exclusive():
  with pytest.raises(
    ValueError, match='at most one of tile_size and tile_count'
  ):
    SubChannel(tile_size=32, tile_count=4)


@pytest.mark.parametrize(
  'tiling, field',
  [
    (SubChannel(tile_size=5), 'tile_size'),
    (SubChannel(tile_count=3), 'tile_count'),
  ],
)
def test_non_dividing_sizes_name_the_field(tiling, field):
  msg = rf'SubChannel\.{field}=\d+ does not divide the contraction size 16'
  with pytest.raises(ValueError, match=msg):
    tiling.tile(16)
  x = _x((4, 16))
  with pytest.raises(ValueError, match=msg):
    aqtr.quantize(x, _t(tiling))
  cfg = _fwd_config(_t(tiling), _t(tiling))
  with pytest.raises(ValueError, match=msg):
    aqtr.dot_general(x, _x((16, 2), 1), _DN, cfg)


def test_one_scale_per_row_and_tile():
  x = _x((6, 32))
  qt = _quantize(x, _t(SubChannel(tile_size=8)), (1,))
  assert qt.scale.size == 6 * 4
  want = jnp.abs(x.reshape(6, 4, 8)).max(axis=2) / 127  # [row, tile]
  np.testing.assert_allclose(qt.scale.reshape(4, 6).T, want, rtol=1e-6)
  # Each tile is quantized as a per-channel tensor of its own.
  per_tile = _quantize(x.reshape(6, 4, 8), aqtr.TensorConfig(), (2,))
  np.testing.assert_array_equal(qt.dequant(), per_tile.dequant().reshape(6, 32))


def test_tiles_the_flattened_contraction_axes():
  # Contracting (1, 2) of [4, 3, 8] flattens K = 24 row-major: tiles of 8
  # are the slices x[:, j, :].
  x = _x((4, 3, 8), 1)
  qt = _quantize(x, _t(SubChannel(tile_size=8)), (1, 2))
  want = jnp.abs(x).max(axis=2) / 127  # [4, 3]
  np.testing.assert_allclose(qt.scale.reshape(3, 4).T, want, rtol=1e-6)
  np.testing.assert_allclose(qt.dequant(), x, atol=float(want.max()))


def test_tile_count_equals_the_tile_size_it_implies():
  x = _x((4, 64), 2)
  a = _quantize(x, _t(SubChannel(tile_count=4)), (1,))
  b = _quantize(x, _t(SubChannel(tile_size=16)), (1,))
  np.testing.assert_array_equal(a.qvalue, b.qvalue)
  np.testing.assert_array_equal(a.scale, b.scale)


def test_partner_with_per_channel_scales_is_split_with_the_same_tiles():
  x, w = _x((8, 64), 3), _x((64, 4), 4)
  lhs = _t(SubChannel(tile_size=16))
  rhs = aqtr.TensorConfig()
  out = jax.jit(
    lambda x, w: aqtr.dot_general(x, w, _DN, _fwd_config(lhs, rhs))
  )(x, w)
  fx = aqtr.fake_quant(x, lhs)
  fw = aqtr.fake_quant(w, rhs, contracting_axes=(0,))
  np.testing.assert_allclose(
    out, lax.dot_general(fx, fw, _DN), rtol=1e-5, atol=1e-5
  )


def test_different_tile_sizes_on_lhs_and_rhs_raise():
  cfg = _fwd_config(_t(SubChannel(tile_size=8)), _t(SubChannel(tile_size=16)))
  with pytest.raises(ValueError, match='different tile sizes'):
    aqtr.dot_general(_x((4, 32)), _x((32, 2), 1), _DN, cfg)


def test_float_numerics_make_tiling_irrelevant():
  f = aqtr.TensorConfig(numerics=numerics.NoNumerics(), tiling=SubChannel())
  raw = aqtr.DotGeneralRaw(lhs=f, rhs=f)
  cfg = aqtr.DotGeneralConfig(fwd=raw, dlhs=raw, drhs=raw)
  x, w = _x((4, 100)), _x((100, 3), 1)  # 128 does not divide 100: unused.
  np.testing.assert_array_equal(
    aqtr.dot_general(x, w, _DN, cfg), lax.dot_general(x, w, _DN)
  )


def test_registered_as_subchannel():
  assert tilings.get('subchannel') is SubChannel
  assert SubChannel.shared == frozenset({'k'})
