"""Tests of aqtr.numerics.IntAsymmetric (affine int with a zero point)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics, tilings
from aqtr.numerics import IntAsymmetric


def _t(n, tiling=None, **kw):
  return aqtr.TensorConfig(
    numerics=n,
    calibration=calibrations.MinMax(),
    tiling=tiling or tilings.PerChannel(),
    **kw,
  )


def _reference(x, bits, qmin, axis=-1):
  """The affine formulas in float64 numpy, one group per row."""
  x = np.asarray(x, np.float64)
  lo = np.minimum(x.min(axis, keepdims=True), 0)
  hi = np.maximum(x.max(axis, keepdims=True), 0)
  s = (hi - lo) / (2**bits - 1)
  s = np.where(s == 0, 1, s)
  z = np.round(-lo / s) + qmin
  q = np.clip(np.round(x / s) + z, qmin, qmin + 2**bits - 1)
  return q, s, z, (q - z) * s


@pytest.mark.parametrize(
  'storage, q, z',
  [('int8', [-128, -64, -32, 127], -64), ('uint8', [0, 64, 96, 255], 64)],
)
def test_hand_computed(storage, q, z):
  # lo = -1, hi = 3: s = 4/255, z = round(63.75) + qmin = 64 + qmin;
  # 0.5 / s = 31.875 -> 32; 3 / s = 191.25 -> 191 (+z: qmax).
  n = IntAsymmetric(bits=8, storage=storage)
  x = jnp.array([[-1.0, 0.0, 0.5, 3.0]])
  qt = jax.jit(lambda x: aqtr.quantize(x, _t(n)))(x)
  assert qt.qvalue.dtype == jnp.dtype(storage)
  np.testing.assert_array_equal(qt.qvalue.ravel(), q)
  np.testing.assert_array_equal(qt.zero_point.ravel(), [z])
  np.testing.assert_allclose(qt.scale.ravel(), [4 / 255], rtol=1e-7)
  np.testing.assert_allclose(
    qt.dequant()[0], np.array([-64, 0, 32, 191]) * 4 / 255, rtol=1e-6
  )
  assert qt.dequant()[0, 1] == 0  # zero is exact


@pytest.mark.parametrize(
  'bits, storage', [(2, 'int8'), (3, 'uint8'), (4, 'uint8'), (8, 'int8')]
)
def test_matches_the_formulas(bits, storage):
  n = IntAsymmetric(bits=bits, storage=storage)
  rng = np.random.default_rng(bits)
  x = rng.standard_normal((6, 64)) + np.array([[0], [2], [-2], [5], [0], [0]])
  x[4] = np.abs(x[4])  # all positive: lo = 0
  x[5] = 0  # all zero: s = 1
  qt = jax.jit(lambda x: aqtr.quantize(x, _t(n)))(jnp.asarray(x, jnp.float32))
  q, s, z, xhat = _reference(np.float32(x), bits, n.qmin)
  np.testing.assert_array_equal(
    np.asarray(qt.qvalue, np.float64).reshape(6, 64), q
  )
  np.testing.assert_array_equal(qt.zero_point.reshape(6, 1), z)
  np.testing.assert_allclose(qt.scale.reshape(6, 1), s, rtol=1e-6)
  np.testing.assert_allclose(qt.dequant(), xhat, rtol=1e-5, atol=1e-6)
  assert len(np.unique(q)) <= 2**bits
  # Within half a step of x (the range holds every value).
  assert (
    np.abs(np.asarray(qt.dequant()) - x) <= 0.5 * s * (1 + 1e-5) + 1e-6
  ).all()


def test_subchannel_groups_have_their_own_zero_points():
  n = IntAsymmetric(bits=4)
  x = jnp.concatenate([jnp.linspace(0, 1, 32), jnp.linspace(-3, 1, 32)])[None]
  t = _t(n, tilings.SubChannel(tile_size=32))
  qt = jax.jit(lambda x: aqtr.quantize(x, t))(x)
  assert qt.zero_point.shape == (1, 2, 1, 1)
  np.testing.assert_array_equal(
    qt.zero_point.ravel(), [-8, round(3 / (4 / 15)) - 8]
  )


def test_stochastic_rounding_is_unbiased_over_many_keys():
  n = IntAsymmetric(bits=4)
  t = _t(n, rounding=aqtr.Stochastic())
  x = jnp.array([[-1.0, 0.33, 0.71, 2.0, 3.7, 4.0]])

  @jax.jit
  def draws(keys):
    return jax.vmap(lambda k: aqtr.quantize(x, t, key=k).dequant())(keys)

  q = np.asarray(draws(jax.random.split(jax.random.key(0), 8192)))[:, 0]
  step = 5.0 / 15
  assert (np.abs(q - x) <= step * (1 + 1e-5)).all()
  np.testing.assert_allclose(q[:, 1:].mean(0), x[0, 1:], atol=0.05 * step)


def test_fake_quant_gradient_is_straight_through_with_clip():
  n = IntAsymmetric(bits=4, clip_gradient=True)
  x = jnp.array([[-1.0, 0.3, 2.0]])
  g = jax.jit(jax.grad(lambda x: aqtr.fake_quant(x, _t(n)).sum()))(x)
  np.testing.assert_array_equal(g, 1.0)


def test_symmetric_calibration_is_rejected_with_the_allowed_ones():
  with pytest.raises(ValueError, match=r"TensorConfig.calibration.*'minmax'"):
    aqtr.TensorConfig(numerics=IntAsymmetric())
  cfg = aqtr.fiddle.config('int4_asym_weight_only')
  cfg.fwd.rhs.calibration = aqtr.fiddle.as_config(calibrations.AbsMax())
  with pytest.raises(ValueError, match=r'fwd\.rhs.*allowed.*minmax'):
    aqtr.fiddle.build(cfg)


def test_properties():
  n = IntAsymmetric(bits=4, storage='uint8')
  assert (n.qmin, n.qmax, n.max_value, n.dtype, n.dot_dtype) == (
    0,
    15,
    15.0,
    jnp.uint8,
    jnp.int8,
  )
  n = IntAsymmetric(bits=8)
  assert (n.qmin, n.qmax, n.max_value) == (-128, 127, 128.0)
  assert n.asymmetric and n.kind == 'int' and n.supports_stochastic_rounding
  assert numerics.get('int_asymmetric') is IntAsymmetric


_KN = (((1,), (0,)), ((), ()))  # w [K, N]
_NK = (((1,), (1,)), ((), ()))  # w [N, K]


def _asym_cfg(bwd_bits=None):
  a = _t(IntAsymmetric(bits=8, storage='uint8'))
  if bwd_bits is None:
    g = aqtr.TensorConfig(numerics=numerics.NoNumerics())
  else:
    g = aqtr.TensorConfig(numerics=numerics.IntSymmetric(bits=bwd_bits))
  return aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=a, rhs=a),
    dlhs=aqtr.DotGeneralRaw(lhs=g, rhs=a, use_fwd_quant=True),
    drhs=aqtr.DotGeneralRaw(lhs=g, rhs=a, use_fwd_quant=True),
  )


def test_forward_is_a_real_int8_dot_with_zero_point_corrections():
  cfg = _asym_cfg()
  jaxpr = str(
    jax.make_jaxpr(lambda x, w: aqtr.dot_general(x, w, _KN, cfg))(
      jnp.ones((4, 64)), jnp.ones((64, 8))
    )
  )
  assert 'i8[1,4,64]' in jaxpr and 'preferred_element_type=int32' in jaxpr


@pytest.mark.parametrize('dn', [_KN, _NK], ids=['kn', 'nk'])
def test_quantized_backward_reusing_affine_operands(dn):
  # dlhs / drhs quantize g to int8 and reuse the uint8 forward operands:
  # the zero points enter as a correction term, so the gradients are
  # g . dequant(partner) up to the int8 rounding of g.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((32, 64)) + 1.0, jnp.float32)
  wshape = (64, 48) if dn == _KN else (48, 64)
  w = jnp.asarray(rng.standard_normal(wshape) - 0.7, jnp.float32)
  g = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
  cfg = _asym_cfg(bwd_bits=8)
  t = cfg.fwd.lhs

  @jax.jit
  def run(x, w, g):
    _, vjp = jax.vjp(lambda x, w: aqtr.dot_general(x, w, dn, cfg), x, w)
    fx = aqtr.fake_quant(x, t)
    fw = aqtr.fake_quant(w, t, contracting_axes=dn[0][1])
    _, ref = jax.vjp(lambda x, w: jax.lax.dot_general(x, w, dn), fx, fw)
    return vjp(g), ref(g)

  got, want = run(x, w, g)
  for a, b in zip(got, want, strict=True):
    err = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert err < 0.02, err


def test_a_stored_affine_qtensor_serves_bit_identically():
  cfg = _asym_cfg()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 16)) + 0.3, jnp.float32)

  @jax.jit
  def both(x, w):
    qw = aqtr.quantize_operand(w, _KN, cfg)
    return aqtr.dot_general(x, qw, _KN, cfg), aqtr.dot_general(x, w, _KN, cfg)

  served, trained = both(x, w)
  np.testing.assert_array_equal(served, trained)
  qw = aqtr.quantize_operand(w, _KN, cfg)
  assert qw.qvalue.dtype == jnp.uint8 and qw.zero_point is not None
  bad = aqtr.QTensor(qw.qvalue, qw.scale, qw.layout, qw.form)
  with pytest.raises(ValueError, match='zero_point missing'):
    aqtr.dot_general(x, bad, _KN, cfg)
