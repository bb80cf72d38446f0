"""Tests for aqtr.quantize / aqtr.fake_quant (aqtr/core/quantizer.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics, tilings


def tensor(
  bits=8,
  tiling=None,
  po2=False,
  rounding=None,
  clip_scale=1.0,
  **num_kw,
) -> aqtr.TensorConfig:
  return aqtr.TensorConfig(
    numerics=numerics.IntSymmetric(bits=bits, **num_kw),
    calibration=calibrations.AbsMax(clip_scale=clip_scale, po2_scale=po2),
    tiling=tiling or tilings.PerChannel(),
    rounding=rounding or aqtr.NearestEven(),
  )


def randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _scale_full(qt: aqtr.QTensor) -> np.ndarray:
  """The scale broadcast to the operand's layout (via dequant of ones)."""
  ones = aqtr.QTensor(
    jnp.ones_like(qt.qvalue, jnp.float32), qt.scale, qt.layout, qt.form
  )
  return np.asarray(ones.dequant())


@jax.jit
def _roundtrip(x):
  qt = aqtr.quantize(x, tensor())
  return qt, qt.dequant(), aqtr.fake_quant(x, tensor())


def test_quantize_int8_per_channel():
  x = randn(0, (8, 32)).astype(jnp.float32)
  qt, dq, fq = _roundtrip(x)
  assert isinstance(qt, aqtr.QTensor)
  assert qt.qvalue.dtype == jnp.int8
  q = np.asarray(qt.qvalue)
  assert np.abs(q).max() == 127 and np.abs(q).min() >= 0
  assert (np.abs(q).max(axis=(0, 1, 3)) == 127).all()  # each row hits 127
  assert dq.shape == x.shape and dq.dtype == jnp.float32
  np.testing.assert_array_equal(dq, fq)  # fake_quant == quantize().dequant()
  s = _scale_full(qt)
  # one scale per row (per channel), = absmax / 127
  np.testing.assert_array_equal(s, np.broadcast_to(s[:, :1], s.shape))
  np.testing.assert_allclose(s[:, 0], np.abs(x).max(1) / 127, rtol=1e-6)


def test_docstring_example_values():
  qt = aqtr.quantize(jnp.array([[0.5, -1.0]]))
  assert qt.qvalue.ravel().tolist() == [64, -127]


@pytest.mark.parametrize(
  'tiling,groups',
  [
    (tilings.PerTensor(), 1),
    (tilings.PerChannel(), 8),
    (tilings.SubChannel(tile_size=8), 32),
  ],
)
def test_tilings_set_the_number_of_scales(tiling, groups):
  x = randn(1, (8, 32)).astype(jnp.float32)
  qt = aqtr.quantize(x, tensor(tiling=tiling))
  # Scales are stored per row at least (a row holding NaN/inf gets NaN).
  assert qt.scale.size == max(groups, 8)
  assert np.unique(qt.scale).size == groups
  assert np.unique(_scale_full(qt)).size == groups


def test_contracting_and_batch_axes_choose_the_channels():
  x = randn(2, (3, 8, 5)).astype(jnp.float32)  # [batch, k, n]
  qt = aqtr.quantize(x, tensor(), contracting_axes=(1,), batch_axes=(0,))
  s = _scale_full(qt)
  # shared along k only: one scale per (batch, n)
  np.testing.assert_array_equal(s, np.broadcast_to(s[:, :1, :], s.shape))
  np.testing.assert_allclose(s[:, 0, :], np.abs(x).max(1) / 127, rtol=1e-6)
  pt = aqtr.quantize(
    x,
    tensor(tiling=tilings.PerTensor()),
    contracting_axes=(1,),
    batch_axes=(0,),
  )
  assert np.unique(_scale_full(pt)).size == 1
  # negative axes name the same axes
  qt2 = aqtr.quantize(x, tensor(), contracting_axes=(-2,), batch_axes=(-3,))
  np.testing.assert_array_equal(qt.dequant(), qt2.dequant())


@pytest.mark.parametrize('bits', range(2, 9))
def test_qvalues_in_range_and_error_within_half_a_bucket(bits):
  x = randn(3, (8, 32)).astype(jnp.float32)
  cfg = tensor(bits=bits)
  qt = aqtr.quantize(x, cfg)
  q = np.asarray(qt.qvalue).astype(np.int32)
  top = 2 ** (bits - 1) - 1
  assert q.min() >= -top and q.max() <= top
  assert q.max() == top or q.min() == -top
  err = np.abs(np.asarray(qt.dequant()) - np.asarray(x))
  s = _scale_full(qt)
  assert (err <= s / 2 * (1 + 1e-6)).all()


def test_int4_storage_range_and_dtype():
  x = randn(4, (8, 32)).astype(jnp.float32)
  qt = aqtr.quantize(x, tensor(bits=4, storage='int4'))
  assert qt.qvalue.dtype == jnp.int4
  q = np.asarray(qt.qvalue.astype(jnp.int8))
  assert q.min() == -7 and q.max() == 7


def test_one_bit_is_the_binary_half_grid():
  x = randn(5, (8, 32)).astype(jnp.float32)
  cfg = tensor(bits=1, preserve_zero=False)
  qt = aqtr.quantize(x, cfg)
  assert set(np.unique(np.asarray(qt.qvalue))) <= {-1, 1}
  dq = np.asarray(qt.dequant())
  mags = np.abs(dq)
  # one magnitude per row (its scale), sign of x
  np.testing.assert_array_equal(mags, np.broadcast_to(mags[:, :1], mags.shape))
  np.testing.assert_array_equal(np.sign(dq), np.sign(np.asarray(x)))


def test_preserve_max_val_false_uses_the_edge():
  x = jnp.array([[1.0, -0.5, 0.25]])
  qt = aqtr.quantize(x, tensor(preserve_max_val=False))
  # max maps to 127.5, clipped to 127
  assert np.asarray(qt.qvalue).ravel().tolist()[0] == 127


def test_rounding_error_is_uniform_over_a_bucket():
  x = randn(6, (1, 200_000)).astype(jnp.float32)
  qt = aqtr.quantize(x, tensor(tiling=tilings.PerTensor()))
  s = float(qt.scale.ravel()[0])
  frac = np.asarray(x) / s - np.asarray(qt.qvalue).astype(np.float64)
  frac = frac.ravel()
  assert np.abs(frac).max() <= 0.5 + 1e-4
  hist, _ = np.histogram(frac, bins=10, range=(-0.5, 0.5))
  p = hist / hist.sum()
  # each tenth of a bucket holds ~10%: 5 sigma of a binomial at n=2e5
  assert np.abs(p - 0.1).max() < 5 * math.sqrt(0.09 / frac.size) + 2e-3
  assert abs(frac.mean()) < 0.01


@pytest.mark.parametrize('tiling', [tilings.PerChannel(), tilings.PerTensor()])
def test_po2_scales_are_powers_of_two_and_do_not_clip(tiling):
  x = randn(7, (8, 32)).astype(jnp.float32) * 3.7
  qt = aqtr.quantize(x, tensor(po2=True, tiling=tiling))
  s = np.asarray(qt.scale)
  np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))
  assert np.abs(np.asarray(qt.qvalue)).max() <= 127
  # the bound still fits: no value clipped
  err = np.abs(np.asarray(qt.dequant()) - np.asarray(x))
  assert (err <= _scale_full(qt) / 2).all()


def test_all_zero_tensor_has_scale_one_and_no_nan():
  z = jnp.zeros((3, 8))
  qt = aqtr.quantize(z)
  np.testing.assert_array_equal(qt.scale, 1)
  np.testing.assert_array_equal(qt.qvalue, 0)
  np.testing.assert_array_equal(qt.dequant(), 0)
  g = jax.grad(lambda x: aqtr.fake_quant(x).sum())(z)
  np.testing.assert_array_equal(g, 1)
  # a zero row next to a nonzero row
  x = jnp.zeros((2, 4)).at[1].set(jnp.arange(4.0))
  dq = np.asarray(aqtr.fake_quant(x))
  assert np.isfinite(dq).all()
  np.testing.assert_allclose(dq, x, atol=3 / 254)


def test_tiny_values_do_not_overflow():
  x = jnp.full((2, 4), 1e-40, jnp.float32)  # subnormal absmax
  dq = np.asarray(aqtr.fake_quant(x))
  assert np.isfinite(dq).all()
  # No blow-up through a tiny scale: never larger than x, never flipped.
  assert (np.abs(dq) <= 1.01 * 1e-40).all() and (dq >= 0).all()
  # A small normal absmax keeps int8 precision: error <= half a step.
  y = jnp.linspace(-1e-30, 1e-30, 8, dtype=jnp.float32).reshape(2, 4)
  step = 1e-30 / 127
  np.testing.assert_allclose(aqtr.fake_quant(y), y, rtol=0, atol=0.51 * step)


@pytest.mark.parametrize(
  'num',
  [numerics.IntSymmetric(bits=8), numerics.Fp8(dtype_name='float8_e4m3fn')],
  ids=['int8', 'fp8'],
)
@pytest.mark.parametrize(
  'calibration',
  [calibrations.AbsMax(), calibrations.Constant(bound=2.0)],
  ids=['absmax', 'constant'],
)
@pytest.mark.parametrize('bad', [np.nan, np.inf])
def test_non_finite_values_poison_their_group(num, calibration, bad):
  x = np.random.default_rng(8).standard_normal((3, 8)).astype(np.float32)
  x[1, 3] = bad
  cfg = aqtr.TensorConfig(
    numerics=num,
    calibration=calibration,
    tiling=tilings.PerChannel(),
    rounding=aqtr.NearestEven(),
  )
  dq = np.asarray(aqtr.fake_quant(jnp.asarray(x), cfg))
  assert not np.isfinite(dq[1]).any()
  assert np.isfinite(np.delete(dq, 1, axis=0)).all()


def test_fp8_quantize():
  x = randn(9, (8, 32)).astype(jnp.float32)
  cfg = aqtr.TensorConfig(
    numerics=numerics.Fp8(dtype_name='float8_e4m3fn'),
    calibration=calibrations.AbsMax(),
    tiling=tilings.PerChannel(),
    rounding=aqtr.NearestEven(),
  )
  qt = aqtr.quantize(x, cfg)
  assert qt.qvalue.dtype == jnp.float8_e4m3fn
  q = np.abs(np.asarray(qt.qvalue.astype(jnp.float32)))
  np.testing.assert_array_equal(q.max(axis=(0, 1, 3)), 448)
  err = np.abs(np.asarray(qt.dequant()) - np.asarray(x))
  assert (err <= np.abs(np.asarray(x)) * 2**-4 + 1e-6).all()


def test_no_numerics_passes_through():
  x = randn(10, (8, 32)).astype(jnp.float32)
  cfg = aqtr.TensorConfig(numerics=numerics.NoNumerics())
  qt = aqtr.quantize(x, cfg)
  assert qt.scale is None
  np.testing.assert_array_equal(qt.dequant(), x)
  np.testing.assert_array_equal(aqtr.fake_quant(x, cfg), x)


# ------------------------------------------------------------ gradients


def test_fake_quant_gradient_is_straight_through():
  x = randn(11, (8, 32)).astype(jnp.float32)
  g = jax.grad(lambda x: (aqtr.fake_quant(x) * 3.0).sum())(x)
  np.testing.assert_array_equal(g, 3.0)


def test_clip_gradient_masks_clipped_values():
  x = randn(12, (8, 32)).astype(jnp.float32)
  cfg = tensor(clip_scale=0.5, clip_gradient=True)
  g = np.asarray(jax.grad(lambda x: aqtr.fake_quant(x, cfg).sum())(x))
  bound = 0.5 * np.abs(np.asarray(x)).max(axis=1, keepdims=True)
  ax = np.abs(np.asarray(x))
  assert set(np.unique(g)) == {0.0, 1.0}
  np.testing.assert_array_equal(g[ax < bound * 0.999], 1)
  np.testing.assert_array_equal(g[ax > bound * 1.001], 0)
  # without clip_gradient, everything passes
  cfg = tensor(clip_scale=0.5)
  g = jax.grad(lambda x: aqtr.fake_quant(x, cfg).sum())(x)
  np.testing.assert_array_equal(g, 1)


def test_no_gradient_reaches_the_scale():
  """d fake_quant(c * x) / dc == sum(x) (STE), no term from the scale."""
  x = randn(13, (8, 32)).astype(jnp.float32)
  dc = jax.grad(lambda c: aqtr.fake_quant(c * x).sum())(1.0)
  np.testing.assert_allclose(dc, x.sum(), rtol=1e-6)


# --------------------------------------------------- stochastic rounding


def _sr(bits=8):
  return tensor(bits=bits, rounding=aqtr.Stochastic())


@jax.jit
def _sr_dequant(x, keys):
  return jax.vmap(lambda k: aqtr.fake_quant(x, _sr(), key=k))(keys)


def test_stochastic_rounding_is_unbiased():
  """Mean over keys of the dequantized value -> x (within 6 std errors)."""
  row = jnp.linspace(-1.0, 1.0, 41, dtype=jnp.float32)
  x = jnp.stack([row, row * 0.01])  # the max of each row is on the grid
  n = 2000
  samples = np.asarray(_sr_dequant(x, jax.random.split(jax.random.key(0), n)))
  mean, std = samples.mean(0), samples.std(0)
  s = np.abs(np.asarray(x)).max(1, keepdims=True) / 127
  # per element the variance is at most s^2 / 4
  assert (std <= s / 2 * 1.01).all()
  assert (np.abs(mean - np.asarray(x)) <= 6 * s / 2 / math.sqrt(n)).all()
  # nearest rounding would be biased by up to s/2 on the same values
  nearest = np.asarray(aqtr.fake_quant(x, tensor()))
  assert np.abs(nearest - np.asarray(x)).max() > 0.3 * s.min()
  # every value lands on one of its two neighbouring grid points
  q = samples / s
  np.testing.assert_allclose(q, np.round(q), atol=1e-3)
  assert (np.abs(q - np.asarray(x) / s) < 1 + 1e-3).all()


def test_stochastic_rounding_keys():
  x = randn(14, (8, 32)).astype(jnp.float32)
  cfg = _sr()
  a = aqtr.quantize(x, cfg, key=jax.random.key(1)).qvalue
  b = aqtr.quantize(x, cfg, key=jax.random.key(1)).qvalue
  raw = aqtr.quantize(x, cfg, key=jax.random.PRNGKey(1)).qvalue
  c = aqtr.quantize(x, cfg, key=jax.random.key(2)).qvalue
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a, raw)
  assert not np.array_equal(a, c)
  assert np.abs(np.asarray(a, np.int32) - np.asarray(c, np.int32)).max() == 1


def test_stochastic_rounding_without_key_names_the_key():
  with pytest.raises(ValueError, match='key'):
    aqtr.quantize(jnp.ones((2, 4)), _sr())
  with pytest.raises(ValueError, match='key'):
    aqtr.fake_quant(jnp.ones((2, 4)), _sr())


def test_stochastic_rounding_on_small_bits_stays_in_range():
  x = randn(15, (8, 32)).astype(jnp.float32)
  keys = jax.random.split(jax.random.key(3), 8)
  q = jax.jit(jax.vmap(lambda k: aqtr.quantize(x, _sr(bits=4), key=k).qvalue))(
    keys
  )
  q = np.asarray(q)
  assert q.min() >= -7 and q.max() <= 7


def test_noise_sharing_axes_round_shared_groups_alike():
  row = randn(16, (1, 32)).astype(jnp.float32)
  x = jnp.concatenate([row] * 8, axis=0)  # 8 equal rows
  shared = tensor(rounding=aqtr.Stochastic(noise_sharing_axes=(0,)))
  q = np.asarray(aqtr.quantize(x, shared, key=jax.random.key(5)).qvalue)
  q = q.reshape(8, 32)
  np.testing.assert_array_equal(q, np.broadcast_to(q[:1], q.shape))
  q = np.asarray(aqtr.quantize(x, _sr(), key=jax.random.key(5)).qvalue)
  q = q.reshape(8, 32)
  assert not (q == q[:1]).all()


# ------------------------------------------------------------ transforms


def test_quantize_under_jit_and_vmap():
  x = randn(16, (3, 8, 32)).astype(jnp.float32)
  qt = jax.jit(lambda x: aqtr.quantize(x, tensor()))(x[0])
  assert isinstance(qt, aqtr.QTensor)
  batched = jax.vmap(lambda x: aqtr.fake_quant(x, tensor()))(x)
  for i in range(3):
    np.testing.assert_array_equal(batched[i], aqtr.fake_quant(x[i], tensor()))


# ------------------------------------------------------------ bad input


def test_bad_input_names_the_field():
  x = jnp.ones((2, 4))
  with pytest.raises(TypeError, match='x must have a floating dtype'):
    aqtr.quantize(jnp.ones((2, 4), jnp.int32))
  with pytest.raises(TypeError, match='TensorConfig'):
    aqtr.quantize(x, aqtr.presets.int8())
  with pytest.raises(ValueError, match='contracting_axes'):
    aqtr.quantize(x, contracting_axes=(2,))
  with pytest.raises(ValueError, match='batch_axes'):
    aqtr.quantize(x, batch_axes=(-3,))
  with pytest.raises(ValueError, match='both'):
    aqtr.quantize(x, contracting_axes=(1,), batch_axes=(1,))
  with pytest.raises(ValueError, match='repeats'):
    aqtr.quantize(x, contracting_axes=(1, -1))
  with pytest.raises(ValueError, match='tile_size'):
    aqtr.quantize(x, tensor(tiling=tilings.SubChannel(tile_size=3)))
