"""A rotating forward pass (Quartet): exactness, freezing, serving."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
import aqtr.flax.linen as aqtr_linen
from aqtr import calibrations, freezers, numerics, sparsity
from aqtr.transforms import Hadamard

_DN = (((1,), (0,)), ((), ()))
_F = aqtr.TensorConfig(numerics=numerics.NoNumerics())
_H = Hadamard(block_size=16, signs='seed', seed=5)
_MX = aqtr.presets.mxfp4_training().fwd.lhs  # Rotated by RHT-32.
_MX0 = dataclasses.replace(_MX, transform=_F.transform)  # Not rotated.
# (lhs shape, rhs shape, dimension numbers): K a multiple of 16.
DOTS = [
  ((8, 64), (64, 24), _DN),
  ((8, 32), (24, 32), (((1,), (1,)), ((), ()))),  # [N, K] weights
  ((2, 4, 16), (2, 16, 8), (((2,), (1,)), ((0,), (0,)))),  # batched
  ((4, 2, 8, 4), (8, 4, 6), (((2, 3), (0, 1)), ((), ()))),  # K = 8 x 4
]


def _rand(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), 'f4')


def _cfg(fwd=_F, bwd=_F, t=_H):
  raw = aqtr.DotGeneralRaw
  f = dataclasses.replace(fwd, transform=t) if t is not None else fwd
  return aqtr.DotGeneralConfig(
    fwd=raw(lhs=f, rhs=f),
    dlhs=raw(lhs=bwd, rhs=bwd),
    drhs=raw(lhs=bwd, rhs=bwd),
  )


def _value_and_grads(cfg, x, w, dn, c, key=None):
  out, vjp = jax.vjp(
    lambda x, w: aqtr.dot_general(x, w, dn, cfg, key=key), x, w
  )
  return (out, *vjp(c))


@pytest.mark.parametrize('lhs, rhs, dn', DOTS)
def test_float_dot_with_a_forward_transform_equals_lax(lhs, rhs, dn):
  x, w = _rand(lhs, 0), _rand(rhs, 1)
  c = _rand(jax.eval_shape(lambda: lax.dot_general(x, w, dn)).shape, 2)
  cfg = _cfg()
  assert not cfg.is_float and _cfg(t=None).is_float
  got = jax.jit(lambda x, w: _value_and_grads(cfg, x, w, dn, c))(x, w)
  ref = _value_and_grads(None, x, w, dn, c)
  for a, b in zip(got, ref, strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()))


def test_forward_quantizes_the_rotated_operands():
  # out = Q(x R) Q(R^T w): both operands rotated along K, then MXFP4.
  x, w = _rand((16, 64), 0), _rand((64, 32), 1)
  cfg = aqtr.presets.mxfp4_training()
  h = cfg.fwd.lhs.transform
  plain = dataclasses.replace(cfg.fwd.lhs, transform=_F.transform)

  def fq(a, axis):
    return aqtr.fake_quant(a, plain, contracting_axes=(axis,))

  @jax.jit
  def all3(x, w):
    out = aqtr.dot_general(x, w, _DN, cfg, key=jax.random.key(0))
    want = fq(h.apply(x, 1), 1) @ fq(h.apply(w, 0), 0)
    return out, want, fq(x, 1) @ fq(w, 0)

  out, want, unrotated = all3(x, w)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
  assert not np.allclose(out, unrotated, rtol=1e-3, atol=1e-3)


def test_frozen_weight_is_stored_rotated_and_serves_bit_exact():
  # (The full preset serves bit-exact too: test_engine.py.)
  cfg = _cfg(fwd=_MX)
  x, w, c = _rand((32, 64), 0), _rand((64, 32), 1), _rand((32, 32), 2)
  key = jax.random.key(0)
  out, dx, _ = jax.jit(lambda x, w: _value_and_grads(cfg, x, w, _DN, c, key))(
    x, w
  )
  frozen = aqtr.quantize_operand(w, _DN, cfg, key=key)
  assert frozen.transform == cfg.fwd.rhs.transform
  h = cfg.fwd.rhs.transform
  plain = dataclasses.replace(cfg.fwd.rhs, transform=_F.transform)
  want = jax.jit(
    lambda w: aqtr.fake_quant(h.apply(w, 0), plain, contracting_axes=(0,))
  )(w)
  np.testing.assert_allclose(frozen.dequant(), want, rtol=1e-6, atol=1e-6)

  def serve(x):
    out, vjp = jax.vjp(
      lambda x: aqtr.dot_general(x, frozen, _DN, cfg, key=key), x
    )
    return out, vjp(c)[0]

  served, dx_served = jax.jit(serve)(x)
  np.testing.assert_array_equal(served, out)
  # The gradient through the frozen weight uses its values rotated back.
  assert float(jnp.abs(dx_served - dx).max()) < 0.25 * float(jnp.abs(dx).max())


def test_gradient_through_a_frozen_rotated_weight_is_rotated_back():
  # Float backward reusing the stored R^T w: dx = g (R R^T w_q)^T.
  fwd = dataclasses.replace(_MX, transform=_H, rounding=aqtr.NearestEven())
  cfg = _cfg(fwd=fwd)
  x, w, c = _rand((8, 64), 0), _rand((64, 16), 1), _rand((8, 16), 2)
  frozen = aqtr.quantize_operand(w, _DN, cfg)
  dx = jax.jit(jax.vjp(lambda x: aqtr.dot_general(x, frozen, _DN, cfg), x)[1])(
    c
  )[0]
  w_back = _H.inverse(frozen.dequant(), 0)
  np.testing.assert_allclose(dx, c @ w_back.T, rtol=1e-5, atol=1e-5)


class _Net(nn.Module):
  config: aqtr.DotGeneralConfig
  mode: aqtr.Mode = aqtr.Mode.TRAIN

  @nn.compact
  def __call__(self, x):
    dg = functools.partial(
      aqtr_linen.DotGeneral, config=self.config, mode=self.mode
    )
    return nn.Dense(32, use_bias=False, dot_general_cls=dg)(x)


def test_flax_convert_serve_equals_train():
  # The Quartet forward (MXFP4, RHT-32) with the 'weights' freezer: CONVERT
  # stores R^T w quantized, SERVE rotates x alike: bit for bit.
  fwd = dataclasses.replace(_MX, rounding=aqtr.NearestEven())
  cfg = freezers.configure(_cfg(fwd=fwd, t=_MX.transform), rhs='weights')
  x = _rand((4, 64), 0)
  variables = _Net(cfg).init(jax.random.key(0), x)
  want = _Net(cfg).apply(variables, x)
  frozen = aqtr_linen.convert(_Net(cfg, aqtr.Mode.CONVERT), variables, x)
  assert 'kernel' not in str(jax.tree_util.keystr(frozen.get('params', {})))
  served = _Net(cfg, aqtr.Mode.SERVE).apply(frozen, x)
  np.testing.assert_array_equal(served, want)


def test_bad_input():
  x, w = _rand((8, 64), 0), _rand((64, 16), 1)
  rot, plain = _cfg(fwd=_MX0), _cfg(fwd=_MX0, t=None)
  with pytest.raises(
    ValueError,
    match=r'frozen with transform None, but '
    r'config.fwd.rhs.transform is Hadamard',
  ):
    aqtr.dot_general(x, aqtr.quantize_operand(w, _DN, plain), _DN, rot)
  with pytest.raises(
    ValueError,
    match=r'frozen with transform Hadamard.*'
    r'config.fwd.rhs.transform is None',
  ):
    aqtr.dot_general(x, aqtr.quantize_operand(w, _DN, rot), _DN, plain)
  with pytest.raises(ValueError, match=r'fwd.lhs.transform: .*size 24'):
    aqtr.dot_general(_rand((8, 24), 0), _rand((24, 16), 1), _DN, _cfg())
  # ragged_dot rotates its forward operands as dot_general does.
  np.testing.assert_allclose(
    aqtr.ragged_dot(x, w[None], jnp.array([8]), _cfg()),
    aqtr.dot_general(x, w, _DN, _cfg()),
    rtol=1e-6,
    atol=1e-6,
  )
  raw = aqtr.DotGeneralRaw
  t = dataclasses.replace(_F, transform=_H)
  key = Hadamard(block_size=16, signs='key')
  with pytest.raises(ValueError, match=r"fwd.lhs.transform: .*signs='seed'"):
    _cfg(t=key)
  with pytest.raises(ValueError, match=r'dlhs.use_fwd_quant=True, but fwd'):
    aqtr.DotGeneralConfig(fwd=raw(lhs=t, rhs=t))
  int8 = aqtr.presets.int8().fwd.lhs
  with pytest.raises(ValueError, match=r'fwd.lhs.numerics.clip_gradient=True'):
    _cfg(
      fwd=dataclasses.replace(
        int8, numerics=numerics.IntSymmetric(bits=8, clip_gradient=True)
      )
    )
  lsq = dataclasses.replace(
    int8,
    numerics=numerics.IntSymmetric(bits=8),
    calibration=calibrations.get('lsq')(),
  )
  with pytest.raises(ValueError, match=r'fwd.lhs.calibration: Lsq learns'):
    _cfg(fwd=lsq)
  nm = dataclasses.replace(_F, sparsity=sparsity.get('n_m')())
  with pytest.raises(ValueError, match=r'fwd.lhs.sparsity: .* rotation'):
    _cfg(fwd=nm)
