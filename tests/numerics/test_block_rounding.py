"""Stochastic rounding and scale selection of the block formats (MX, NVFP4)."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import aqtr
from aqtr import fiddlers, numerics, tilings
from aqtr.numerics import Mx, NvFp4
from aqtr.numerics.fp import FloatGrid
from aqtr.numerics.nvfp4 import tensor_scale

DRAWS = 2000
BLOCK_FORMATS = [
  *(
    Mx(element=e, scale_mode=m)
    for e in numerics.mx.ELEMENTS
    for m in ('rceil', 'ceil')
  ),
  NvFp4(),
  NvFp4(scale_mode='ceil'),
]


def _t(n, rounding=None):
  return aqtr.TensorConfig(
    numerics=n,
    tiling=tilings.SubChannel(tile_size=n.block_size),
    rounding=rounding or aqtr.NearestEven(),
  )


def _step(n, v):
  """The element format's grid step at |v| (v = x / S * unit)."""
  if n.kind == 'int':
    return np.full_like(v, n.unit)
  g = n.fp.grid if isinstance(n, Mx) else FloatGrid(1, 0, 6.0)  # E2M1
  e = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-60)))
  return np.exp2(np.maximum(e, g.min_exponent) - g.mantissa_bits)


@pytest.mark.parametrize('n', BLOCK_FORMATS, ids=repr)
def test_stochastic_rounding_is_unbiased(n):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 64)) * np.exp(rng.uniform(-4, 4, (2, 1)))
  x = jnp.asarray(x, jnp.float32)
  t = _t(n, aqtr.Stochastic())
  keys = jax.random.split(jax.random.key(1), DRAWS)

  @jax.jit
  def draws(x):
    qt = aqtr.quantize(x, _t(n))
    per_element = dataclasses.replace(qt, qvalue=jnp.ones_like(qt.qvalue))
    q = jax.vmap(lambda k: aqtr.quantize(x, t, key=k).dequant())(keys)
    return q, per_element.dequant()

  q, scale = (np.asarray(a, np.float64) for a in draws(x))
  xs = np.asarray(x, np.float64)
  mean, se = q.mean(0), q.std(0) / np.sqrt(DRAWS)
  # The scale does not depend on the noise: every draw has the nearest
  # rounding's scale S. The 8-bit noise grid resolves 2^-9 of a step.
  v = xs / scale * n.unit
  resolution = 2.0**-9 * _step(n, v) * scale / n.unit
  in_range = np.abs(v) <= n.max_value
  err = np.abs(mean - xs)
  ok = err <= 5 * se + resolution
  assert ok[in_range].all(), (err / np.maximum(se, 1e-30))[~ok & in_range]
  # Draws take two neighbouring grid values: most elements vary.
  assert (q.std(0) > 0).mean() > 0.9
  if isinstance(n, Mx) or n.scale_mode == 'ceil':
    assert in_range.all()  # these scale modes never saturate


# amax -> X per scale mode, MXFP4 (e2m1: emax 2, max 6) and MXFP8 (e4m3:
# emax 8, max 448).
SCALES = [
  ('fp4_e2m1', 5.0, {'floor': 1.0, 'ceil': 2.0, 'rceil': 1.0}),
  ('fp4_e2m1', 7.0, {'floor': 1.0, 'ceil': 2.0, 'rceil': 2.0}),
  ('fp4_e2m1', 4.0, {'floor': 1.0, 'ceil': 1.0, 'rceil': 1.0}),
  ('fp4_e2m1', 6.0, {'floor': 1.0, 'ceil': 2.0, 'rceil': 1.0}),
  ('fp8_e4m3', 449.0, {'floor': 1.0, 'ceil': 2.0, 'rceil': 2.0}),
  ('fp8_e4m3', 300.0, {'floor': 1.0, 'ceil': 2.0, 'rceil': 1.0}),
  ('int8', 3.0, {'floor': 2.0, 'ceil': 4.0, 'rceil': 2.0}),
  ('int8', 1.99, {'floor': 1.0, 'ceil': 2.0, 'rceil': 2.0}),
]


@pytest.mark.parametrize('element, amax, want', SCALES)
def test_scale_modes(element, amax, want):
  x = jnp.zeros((1, 32)).at[0, 3].set(amax)
  for mode, scale in want.items():
    n = Mx(element=element, scale_mode=mode)
    qt = aqtr.quantize(x, _t(n))
    assert float(qt.scale.ravel()[0]) / n.unit == scale, mode


@pytest.mark.parametrize('element', list(numerics.mx.ELEMENTS))
def test_rceil_is_the_smallest_scale_that_does_not_clamp(element):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 32)) * np.exp(rng.uniform(-30, 30, (64, 1)))
  x = jnp.asarray(x, jnp.float32)
  amax = np.abs(np.asarray(x, np.float64)).max(1)
  got = {}
  for mode in ('floor', 'ceil', 'rceil'):
    n = Mx(element=element, scale_mode=mode)
    got[mode] = np.asarray(aqtr.quantize(x, _t(n)).scale).ravel() / n.unit
  top = amax / got['rceil']
  assert (top <= n.max_value).all() and (2 * top > n.max_value).all()
  assert (amax / got['ceil'] <= 2.0**n.emax).all()
  assert (got['floor'] <= got['rceil']).all()
  assert (got['rceil'] <= got['ceil']).all()


def test_floor_scales_refuse_stochastic_rounding():
  with pytest.raises(ValueError, match=r"rounding.*scale_mode='rceil'"):
    _t(Mx(element='fp4_e2m1'), aqtr.Stochastic())
  _t(Mx(element='fp4_e2m1', scale_mode='rceil'), aqtr.Stochastic())


def test_scale_mode_bad_input():
  with pytest.raises(ValueError, match=r'Mx.scale_mode must be one of'):
    Mx(scale_mode='round')
  # rceil is the MX E8M0 selection: NVFP4 (e4m3 block scales) says so.
  with pytest.raises(ValueError, match=r"NvFp4.scale_mode.*'rceil'.*Mx"):
    NvFp4(scale_mode='rceil')
  cfg = aqtr.fiddle.config('int8')
  with pytest.raises(ValueError, match=r'fwd.rhs: NvFp4.scale_mode'):
    fiddlers.use_numerics(cfg, 'fwd.rhs', 'nvfp4', scale_mode='rceil')
  with pytest.raises(TypeError, match=r"'fp8' .* no field scale_mode"):
    fiddlers.use_numerics(cfg, 'fwd.rhs', 'fp8', scale_mode='rceil')


@pytest.mark.parametrize('mode', ['nearest', 'ceil'])
def test_nvfp4_2d_weight_scales_are_exactly_e4m3_times_f32(mode):
  # 16x16 weight blocks (the recipe's weights): the stored scale is an e4m3
  # block scale times the f32 tensor scale, exactly, and so is q * s.
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 48)) * np.exp(rng.uniform(-2, 2, (1, 48)))
  w = jnp.asarray(w, jnp.float32)
  t = aqtr.TensorConfig(
    numerics=NvFp4(scale_mode=mode),
    tiling=tilings.Block2d(tile_size=16, free_size=16),
  )
  s_t = float(tensor_scale(jnp.abs(w).max(), 448.0 * 6.0))
  by = {}
  for axis in (0, 1):
    qt = jax.jit(lambda w, a=axis: aqtr.quantize(w, t, contracting_axes=(a,)))(
      w
    )
    s = np.asarray(qt.scale, np.float64)
    d = s / s_t
    np.testing.assert_array_equal(
      d, d.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    )
    q = np.asarray(qt.qvalue.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(
      np.asarray(qt.qvalue.astype(jnp.float32) * qt.scale, np.float64),
      q * d * s_t,
    )
    by[axis] = qt.dequant()
  # Forward (contracting K) and dlhs (contracting N) see the same weight.
  np.testing.assert_array_equal(by[0], by[1])


def test_nvfp4_ceil_never_saturates():
  # Rows within a factor e^6 of each other: normal e4m3 block scales.
  rng = np.random.default_rng(1)
  x = rng.standard_normal((256, 64)) * np.exp(rng.uniform(-3, 3, (256, 1)))
  x = jnp.asarray(x, jnp.float32)
  top = {}
  for mode in ('nearest', 'ceil'):
    qt = aqtr.quantize(x, _t(NvFp4(scale_mode=mode)))
    per = dataclasses.replace(qt, qvalue=jnp.ones_like(qt.qvalue)).dequant()
    top[mode] = float(jnp.max(jnp.abs(x) / per))
  assert top['ceil'] <= 6.0 < top['nearest'] <= 6.0 * (1 + 1 / 16)


@pytest.mark.parametrize(
  'n', [Mx(element='fp4_e2m1', scale_mode='rceil'), NvFp4()], ids=repr
)
def test_stochastic_gradients_in_the_engine(n):
  # The recipe's rounding: nearest on weights and activations, stochastic
  # on the gradient operand of dlhs and drhs, keyed by the dot's key.
  t = _t(n)
  g = _t(n, aqtr.Stochastic())
  raw = aqtr.DotGeneralRaw
  cfg = aqtr.DotGeneralConfig(
    fwd=raw(lhs=t, rhs=t), dlhs=raw(lhs=g, rhs=t), drhs=raw(lhs=g, rhs=t)
  )
  assert cfg.needs_key
  dn = (((1,), (0,)), ((), ()))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)

  c = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)

  @jax.jit
  def grads(key):
    def loss(x, w):
      return (aqtr.dot_general(x, w, dn, cfg, key=key) * c).sum()

    return jax.grad(loss, (0, 1))(x, w)

  a, b, c = (
    grads(jax.random.key(0)),
    grads(jax.random.key(0)),
    grads(jax.random.key(1)),
  )
  for u, v, z in zip(a, b, c, strict=True):
    np.testing.assert_array_equal(u, v)
    assert not np.array_equal(u, z)
  with pytest.raises(ValueError, match='needs a PRNG key'):
    jax.grad(lambda x: aqtr.dot_general(x, w, dn, cfg).sum())(x)
