"""Transforms in the engine: the backward passes rotate both operands.

The forward rotation (Quartet): tests/transforms/test_forward.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr import numerics, tilings, transforms
from aqtr.transforms import Hadamard

_DN = (((1,), (0,)), ((), ()))
_F = aqtr.TensorConfig(numerics=numerics.NoNumerics())
_NV = aqtr.TensorConfig(
  numerics=numerics.NvFp4(), tiling=tilings.SubChannel(tile_size=16)
)
# (lhs shape, rhs shape, dimension numbers): free sizes M, N multiples of 16.
DOTS = [
  ((32, 64), (64, 48), _DN),
  ((64, 32), (48, 32), (((1,), (1,)), ((), ()))),  # [N, K] weights
  ((2, 16, 8), (2, 8, 32), (((2,), (1,)), ((0,), (0,)))),  # batched
  ((4, 8, 24), (24, 16), (((2,), (0,)), ((), ()))),  # M = 4 x 8 flattened
]


def _rand(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), 'f4')


def _cfg(fwd=_F, dlhs=_F, drhs=_F, t=None, passes=('dlhs', 'drhs')):
  raw = aqtr.DotGeneralRaw
  rot = {}
  for name, tc in (('dlhs', dlhs), ('drhs', drhs)):
    if t is not None and name in passes:
      tc = dataclasses.replace(tc, transform=t)
    rot[name] = raw(lhs=tc, rhs=tc)
  return aqtr.DotGeneralConfig(fwd=raw(lhs=fwd, rhs=fwd), **rot)


def _value_and_grads(cfg, x, w, dn, c, key=None):
  def f(x, w):
    return aqtr.dot_general(x, w, dn, cfg, key=key)

  out, vjp = jax.vjp(f, x, w)
  return (out, *vjp(c))


@pytest.mark.parametrize('lhs, rhs, dn', DOTS)
@pytest.mark.parametrize('signs', ['seed', 'key'])
def test_float_dot_with_a_transform_equals_lax(lhs, rhs, dn, signs):
  # Rotating both operands of dlhs and drhs leaves the float gradients
  # unchanged (to float rounding); the forward is not rotated.
  x, w = _rand(lhs, 0), _rand(rhs, 1)
  c = _rand(
    jax.eval_shape(lambda x, w: lax.dot_general(x, w, dn), x, w).shape, 2
  )
  cfg = _cfg(t=Hadamard(block_size=8, signs=signs))
  assert not cfg.is_float
  key = jax.random.key(0)
  got = jax.jit(lambda x, w: _value_and_grads(cfg, x, w, dn, c, key))(x, w)
  ref = jax.jit(lambda x, w: _value_and_grads(_cfg(), x, w, dn, c))(x, w)
  np.testing.assert_array_equal(got[0], ref[0])
  for a, b in zip(got[1:], ref[1:], strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()))


def test_wgrad_quantizes_the_rotated_operands():
  # drhs in NVFP4 with RHT-16: dW = Q(R^T x)^T Q(R^T g), both operands
  # rotated along the M tokens and quantized in 16-blocks along M.
  x, w, c = _rand((64, 32), 0), _rand((32, 16), 1), _rand((64, 16), 2)
  h = Hadamard(block_size=16)
  cfg = _cfg(drhs=_NV, t=h, passes=('drhs',))

  def fq(a):
    return aqtr.fake_quant(a, _NV, contracting_axes=(0,))

  @jax.jit
  def both(x, w, c):
    dw = jax.vjp(lambda w: aqtr.dot_general(x, w, _DN, cfg), w)[1](c)[0]
    want = fq(h.apply(x, 0)).T @ fq(h.apply(c, 0))
    plain = fq(x).T @ fq(c)
    return dw, want, plain

  dw, want, plain = both(x, w, c)
  np.testing.assert_allclose(dw, want, rtol=1e-5, atol=1e-5)
  assert not np.allclose(dw, plain, rtol=1e-3, atol=1e-3)


def test_bad_input():
  h = Hadamard(block_size=16)
  x, w = jnp.ones((40, 32)), jnp.ones((32, 16))
  # A forward-only call (serving) is not refused for a gradient pass's
  # size; differentiating it is.
  assert aqtr.dot_general(x, w, _DN, _cfg(t=h)).shape == (40, 16)
  with pytest.raises(ValueError, match=r'drhs.lhs.transform: .*size 40'):
    jax.grad(lambda w: aqtr.dot_general(x, w, _DN, _cfg(t=h)).sum())(w)
  with pytest.raises(ValueError, match=r'drhs.lhs.transform: .*size 40'):
    aqtr.validation.check_shapes(_cfg(t=h), (40, 32), (32, 16), _DN)
  raw = aqtr.DotGeneralRaw
  t = dataclasses.replace(_F, transform=h)
  with pytest.raises(ValueError, match=r'drhs.rhs.transform: .* differs'):
    aqtr.DotGeneralConfig(drhs=raw(lhs=t, rhs=_F))
  with pytest.raises(ValueError, match=r'drhs.use_fwd_quant: .*rotated'):
    aqtr.DotGeneralConfig(drhs=raw(lhs=t, rhs=t, use_fwd_quant=True))
  with pytest.raises(ValueError, match=r'fwd.rhs.transform: .* differs'):
    aqtr.DotGeneralConfig(fwd=raw(lhs=t, rhs=_F))
  with pytest.raises(ValueError, match=r"signs='key'.*needs a PRNG key"):
    cfg = _cfg(t=Hadamard(block_size=16, signs='key'))
    aqtr.dot_general(jnp.ones((32, 32)), w, _DN, cfg)
  with pytest.raises(ValueError, match=r'drhs.lhs.transform: drhs contracts'):
    aqtr.ragged_dot(
      jnp.ones((4, 32)), jnp.ones((2, 32, 16)), jnp.array([2, 2]), _cfg(t=h)
    )
  with pytest.raises(TypeError, match=r'TensorConfig.transform'):
    aqtr.TensorConfig(transform='hadamard')


@pytest.mark.parametrize('preset', ['nvfp4_training', 'mxfp4_training'])
def test_recipe_presets_train_and_serve(preset):
  cfg = getattr(aqtr.presets, preset)()
  assert cfg.needs_key and cfg.drhs.transform.transforms
  x, w, c = _rand((64, 64), 0), _rand((64, 32), 1), _rand((64, 32), 2)
  key = jax.random.key(0)

  @jax.jit
  def step(x, w):
    return _value_and_grads(cfg, x, w, _DN, c, key)

  out, dx, dw = step(x, w)
  assert all(jnp.isfinite(a).all() for a in (out, dx, dw))
  # SERVE: a frozen weight (stored rotated when the forward rotates)
  # gives the training forward bit for bit; its gradient pass rotates the
  # frozen values dequantized.
  frozen = aqtr.quantize_operand(w, _DN, cfg, key=key)

  @jax.jit
  def serve(x):
    def f(x):
      return aqtr.dot_general(x, frozen, _DN, cfg, key=key)

    out, vjp = jax.vjp(f, x)
    return out, vjp(c)[0]

  served, dx_served = serve(x)
  np.testing.assert_array_equal(served, out)
  assert jnp.isfinite(dx_served).all()


def test_recipe_ablation_knobs():
  full = aqtr.presets.nvfp4_training()
  assert full.fwd.rhs.tiling == tilings.Block2d(tile_size=16, free_size=16)
  assert (
    full.dlhs.lhs.rounding.stochastic and not full.fwd.lhs.rounding.stochastic
  )
  assert not aqtr.presets.nvfp4_training(rht=False).drhs.transform.transforms
  assert not aqtr.presets.nvfp4_training(stochastic_rounding=False).needs_key
  assert aqtr.presets.nvfp4_training(
    weight_blocks_2d=False
  ).fwd.rhs.tiling == tilings.SubChannel(tile_size=16)
  assert not aqtr.presets.mxfp4_training(
    hadamard=False
  ).dlhs.transform.transforms


def test_use_transform_fiddler():
  cfg = aqtr.fiddle.config('nvfp4_training', rht=False)
  aqtr.fiddlers.use_transform(cfg, r'drhs\..*', 'hadamard', block_size=32)
  built = aqtr.fiddle.build(cfg)
  assert (
    built.drhs.lhs.transform
    == built.drhs.rhs.transform
    == Hadamard(block_size=32)
  )
  assert transforms.get('none')() == built.dlhs.lhs.transform
