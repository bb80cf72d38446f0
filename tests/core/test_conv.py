"""Tests for aqtr.core.conv: the quantized conv_general_dilated.

Checked: config=None / float configs are lax.conv_general_dilated bit for
bit (values and gradients); the im2col plan reproduces lax for strides,
dilations, pads, layouts and feature groups; with power-of-two scales the
int8 forward and both int8 gradients equal an independent hand reference
bit for bit; float backward passes equal autodiff of the fake-quant
reference; the jaxpr of the VJP holds three int8 x int8 dots.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr import presets
from aqtr.core import conv as conv_lib
from aqtr.core.lowering import sub_jaxprs

# (lhs shape, rhs shape, strides, padding, lhs_dil, rhs_dil, dnums, groups)
CASES = {
  'nhwc_same': (
    (2, 7, 9, 6),
    (3, 2, 6, 4),
    (1, 1),
    'SAME',
    None,
    None,
    ('NHWC', 'HWIO', 'NHWC'),
    1,
  ),
  'strided_dilated': (
    (2, 7, 9, 6),
    (3, 2, 6, 4),
    (2, 1),
    'VALID',
    None,
    (2, 1),
    ('NHWC', 'HWIO', 'NHWC'),
    1,
  ),
  'nchw_pads_lhs_dil': (
    (2, 6, 7, 9),
    (4, 6, 3, 3),
    (2, 2),
    [(1, 2), (0, 1)],
    (2, 1),
    None,
    None,
    1,
  ),
  'grouped_same_lower': (
    (2, 6, 7, 9),
    (6, 3, 3, 3),
    (1, 2),
    'SAME_LOWER',
    None,
    (1, 2),
    None,
    2,
  ),
  'conv1d': (
    (3, 10, 5),
    (3, 5, 8),
    (3,),
    'SAME',
    None,
    None,
    ('NWC', 'WIO', 'NWC'),
    1,
  ),
  'conv3d_out_nc': (
    (2, 5, 6, 7, 4),
    (2, 2, 2, 4, 3),
    (1, 1, 2),
    'SAME',
    None,
    None,
    ('NDHWC', 'DHWIO', 'NCDHW'),
    1,
  ),
  'negative_pad_grouped': (
    (2, 6, 7, 9),
    (6, 3, 3, 3),
    (1, 1),
    [(-1, 2), (1, 0)],
    (1, 3),
    (2, 1),
    ('NCHW', 'OIHW', 'NHWC'),
    2,
  ),
}


def _args(case):
  ls, rs, st, pad, ld, rd, dn, g = CASES[case]
  return (
    ls,
    rs,
    dict(
      window_strides=st,
      padding=pad,
      lhs_dilation=ld,
      rhs_dilation=rd,
      dimension_numbers=dn,
      feature_group_count=g,
    ),
  )


def _operands(case, seed=0):
  ls, rs, kw = _args(case)
  rng = np.random.default_rng(seed)  # (jax.random compiles slowly on CPU)
  x = jnp.asarray(rng.standard_normal(ls), jnp.float32)
  w = jnp.asarray(rng.standard_normal(rs), jnp.float32)
  return x, w, kw


def _po2(cfg: aqtr.DotGeneralConfig) -> aqtr.DotGeneralConfig:
  def t(x):
    return dataclasses.replace(
      x, calibration=dataclasses.replace(x.calibration, po2_scale=True)
    )

  def raw(r):
    return dataclasses.replace(r, lhs=t(r.lhs), rhs=t(r.rhs))

  return dataclasses.replace(
    cfg, fwd=raw(cfg.fwd), dlhs=raw(cfg.dlhs), drhs=raw(cfg.drhs)
  )


def _vjp(fn, x, w):
  """(out, dx, dw) for a fixed random cotangent g, jitted; and g."""

  @jax.jit
  def run(x, w, g):
    out, pull = jax.vjp(fn, x, w)
    return (out, *pull(g)), g

  out = jax.eval_shape(fn, x, w)
  g = np.random.default_rng(7).standard_normal(out.shape)
  return run(x, w, jnp.asarray(g, out.dtype))


def _bitwise(got, want):
  for a, b in zip(got, want, strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  'case,config',
  [
    ('nhwc_same', None),
    ('nhwc_same', presets.float()),
    ('negative_pad_grouped', None),
  ],
)
def test_float_path_is_lax_bit_for_bit(case, config):
  x, w, kw = _operands(case)
  got, _ = _vjp(
    lambda a, b: aqtr.conv_general_dilated(a, b, config=config, **kw), x, w
  )
  want, _ = _vjp(lambda a, b: lax.conv_general_dilated(a, b, **kw), x, w)
  _bitwise(got, want)


@pytest.mark.parametrize('case', sorted(CASES))
def test_plan_reproduces_lax(case):
  x, w, kw = _operands(case)
  ls, rs, _ = _args(case)
  p = conv_lib.plan(ls, rs, **kw)
  got = jax.jit(
    lambda x, w: p.output(
      lax.dot_general(
        p.patches(x), p.kernel(w), p.dimension_numbers, precision='highest'
      )
    )
  )(x, w)
  want = lax.conv_general_dilated(x, w, precision='highest', **kw)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _q(x, axis):
  """int8 [-127, 127] with a po2 absmax scale per group (reduce `axis`)."""
  bound = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  s = jnp.where(bound < 127 * np.finfo(np.float32).tiny, 1.0, bound / 127)
  # An exact power of two (a jitted exp2 is not exact on XLA:CPU).
  s = jnp.ldexp(jnp.ones_like(s), jnp.ceil(jnp.log2(s)).astype(jnp.int32))
  return jnp.clip(jnp.round(x / s), -127, 127), s


def _hand(x, w, g, p):
  """int8 fwd/dlhs/drhs of the conv, by hand from the dot_general math.

  P [M, K] patches, W [K, N]: per-channel scales; the backward passes fold
  the partner's forward scale into g and quantize it per channel.
  """
  p4 = p.patches(x)
  w2 = p.kernel(w)
  k, n = w2.shape
  pm = p4.reshape(-1, k)
  out_sd = jax.ShapeDtypeStruct(p4.shape[:-1] + (n,), jnp.float32)
  g_dot = jax.linear_transpose(p.output, out_sd)(g)[0].reshape(-1, n)
  qx, sx = _q(pm, 1)
  qw, sw = _q(w2, 0)
  out = (qx @ qw) * sx * sw
  qga, sga = _q(g_dot * sw, 1)
  dp = (qga @ qw.T) * sga
  qgb, sgb = _q(g_dot * sx, 0)
  dw2 = (qx.T @ qgb) * sgb
  dx = jax.linear_transpose(p.patches, x)(dp.reshape(p4.shape))[0]
  dw = jax.linear_transpose(p.kernel, w)(dw2)[0]
  return p.output(out.reshape(out_sd.shape)), dx, dw


@pytest.mark.parametrize('case', ['nhwc_same', 'nchw_pads_lhs_dil'])
def test_po2_int8_forward_and_gradients_equal_hand_reference(case):
  x, w, kw = _operands(case)
  cfg = _po2(presets.int8())
  got, g = _vjp(
    lambda a, b: aqtr.conv_general_dilated(a, b, config=cfg, **kw), x, w
  )
  p = conv_lib.plan(x.shape, w.shape, **kw)
  _bitwise(got, jax.jit(lambda x, w, g: _hand(x, w, g, p))(x, w, g))


@pytest.mark.parametrize('case', ['nhwc_same', 'grouped_same_lower'])
def test_float_backward_equals_fake_quant_autodiff(case):
  x, w, kw = _operands(case)
  cfg = presets.int8_fwd()
  p = conv_lib.plan(x.shape, w.shape, **kw)
  (lc, rc), (lb, rb) = p.dimension_numbers

  def ref(a, b):
    fa = aqtr.fake_quant(
      p.patches(a), cfg.fwd.lhs, contracting_axes=lc, batch_axes=lb
    )
    fb = aqtr.fake_quant(
      p.kernel(b), cfg.fwd.rhs, contracting_axes=rc, batch_axes=rb
    )
    return p.output(lax.dot_general(fa, fb, p.dimension_numbers))

  got, _ = _vjp(
    lambda a, b: aqtr.conv_general_dilated(a, b, config=cfg, **kw), x, w
  )
  want, _ = _vjp(ref, x, w)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('case', ['nhwc_same', 'grouped_same_lower'])
def test_int8_gradients_nonzero_and_close_to_float(case):
  x, w, kw = _operands(case)
  got, _ = _vjp(
    lambda a, b: aqtr.conv_general_dilated(a, b, config=presets.int8(), **kw),
    x,
    w,
  )
  want, _ = _vjp(lambda a, b: lax.conv_general_dilated(a, b, **kw), x, w)
  for a, b in zip(got, want, strict=True):
    assert float(jnp.abs(a).min()) >= 0 and float(jnp.abs(a).max()) > 0
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert 0 < rel < 0.03, rel


def _dots(fn, *args):
  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == 'dot_general':
        yield tuple(str(v.aval.dtype) for v in e.invars)
      for sub in sub_jaxprs(e):
        yield from walk(sub)

  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_vjp_jaxpr_has_int8_backward_dots():
  x, w, kw = _operands('nhwc_same')

  def grads(a, b):
    f = lambda a, b: aqtr.conv_general_dilated(  # noqa: E731
      a, b, config=presets.int8(), **kw
    )
    out, pull = jax.vjp(f, a, b)
    return pull(jnp.ones_like(out))

  assert _dots(grads, x, w) == [('int8', 'int8')] * 3
  fwd_only = _dots(
    lambda a, b: aqtr.conv_general_dilated(a, b, config=presets.int8(), **kw),
    x,
    w,
  )
  assert fwd_only == [('int8', 'int8')]


def test_jit_and_grad_agree_with_eager():
  x, w, kw = _operands('strided_dilated')

  def loss(a, b):
    y = aqtr.conv_general_dilated(a, b, config=presets.int8(), **kw)
    return jnp.sum(y * y)

  eager = jax.grad(loss, argnums=(0, 1))(x[:1], w)
  jitted = jax.jit(jax.grad(loss, argnums=(0, 1)))(x[:1], w)
  for a, b in zip(eager, jitted, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_stochastic_rounding_needs_a_key():
  x, w, kw = _operands('nhwc_same')
  cfg = presets.fully_quantized(8, 8, stochastic_rounding=True)

  def loss(a, key=None):
    return aqtr.conv_general_dilated(a, w, config=cfg, key=key, **kw).sum()

  with pytest.raises(ValueError, match='PRNG key'):
    jax.grad(loss)(x)
  grad = jax.jit(jax.grad(loss))
  g1 = grad(x, jax.random.key(1))
  g2 = grad(x, jax.random.key(2))
  assert not np.array_equal(g1, g2)


def test_bad_arguments_are_reported():
  x, w, kw = _operands('nhwc_same')
  cfg = presets.int8()
  with pytest.raises(NotImplementedError, match='batch_group_count'):
    aqtr.conv_general_dilated(
      x,
      w,
      (1, 1),
      'SAME',
      dimension_numbers=kw['dimension_numbers'],
      batch_group_count=2,
      config=cfg,
    )
  with pytest.raises(ValueError, match='lhs_dilation'):
    aqtr.conv_general_dilated(
      x,
      w,
      (1, 1),
      'SAME',
      lhs_dilation=(2, 1),
      dimension_numbers=kw['dimension_numbers'],
      config=cfg,
    )
  with pytest.raises(ValueError, match='window_strides'):
    aqtr.conv_general_dilated(
      x,
      w,
      (1, 1, 1),
      'SAME',
      dimension_numbers=kw['dimension_numbers'],
      config=cfg,
    )
  with pytest.raises(ValueError, match='feature_group_count'):
    aqtr.conv_general_dilated(
      x,
      w,
      (1, 1),
      'SAME',
      dimension_numbers=kw['dimension_numbers'],
      feature_group_count=4,
      config=cfg,
    )
  with pytest.raises(ValueError, match='padding'):
    aqtr.conv_general_dilated(
      x,
      w,
      (1, 1),
      [(1, 1)],
      dimension_numbers=kw['dimension_numbers'],
      config=cfg,
    )


def test_plan_shapes():
  p = conv_lib.plan(
    (2, 8, 8, 6),
    (3, 3, 3, 4),
    (2, 2),
    'SAME',
    dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
    feature_group_count=2,
  )
  assert p.kernel_shape == (2, 27, 2)
  assert p.out_spatial == (4, 4)
  assert p.patches(jnp.ones((2, 8, 8, 6))).shape == (2, 4, 4, 2, 27)
  assert math.prod(p.window) == 9
