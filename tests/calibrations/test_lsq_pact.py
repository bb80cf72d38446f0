"""LSQ and PACT: the learned gradients equal the papers' formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.calibrations import Lsq, Pact
from aqtr.numerics import IntSymmetric

DN = (((1,), (0,)), ((), ()))
INT4 = IntSymmetric(bits=4, preserve_max_val=True)


def _cfg(lhs_cal, rhs_cal=None, numerics=INT4):
  f = aqtr.TensorConfig(numerics=aqtr.numerics.NoNumerics())
  lhs = aqtr.TensorConfig(numerics=numerics, calibration=lhs_cal)
  rhs = (
    f
    if rhs_cal is None
    else aqtr.TensorConfig(numerics=numerics, calibration=rhs_cal)
  )
  raw = aqtr.DotGeneralRaw(lhs=f, rhs=f)
  return aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=lhs, rhs=rhs), dlhs=raw, drhs=raw
  )


def _data(seed=0, m=4, k=16, n=3):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  return x, w, c


def _grads(cfg, x, w, c, s):
  def loss(x, s):
    out, _ = aqtr.dot_general(x, w, DN, cfg, state=s)
    return jnp.sum(out * c)

  return jax.jit(jax.grad(loss, (0, 1)))(x, s)


def test_lsq_init_and_step_gradient_is_the_papers():
  x, w, c = _data()
  cfg = _cfg(Lsq())
  s = aqtr.state.init(x, w, DN, cfg)
  qp = INT4.max_value
  step = s['fwd.lhs']['learned']['step'].reshape(-1, 1)
  want = 2 * jnp.mean(jnp.abs(x), axis=1, keepdims=True) / math.sqrt(qp)
  np.testing.assert_allclose(step, want, rtol=1e-6)
  # A smaller step so that some values clip.
  s['fwd.lhs']['learned']['step'] = s['fwd.lhs']['learned']['step'] * 0.4
  step = step * 0.4
  gx, gs = _grads(cfg, x, w, c, s)
  dxhat = np.asarray(c @ w.T)
  v = np.asarray(x / step)
  inside = np.abs(v) < qp
  q = np.clip(np.round(v), -qp, qp)
  h = q - np.where(inside, v, 0)
  want = (dxhat * h).sum(1) / math.sqrt(x.shape[1] * qp)
  got = aqtr.state.split(gs)[0]['fwd.lhs']['step'].ravel()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert 0 < inside.mean() < 1  # Both branches are exercised.
  np.testing.assert_allclose(gx, np.where(inside, dxhat, 0), rtol=1e-5)


@pytest.mark.slow
def test_lsq_clipped_step_gradient_matches_finite_differences():
  # All values clipped: xhat = sign(x) * s * QP exactly, so the finite
  # difference of the loss equals the (unscaled) LSQ gradient.
  x, w, c = _data(1)
  x = jnp.sign(x) * (2 + jnp.abs(x))
  cfg = _cfg(Lsq(), numerics=IntSymmetric(bits=2, preserve_max_val=True))
  s = aqtr.state.init(x, w, DN, cfg)
  s['fwd.lhs']['learned']['step'] = jnp.full((1, 1, 4, 1), 0.5)

  def loss(t):
    st = {'fwd.lhs': {'stats': {}, 'learned': {'step': t}}}
    return jnp.sum(aqtr.dot_general(x, w, DN, cfg, state=st)[0] * c)

  t = s['fwd.lhs']['learned']['step']
  g = jax.grad(loss)(t)
  eps = 1e-3
  fd = [
    (loss(t.at[0, 0, i, 0].add(eps)) - loss(t.at[0, 0, i, 0].add(-eps)))
    / (2 * eps)
    for i in range(4)
  ]
  scale = math.sqrt(x.shape[1] * 1.0)  # QP = 1 for 2 bits.
  np.testing.assert_allclose(g.ravel() * scale, fd, rtol=2e-3)


def test_pact_clip_gradient_and_penalty():
  x, w, c = _data(2)
  cfg = _cfg(Pact(init_clip=0.8, l2=0.01))
  s = aqtr.state.init(x, w, DN, cfg)
  gx, gs = _grads(cfg, x, w, c, s)
  dxhat = np.asarray(c @ w.T)
  out = np.abs(np.asarray(x)) >= 0.8
  want = (dxhat * np.where(out, np.sign(x), 0)).sum(1)
  got = gs['fwd.lhs']['learned']['clip'].ravel()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gx, np.where(out, 0, dxhat), rtol=1e-5)
  np.testing.assert_allclose(aqtr.state.penalty(cfg, s), 0.01 * 0.64 * 4)
  # Fully clipped rows: y = sign(x) * alpha, the finite difference agrees.
  xc = jnp.sign(x) * (1 + jnp.abs(x))

  def loss(a):
    st = {'fwd.lhs': {'stats': {}, 'learned': {'clip': a}}}
    return jnp.sum(aqtr.dot_general(xc, w, DN, cfg, state=st)[0] * c)

  a = s['fwd.lhs']['learned']['clip']
  eps = 1e-3
  fd = (loss(a.at[0, 0, 1, 0].add(eps)) - loss(a.at[0, 0, 1, 0].add(-eps))) / (
    2 * eps
  )
  np.testing.assert_allclose(jax.grad(loss)(a)[0, 0, 1, 0], fd, rtol=2e-3)


def test_a_small_model_trains_its_scales():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
  w_true = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
  y = jnp.maximum(x @ w_true, 0)
  cfg = _cfg(Pact(init_clip=0.5), Lsq())
  w = w_true + 0.3 * jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
  s = aqtr.state.init(x, w, DN, cfg)
  params = (w, aqtr.state.learned(s))

  @jax.jit
  def step(params):
    def loss(p):
      w, learned = p
      st = aqtr.state.with_learned(s, learned)
      out, _ = aqtr.dot_general(x, w, DN, cfg, state=st)
      return jnp.mean((jnp.maximum(out, 0) - y) ** 2)

    v, g = jax.value_and_grad(loss)(params)
    return v, jax.tree.map(lambda p, g: p - 0.05 * g, params, g)

  losses = []
  p = params
  for _ in range(40):
    v, p = step(p)
    losses.append(float(v))
  assert losses[-1] < 0.5 * losses[0], losses
  for path, name in (('fwd.lhs', 'clip'), ('fwd.rhs', 'step')):
    moved = p[1][path][name] - params[1][path][name]
    assert float(jnp.abs(moved).max()) > 1e-3, (path, moved)


def test_learned_errors():
  x, w, _ = _data()
  with pytest.raises(ValueError, match='gradient'):
    Lsq().init_state(
      jax.ShapeDtypeStruct((1, 1, 4, 4), jnp.float32), (3,), INT4
    )
  t = aqtr.TensorConfig(numerics=INT4, calibration=Lsq())
  bad = aqtr.DotGeneralConfig(dlhs=aqtr.DotGeneralRaw(lhs=t, rhs=t))
  with pytest.raises(ValueError, match='dlhs.lhs.*learns'):
    aqtr.dot_general(x, w, DN, bad, state={})


def _with(name, value):
  return {'fwd.lhs': {'stats': {}, 'learned': {name: value}}}


@pytest.mark.parametrize('cal, name', [(Lsq(), 'step'), (Pact(), 'clip')])
def test_a_negative_step_or_clip_gets_the_gradient_of_its_sign(cal, name):
  # The bound uses |p|, so d loss / d p at -p is minus the one at +p:
  # gradient descent moves |p| the same way from either sign.
  x, w, c = _data(4)
  x = jnp.sign(x) * (0.5 + jnp.abs(x))
  cfg = _cfg(cal)
  p = aqtr.state.init(x, w, DN, cfg)['fwd.lhs']['learned'][name] * 0.4
  gx, g_pos = _grads(cfg, x, w, c, _with(name, p))
  gx_neg, g_neg = _grads(cfg, x, w, c, _with(name, -p))
  g_pos = g_pos['fwd.lhs']['learned'][name]
  g_neg = g_neg['fwd.lhs']['learned'][name]
  assert float(jnp.abs(g_pos).min()) > 0
  np.testing.assert_array_equal(g_neg, -g_pos)
  np.testing.assert_array_equal(gx_neg, gx)

  def loss(a):
    return jnp.sum(aqtr.dot_general(x, w, DN, cfg, state=_with(name, a))[0] * c)

  # The finite difference at -p agrees in sign with the gradient.
  eps = 1e-3 * jnp.abs(p)
  fd = (loss(-p + eps) - loss(-p - eps)) / 2
  assert float(fd) * float(jnp.sum(g_neg * eps)) > 0


@pytest.mark.parametrize('cal, name', [(Lsq(), 'step'), (Pact(), 'clip')])
def test_a_zero_step_or_clip_quantizes_to_zero(cal, name):
  # p = 0 acts as the smallest positive p (2^-126): every value clips to
  # ~0 (it used to quantize with step 1), no x gradient passes, and the
  # p gradient is that of a tiny positive p (finite, non-zero).
  x, w, c = _data(5)
  x = 10 * x  # x / 2^-126 overflows: still clipped, not passed through
  cfg = _cfg(cal)
  zero = jnp.zeros_like(
    aqtr.state.init(x, w, DN, cfg)['fwd.lhs']['learned'][name]
  )
  out, _ = aqtr.dot_general(x, w, DN, cfg, state=_with(name, zero))
  assert float(jnp.abs(out).max()) < 1e-30
  gx, g0 = _grads(cfg, x, w, c, _with(name, zero))
  _, g_tiny = _grads(cfg, x, w, c, _with(name, zero + 1e-37))
  g0 = g0['fwd.lhs']['learned'][name]
  np.testing.assert_array_equal(gx, 0)
  np.testing.assert_allclose(g0, g_tiny['fwd.lhs']['learned'][name], rtol=1e-6)
  assert bool(jnp.all(jnp.isfinite(g0))) and float(jnp.abs(g0).min()) > 0


@pytest.mark.parametrize('bad', [jnp.nan, jnp.inf])
def test_init_from_data_ignores_non_finite_values(bad):
  # A NaN used to give step/clip 1.0 silently; an inf gave an inf clip
  # (every later output NaN).
  x, w, _ = _data(6)
  dirty = x.at[1, 3].set(bad)
  for cal, name in ((Lsq(), 'step'), (Pact(), 'clip')):
    cfg = _cfg(cal)
    got = aqtr.state.init(dirty, w, DN, cfg)['fwd.lhs']['learned'][name]
    clean = aqtr.state.init(x, w, DN, cfg)['fwd.lhs']['learned'][name]
    assert bool(jnp.all(jnp.isfinite(got)))
    rows = np.arange(x.shape[0]) != 1  # other rows: the clean init
    np.testing.assert_array_equal(got.ravel()[rows], clean.ravel()[rows])
  row = jnp.abs(jnp.delete(x[1], 3))
  want = 2 * float(row.mean()) / math.sqrt(INT4.max_value)
  got = aqtr.state.init(dirty, w, DN, _cfg(Lsq()))['fwd.lhs']['learned']
  assert float(got['step'].ravel()[1]) == pytest.approx(want, rel=1e-6)
