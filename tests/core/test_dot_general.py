"""Tests for aqtr.core.dot_general: the quantized dot and its custom VJP.

The properties checked:
  * float configs equal `lax.dot_general` bit for bit, values and gradients;
  * with power-of-two scales the real int8 dot equals the fake-quant
    reference bit for bit, in the forward pass and in both gradients
    (against autodiff of the reference for float backward passes, against
    a hand-written reference for int8 backward passes);
  * the jaxpr really holds int8 x int8 -> int32 / fp8 -> f32 dots;
  * stochastic rounding, transformations, retracing, bad input, NaN/inf.
Contraction sizes stay small so every int32 sum is below 2^24 and the float
reference is exact.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax import lax
from jax._src.interpreters import partial_eval as pe  # DCE for jaxpr checks

import aqtr
from aqtr import calibrations, numerics, presets, tilings
from aqtr.core import dot_general as dg_lib
from aqtr.core import native_dot
from aqtr.core.lowering import sub_jaxprs

MK_KN = (((1,), (0,)), ((), ()))  # rhs [K, N]: the engine's 'kf' path.
MK_NK = (((1,), (1,)), ((), ()))  # rhs [N, K]: the engine's 'fk' path.

# (lhs shape, rhs shape, dimension numbers) with batch axes, several
# contraction axes and axes in unusual orders.
CASES = {
  'mk_kn': ((5, 16), (16, 6), MK_KN),
  'mk_nk': ((5, 16), (6, 16), MK_NK),
  'batch_kf': ((2, 3, 8), (2, 8, 4), (((2,), (1,)), ((0,), (0,)))),
  'batch_fk': ((2, 3, 8), (2, 4, 8), (((2,), (2,)), ((0,), (0,)))),
  'multi': (
    (3, 4, 2, 5),
    (4, 6, 3, 2),
    (((2, 1), (3, 0)), ((0,), (2,))),
  ),
  'k_first': ((8, 3, 2), (2, 8, 5), (((0,), (1,)), ((2,), (0,)))),
}

# ---------------------------------------------------------------- helpers


def tensor(
  tiling=None,
  num=None,
  po2=True,
  rounding=None,
  calibration=None,
) -> aqtr.TensorConfig:
  return aqtr.TensorConfig(
    numerics=num or numerics.IntSymmetric(bits=8),
    calibration=calibration or calibrations.AbsMax(po2_scale=po2),
    tiling=tiling or tilings.PerChannel(),
    rounding=rounding or aqtr.NearestEven(),
  )


def float_tensor() -> aqtr.TensorConfig:
  return aqtr.TensorConfig(numerics=numerics.NoNumerics())


def config(
  lhs: aqtr.TensorConfig,
  rhs: aqtr.TensorConfig,
  grad: aqtr.TensorConfig | None = None,
  reuse: bool = True,
) -> aqtr.DotGeneralConfig:
  """fwd quantizes (lhs, rhs); both backward dots quantize g with `grad`.

  With `reuse` the backward dots reuse the forward QTensor of the residual;
  without it they quantize the float residual again with the same numerics
  (per channel).
  """
  grad = grad or float_tensor()
  res = rhs if reuse else dataclasses.replace(rhs, tiling=tilings.PerChannel())
  res_l = (
    lhs if reuse else dataclasses.replace(lhs, tiling=tilings.PerChannel())
  )
  return aqtr.DotGeneralConfig(
    fwd=aqtr.DotGeneralRaw(lhs=lhs, rhs=rhs),
    dlhs=aqtr.DotGeneralRaw(lhs=grad, rhs=res, use_fwd_quant=reuse),
    drhs=aqtr.DotGeneralRaw(lhs=grad, rhs=res_l, use_fwd_quant=reuse),
  )


def with_po2(cfg: aqtr.DotGeneralConfig) -> aqtr.DotGeneralConfig:
  """`cfg` with power-of-two scales in every TensorConfig."""

  def t(x):
    return dataclasses.replace(
      x, calibration=dataclasses.replace(x.calibration, po2_scale=True)
    )

  def raw(r):
    return dataclasses.replace(r, lhs=t(r.lhs), rhs=t(r.rhs))

  return dataclasses.replace(
    cfg, fwd=raw(cfg.fwd), dlhs=raw(cfg.dlhs), drhs=raw(cfg.drhs)
  )


def with_calibration(cfg, calibration):
  def t(x):
    return dataclasses.replace(x, calibration=calibration)

  def raw(r):
    return dataclasses.replace(r, lhs=t(r.lhs), rhs=t(r.rhs))

  return dataclasses.replace(
    cfg, fwd=raw(cfg.fwd), dlhs=raw(cfg.dlhs), drhs=raw(cfg.drhs)
  )


def randn(seed: int, *shapes, dtype=jnp.float32):
  """Standard normal arrays (numpy: no per-shape compilation)."""
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


@functools.partial(jax.jit, static_argnums=(0, 1))
def vjp(cfg, dn, lhs, rhs, g, key=None):
  """(out, dlhs, drhs) of aqtr.dot_general, jitted once per config/shape."""
  out, pull = jax.vjp(
    lambda a, b: aqtr.dot_general(a, b, dn, cfg, key=key), lhs, rhs
  )
  return (out, *pull(g))


def fq_dot(lhs, rhs, dn, cfg: aqtr.DotGeneralConfig):
  """The fake-quant reference of the forward pass."""
  (lc, rc), (lb, rb) = dn
  fl = aqtr.fake_quant(lhs, cfg.fwd.lhs, contracting_axes=lc, batch_axes=lb)
  fr = aqtr.fake_quant(rhs, cfg.fwd.rhs, contracting_axes=rc, batch_axes=rb)
  return lax.dot_general(fl, fr, dn)


@functools.partial(jax.jit, static_argnums=(0, 1))
def fq_vjp(cfg, dn, lhs, rhs, g):
  """(out, dlhs, drhs) of the fake-quant reference, by autodiff."""
  out, pull = jax.vjp(lambda a, b: fq_dot(a, b, dn, cfg), lhs, rhs)
  return (out, *pull(g))


def assert_bitwise(got, want):
  for a, b in zip(got, want, strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype, (a, b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def all_eqns(jaxpr):
  """Every eqn of `jaxpr`, recursing into sub-jaxprs (pjit, custom_vjp...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in sub_jaxprs(eqn):
      yield from all_eqns(sub)


def live_eqns(fn, *args):
  """The eqns of `fn`'s jaxpr that contribute to its outputs."""
  closed = jax.make_jaxpr(fn)(*args)
  jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  return list(all_eqns(jaxpr))


def vjp_fn(cfg, dn, key=None):
  def f(lhs, rhs, g):
    out, pull = jax.vjp(
      lambda a, b: aqtr.dot_general(a, b, dn, cfg, key=key), lhs, rhs
    )
    return out, pull(g)

  return f


def dots(eqns):
  """(operand dtypes, preferred dtype) of every dot_general eqn."""
  out = []
  for e in eqns:
    if e.primitive.name == native_dot.TARGET:  # XLA's int8 dot's bits.
      out.append((tuple(str(v.aval.dtype) for v in e.invars), 'int32'))
    if e.primitive.name == 'dot_general':
      pref = e.params['preferred_element_type']
      out.append(
        (
          tuple(str(v.aval.dtype) for v in e.invars),
          None if pref is None else str(jnp.dtype(pref)),
        )
      )
  return out


# ------------------------------------------------- canonical hand reference


def _q(x, axes):
  """int8 pmv quantization with a po2 absmax scale per group: (q, s)."""
  bound = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
  s = jnp.where(bound < 127 * np.finfo(np.float32).tiny, 1.0, bound / 127)
  # An exact power of two (a jitted exp2 is not exact on XLA:CPU).
  s = jnp.ldexp(jnp.ones_like(s), jnp.ceil(jnp.log2(s)).astype(jnp.int32))
  return jnp.clip(jnp.round(x / s), -127, 127), s


_AXES = {  # reduction axes of x [B, M, T, t] and w [B, T, t, N]
  'channel': ((2, 3), (1, 2)),
  'tensor': ((0, 1, 2, 3), (0, 1, 2, 3)),
  'sub': ((3,), (2,)),
}


def hand_reference(
  x, w, g, tiles=1, lhs_tiling='channel', rhs_tiling='channel', reuse=True
):
  """int8 fwd, dlhs and drhs on x [B, M, K], w [B, K, N], g [B, M, N].

  Written from the math of aqtr.core.dot_general, independently of the
  engine: forward operands quantized per `lhs_tiling` / `rhs_tiling`
  ('channel', 'tensor', 'sub' with `tiles` tiles along K); the gradient
  is quantized per channel, with the forward scale of the residual folded
  in (`reuse`) or with the float residual quantized again per channel.
  """
  b, m, k = x.shape
  n = w.shape[2]
  t = k // tiles
  x4 = x.reshape(b, m, tiles, t)
  w4 = w.reshape(b, tiles, t, n)
  qx, sx = _q(x4, _AXES[lhs_tiling][0])
  qw, sw = _q(w4, _AXES[rhs_tiling][1])
  sx = jnp.broadcast_to(sx, (b, m, tiles, 1))
  sw = jnp.broadcast_to(sw, (b, tiles, 1, n))
  part = jnp.einsum('bmjk,bjkn->bjmn', qx, qw)  # exact integers
  out = (part * sx.transpose(0, 2, 1, 3) * sw).sum(axis=1)
  if reuse:
    ga = g[:, None] * sw  # [B, T, M, N]
    qga, sga = _q(ga, (3,))
    dx = jnp.einsum('bjmn,bjkn->bmjk', qga, qw)
    dx = (dx * sga.transpose(0, 2, 1, 3)).reshape(b, m, k)
    gb = g[:, None] * sx.transpose(0, 2, 1, 3)  # [B, T, M, N]
    qgb, sgb = _q(gb, (2,))
    dw = jnp.einsum('bmjk,bjmn->bjkn', qx, qgb) * sgb
    dw = dw.reshape(b, k, n)
  else:
    qg, sg = _q(g, (2,))
    qw2, sw2 = _q(w, (2,))
    dx = jnp.einsum('bmn,bkn->bmk', qg, qw2) * sg * sw2.transpose(0, 2, 1)
    qg1, sg1 = _q(g, (1,))
    qx1, sx1 = _q(x, (1,))
    dw = jnp.einsum('bmk,bmn->bkn', qx1, qg1) * sx1.transpose(0, 2, 1) * sg1
  return out, dx, dw


def canonical_reference(lhs, rhs, g, dn, **kw):
  """`hand_reference` for any dimension numbers, by transposing."""
  (lc, rc), (lb, rb) = dn
  lf = [a for a in range(lhs.ndim) if a not in lc + lb]
  rf = [a for a in range(rhs.ndim) if a not in rc + rb]
  lperm = list(lb) + lf + list(lc)
  rperm = list(rb) + list(rc) + rf

  def size(shape, axes):
    return math.prod(shape[a] for a in axes)

  bsz, m = size(lhs.shape, lb), size(lhs.shape, lf)
  k, n = size(lhs.shape, lc), size(rhs.shape, rf)
  x = lhs.transpose(lperm).reshape(bsz, m, k)
  w = rhs.transpose(rperm).reshape(bsz, k, n)
  out, dx, dw = hand_reference(x, w, g.reshape(bsz, m, n), **kw)
  dx = dx.reshape([lhs.shape[a] for a in lperm]).transpose(np.argsort(lperm))
  dw = dw.reshape([rhs.shape[a] for a in rperm]).transpose(np.argsort(rperm))
  return out.reshape(g.shape), dx, dw


# ------------------------------------------------ random dimension numbers


@st.composite
def dot_problems(draw, max_size=3):
  """(lhs_shape, rhs_shape, dimension_numbers, seed): any axis order."""
  nb = draw(st.integers(0, 2))
  nc = draw(st.integers(0, 3))
  nlf = draw(st.integers(0, 2))
  nrf = draw(st.integers(0, 2))
  size = st.integers(1, max_size)
  bs = [draw(size) for _ in range(nb)]
  cs = [draw(size) for _ in range(nc)]
  lfs = [draw(size) for _ in range(nlf)]
  rfs = [draw(size) for _ in range(nrf)]
  lroles = [('b', i) for i in range(nb)] + [('c', i) for i in range(nc)]
  lroles += [('f', i) for i in range(nlf)]
  rroles = [('b', i) for i in range(nb)] + [('c', i) for i in range(nc)]
  rroles += [('f', i) for i in range(nrf)]
  lroles = draw(st.permutations(lroles))
  rroles = draw(st.permutations(rroles))
  sizes = {'b': bs, 'c': cs}

  def shape(roles, free):
    return tuple(free[i] if r == 'f' else sizes[r][i] for r, i in roles)

  corder = draw(st.permutations(range(nc)))
  border = draw(st.permutations(range(nb)))
  lc = tuple(lroles.index(('c', i)) for i in corder)
  rc = tuple(rroles.index(('c', i)) for i in corder)
  lb = tuple(lroles.index(('b', i)) for i in border)
  rb = tuple(rroles.index(('b', i)) for i in border)
  seed = draw(st.integers(0, 2**16))
  return shape(lroles, lfs), shape(rroles, rfs), ((lc, rc), (lb, rb)), seed


def _out_shape(lhs_shape, rhs_shape, dn):
  return jax.eval_shape(
    lambda a, b: lax.dot_general(a, b, dn),
    jax.ShapeDtypeStruct(lhs_shape, jnp.float32),
    jax.ShapeDtypeStruct(rhs_shape, jnp.float32),
  ).shape


def _operands(problem):
  lshape, rshape, dn, seed = problem
  lhs, rhs, g = randn(seed, lshape, rshape, _out_shape(lshape, rshape, dn))
  return lhs, rhs, g, dn


# ------------------------------------------------------------ float == lax


@functools.partial(jax.jit, static_argnums=(0, 1))
def _vs_lax(cfg, dn, lhs, rhs, g):
  out, pull = jax.vjp(lambda a, b: aqtr.dot_general(a, b, dn, cfg), lhs, rhs)
  want, want_pull = jax.vjp(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs)
  return (out, *pull(g)), (want, *want_pull(g))


def _check_float_is_lax(problem, which):
  lhs, rhs, g, dn = _operands(problem)
  cfg = None if which == 'none' else presets.float()
  assert_bitwise(*_vs_lax(cfg, dn, lhs, rhs, g))
  # and eagerly, outside any jit
  out = aqtr.dot_general(lhs, rhs, dn, cfg)
  assert_bitwise([out], [lax.dot_general(lhs, rhs, dn)])


def _property(check, *strategies, n):
  """A hypothesis test running `check` on `n` examples."""
  settings = hypothesis.settings(
    deadline=None,
    max_examples=n,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
  )
  return settings(hypothesis.given(*strategies)(check))


_WHICH = st.sampled_from(['none', 'float'])
test_float_config_is_lax_bit_for_bit = _property(
  _check_float_is_lax, dot_problems(max_size=4), _WHICH, n=6
)
test_float_config_is_lax_bit_for_bit_many = pytest.mark.slow(
  _property(_check_float_is_lax, dot_problems(max_size=4), _WHICH, n=200)
)


@pytest.mark.parametrize('cfg', [None, presets.float()], ids=['none', 'float'])
def test_float_config_passes_precision_and_preferred_type(cfg):
  lhs, rhs = randn(0, (4, 8), (8, 3), dtype=jnp.bfloat16)
  kw = dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  got = aqtr.dot_general(lhs, rhs, MK_KN, cfg, **kw)
  want = lax.dot_general(lhs, rhs, MK_KN, **kw)
  assert_bitwise([got], [want])


# ----------------------------------------- po2 scales: real int == fake quant

TILINGS = {
  'channel': tilings.PerChannel(),
  'tensor': tilings.PerTensor(),
  'sub': tilings.SubChannel(tile_count=2),
}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _vs_fake_quant(cfg, dn, lhs, rhs, g):
  return vjp(cfg, dn, lhs, rhs, g), fq_vjp(cfg, dn, lhs, rhs, g)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _vs_hand(cfg, dn, ref_kw, lhs, rhs, g):
  return (
    vjp(cfg, dn, lhs, rhs, g),
    canonical_reference(lhs, rhs, g, dn, **dict(ref_kw)),
  )


def _check_fake_quant(problem, tiling):
  """Forward bit for bit; float bwd + use_fwd_quant == autodiff of the ref.

  The gradients agree to float rounding: the engine sums `(g * s) . q` in
  its canonical layout, autodiff sums `g . (q * s)` in lax's order, and a
  reduction in another order may differ in the last bit.
  """
  lhs, rhs, g, dn = _operands(problem)
  t = tensor(TILINGS[tiling])
  got, want = _vs_fake_quant(config(t, t), dn, lhs, rhs, g)
  assert_bitwise(got[:1], want[:1])
  for a, b in zip(got[1:], want[1:], strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype, (a, b)
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6
    )


def _check_hand(problem, reuse):
  lhs, rhs, g, dn = _operands(problem)
  cfg = config(tensor(), tensor(), grad=tensor(), reuse=reuse)
  assert_bitwise(*_vs_hand(cfg, dn, (('reuse', reuse),), lhs, rhs, g))


_PER = st.sampled_from(['channel', 'tensor'])
test_po2_int8_forward_and_float_grads_equal_fake_quant = _property(
  _check_fake_quant, dot_problems(), _PER, n=5
)
test_po2_int8_forward_and_float_grads_equal_fake_quant_many = pytest.mark.slow(
  _property(_check_fake_quant, dot_problems(), _PER, n=100)
)
test_po2_fully_int8_equals_hand_reference = _property(
  _check_hand, dot_problems(), st.booleans(), n=5
)
test_po2_fully_int8_equals_hand_reference_many = pytest.mark.slow(
  _property(_check_hand, dot_problems(), st.booleans(), n=100)
)


def _case(name, seed):
  lshape, rshape, dn = CASES[name]
  lhs, rhs, g = randn(seed, lshape, rshape, _out_shape(lshape, rshape, dn))
  return lhs, rhs, g, dn


@pytest.mark.parametrize(
  'case,tiling',
  [
    ('mk_nk', 'sub'),
    ('multi', 'sub'),
    ('batch_kf', 'tensor'),
  ],
)
def test_po2_int8_fwd_and_float_grads_per_tiling(case, tiling):
  lhs, rhs, g, dn = _case(case, 1)
  t = tensor(TILINGS[tiling])
  assert_bitwise(*_vs_fake_quant(config(t, t), dn, lhs, rhs, g))


@pytest.mark.parametrize(
  'case,tiling,reuse',
  [
    ('batch_fk', 'tensor', True),
    ('mk_nk', 'sub', True),
    ('multi', 'sub', True),
    ('k_first', 'channel', False),
  ],
)
def test_po2_int8_backward_equals_hand_reference(case, tiling, reuse):
  lhs, rhs, g, dn = _case(case, 3)
  til = TILINGS[tiling]
  cfg = config(tensor(til), tensor(til), grad=tensor(), reuse=reuse)
  ref_kw = (
    ('tiles', 2 if tiling == 'sub' else 1),
    ('lhs_tiling', tiling),
    ('rhs_tiling', tiling),
    ('reuse', reuse),
  )
  assert_bitwise(*_vs_hand(cfg, dn, ref_kw, lhs, rhs, g))


@pytest.mark.parametrize('case', ['mk_kn', 'mk_nk'])
def test_subchannel_lhs_with_per_channel_rhs(case):
  """The partner of a tiled operand is split with the same tiles."""
  lhs, rhs, g, dn = _case(case, 5)
  cfg = config(tensor(tilings.SubChannel(tile_size=4)), tensor(), tensor())
  got, want = _vs_hand(
    cfg, dn, (('tiles', 4), ('lhs_tiling', 'sub')), lhs, rhs, g
  )
  assert_bitwise(got, want)


def test_subchannel_tiles_must_agree():
  lhs, rhs = randn(0, (4, 16), (16, 3))
  cfg = config(
    tensor(tilings.SubChannel(tile_size=4)),
    tensor(tilings.SubChannel(tile_size=8)),
  )
  with pytest.raises(ValueError, match='tile'):
    aqtr.dot_general(lhs, rhs, MK_KN, cfg)


def test_subchannel_tile_must_divide_contraction():
  lhs, rhs = randn(0, (4, 12), (12, 3))
  t = tensor(tilings.SubChannel(tile_size=5))
  with pytest.raises(ValueError, match='tile_size'):
    aqtr.dot_general(lhs, rhs, MK_KN, config(t, t))


# ------------------------------------------------------- sub-channel tiling


def test_tiled_float_partials_equal_untiled_dot():
  """The tiled dot (partials rescaled and summed) == the untiled dot.

  lhs is sub-channel quantized, rhs stays float with dyadic values, so every
  partial sum is exact and tiling must not change a single bit.
  """
  lhs, rhs = randn(6, (6, 32), (32, 5))
  rhs = jnp.asarray(np.round(np.asarray(rhs) * 8) / 8)
  lcfg = tensor(tilings.SubChannel(tile_size=8))
  cfg = config(lcfg, float_tensor())

  @jax.jit
  def f(lhs, rhs):
    got = aqtr.dot_general(lhs, rhs, MK_KN, cfg)
    fl = aqtr.fake_quant(lhs, lcfg, contracting_axes=(1,))
    # the same dot with the tile products summed by hand:
    parts = [fl[:, i : i + 8] @ rhs[i : i + 8] for i in range(0, 32, 8)]
    return got, fl @ rhs, sum(parts[1:], parts[0])

  got, untiled, by_hand = f(lhs, rhs)
  np.testing.assert_array_equal(got, untiled)
  np.testing.assert_array_equal(got, by_hand)


def test_subchannel_fake_quant_is_per_channel_per_tile():
  (x,) = randn(7, (6, 32))
  sub = tensor(tilings.SubChannel(tile_count=4), po2=False)
  per = tensor(tilings.PerChannel(), po2=False)

  @jax.jit
  def f(x):
    tiles = [aqtr.fake_quant(x[:, i : i + 8], per) for i in range(0, 32, 8)]
    return aqtr.fake_quant(x, sub), jnp.concatenate(tiles, axis=1)

  np.testing.assert_array_equal(*f(x))


def test_subchannel_one_tile_is_per_channel():
  lhs, rhs, g = randn(8, (4, 16), (16, 3), (4, 3))
  one = tensor(tilings.SubChannel(tile_size=16), po2=False)
  per = tensor(tilings.PerChannel(), po2=False)
  assert_bitwise(
    vjp(config(one, one, per), MK_KN, lhs, rhs, g),
    vjp(config(per, per, per), MK_KN, lhs, rhs, g),
  )


def test_subchannel_real_dot_close_to_fake_quant_without_po2():
  lhs, rhs, g = randn(9, (8, 64), (64, 8), (8, 8))
  t = tensor(tilings.SubChannel(tile_size=16), po2=False)
  cfg = config(t, t)
  got, want = _vs_fake_quant(cfg, MK_KN, lhs, rhs, g)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize(
  'name,case',
  [
    ('int8_fwd', 'mk_kn'),
    ('int8_fwd', 'mk_nk'),
    ('int8_weight_only', 'mk_nk'),
    ('int4_weight_only', 'batch_kf'),
  ],
)
def test_float_backward_presets_equal_fake_quant_autodiff(name, case):
  """Unquantized backward passes == autodiff of the fake-quant reference."""
  lhs, rhs, g, dn = _case(case, 10)
  cfg = with_po2(getattr(presets, name)())
  assert_bitwise(*_vs_fake_quant(cfg, dn, lhs, rhs, g))


@functools.partial(jax.jit, static_argnums=(0,))
def _fwd_vs_fake_quant(cfg, lhs, rhs):
  return aqtr.dot_general(lhs, rhs, MK_KN, cfg), fq_dot(lhs, rhs, MK_KN, cfg)


@pytest.mark.parametrize('name', ['int8', 'fp8', 'int4_weight_only'])
def test_presets_forward_close_to_fake_quant(name):
  lhs, rhs = randn(11, (8, 64), (64, 16))
  got, want = _fwd_vs_fake_quant(getattr(presets, name)(), lhs, rhs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  'name,tol',
  [('int8', 0.02), ('fp8', 0.1), ('int8_fwd', 0.02), ('int4_weight_only', 0.2)],
)
def test_quantized_gradients_close_to_float(name, tol):
  lhs, rhs, g = randn(12, (16, 64), (64, 16), (16, 16))
  got = vjp(getattr(presets, name)(), MK_KN, lhs, rhs, g)
  want = vjp(presets.float(), MK_KN, lhs, rhs, g)
  for a, b in zip(got, want, strict=True):
    err = np.linalg.norm(np.asarray(a - b)) / np.linalg.norm(np.asarray(b))
    assert err < tol, err


def test_clip_gradient_mask_matches_fake_quant_autodiff():
  t = tensor(
    num=numerics.IntSymmetric(bits=8, clip_gradient=True),
    calibration=calibrations.AbsMax(clip_scale=0.5, po2_scale=True),
  )
  lhs, rhs, g = randn(13, (6, 16), (16, 4), (6, 4))
  got, want = _vs_fake_quant(config(t, t), MK_KN, lhs, rhs, g)
  assert_bitwise(got, want)
  assert (got[1] == 0).any() and (got[2] == 0).any()  # the mask did act


# ------------------------------------------------------------------ jaxpr


@pytest.mark.parametrize('case', ['mk_kn', 'mk_nk', 'batch_kf', 'multi'])
def test_int8_jaxpr_has_three_int8_dots(case):
  lshape, rshape, dn = CASES[case]
  lhs, rhs = randn(0, lshape, rshape)
  (g,) = randn(1, _out_shape(lshape, rshape, dn))
  eqns = live_eqns(vjp_fn(presets.int8(), dn), lhs, rhs, g)
  assert dots(eqns) == [(('int8', 'int8'), 'int32')] * 3


def test_fp8_jaxpr_has_fp8_dots_with_f32_accumulation():
  lhs, rhs, g = randn(0, (4, 16), (16, 8), (4, 8))
  eqns = live_eqns(vjp_fn(presets.fp8(), MK_KN), lhs, rhs, g)
  e4, e5 = 'float8_e4m3fn', 'float8_e5m2'
  assert collections.Counter(dots(eqns)) == collections.Counter(
    [((e4, e4), 'float32'), ((e5, e4), 'float32'), ((e4, e5), 'float32')]
  )


def test_int8_fwd_jaxpr_has_one_int8_dot_and_float_backward():
  lhs, rhs, g = randn(0, (4, 16), (16, 8), (4, 8))
  eqns = live_eqns(vjp_fn(presets.int8_fwd(), MK_KN), lhs, rhs, g)
  found = dots(eqns)
  assert found.count((('int8', 'int8'), 'int32')) == 1
  rest = [d for d in found if d != (('int8', 'int8'), 'int32')]
  assert len(rest) == 2
  assert all(d[0] == ('float32', 'float32') for d in rest)


def test_weight_only_jaxpr_has_only_float_dots():
  lhs, rhs, g = randn(0, (4, 16), (16, 8), (4, 8))
  eqns = live_eqns(vjp_fn(presets.int8_weight_only(), MK_KN), lhs, rhs, g)
  found = dots(eqns)
  assert len(found) == 3
  assert all(d[0] == ('float32', 'float32') for d in found)


def test_int8_fwd_jaxpr_has_no_dead_dots():
  lhs, rhs, g = randn(0, (4, 16), (16, 8), (4, 8))
  closed = jax.make_jaxpr(vjp_fn(presets.int8_fwd(), MK_KN))(lhs, rhs, g)
  assert len(dots(all_eqns(closed.jaxpr))) == 3


# ---------------------------------------------------- stochastic rounding


def _sr_config(reuse=True):
  sr = tensor(po2=False, rounding=aqtr.Stochastic())
  t = tensor(po2=False)
  return config(t, t, grad=sr, reuse=reuse)


def test_stochastic_rounding_reuses_forward_quantization():
  """Only g is rounded in the backward dots: 2 + 1 + 1 roundings, 2 draws."""
  lhs, rhs, g = randn(0, (4, 16), (16, 8), (4, 8))
  key = jax.random.key(0)

  def count(cfg):
    eqns = live_eqns(vjp_fn(cfg, MK_KN, key), lhs, rhs, g)
    c = collections.Counter(e.primitive.name for e in eqns)
    return c['round'], c['random_bits']

  assert count(_sr_config(reuse=True)) == (4, 2)
  assert count(presets.fully_quantized(8, 8, True)) == (4, 2)
  # Quantizing the float residuals again costs two more roundings.
  assert count(_sr_config(reuse=False)) == (6, 2)


def test_stochastic_rounding_needs_a_key():
  lhs, rhs = randn(0, (4, 16), (16, 8))
  cfg = presets.fully_quantized(8, 8, stochastic_rounding=True)
  with pytest.raises(ValueError, match='key'):
    aqtr.dot_general(lhs, rhs, MK_KN, cfg)
  with pytest.raises(TypeError, match='key'):
    aqtr.dot_general(lhs, rhs, MK_KN, cfg, key=jnp.zeros(3))


def test_stochastic_rounding_key_handling():
  lhs, rhs, g = randn(14, (8, 16), (16, 8), (8, 8))
  cfg = presets.fully_quantized(8, 8, stochastic_rounding=True)
  a = vjp(cfg, MK_KN, lhs, rhs, g, key=jax.random.key(1))
  b = vjp(cfg, MK_KN, lhs, rhs, g, key=jax.random.key(1))
  raw = vjp(cfg, MK_KN, lhs, rhs, g, key=jax.random.PRNGKey(1))
  c = vjp(cfg, MK_KN, lhs, rhs, g, key=jax.random.key(2))
  assert_bitwise(a, b)  # deterministic for a key
  assert_bitwise(a, raw)  # a raw PRNGKey is the same key
  np.testing.assert_array_equal(a[0], c[0])  # the forward pass has no SR
  assert not np.array_equal(a[1], c[1])
  assert not np.array_equal(a[2], c[2])


def test_stochastic_rounding_on_a_forward_operand():
  lhs, rhs = randn(27, (8, 16), (16, 8))
  sr = tensor(po2=False, rounding=aqtr.Stochastic())
  cfg = config(sr, tensor(po2=False))

  @jax.jit
  def f(key):
    return aqtr.dot_general(lhs, rhs, MK_KN, cfg, key=key)

  a, b, c = f(jax.random.key(0)), f(jax.random.key(0)), f(jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  nearest = aqtr.dot_general(
    lhs, rhs, MK_KN, config(tensor(po2=False), tensor(po2=False))
  )
  np.testing.assert_allclose(a, nearest, atol=0.2)


def test_stochastic_rounding_gradients_are_unbiased():
  """E_key[grad] == the gradient with g unquantized (forward QTensor reused).

  Without rounding noise, g . dequant(R) is exactly what stochastic rounding
  of g * s_R averages to, so the mean over keys must approach it within a
  few standard errors.
  """
  lhs, rhs, g = randn(15, (8, 32), (32, 8), (8, 8))
  cfg = _sr_config()
  fwd_only = config(cfg.fwd.lhs, cfg.fwd.rhs)
  want = vjp(fwd_only, MK_KN, lhs, rhs, g)
  n = 512
  keys = jax.random.split(jax.random.key(3), n)
  grads = jax.jit(jax.vmap(lambda k: vjp(cfg, MK_KN, lhs, rhs, g, key=k)[1:]))(
    keys
  )
  for got, ref in zip(grads, want[1:], strict=True):
    got = np.asarray(got, np.float64)
    mean, std = got.mean(0), got.std(0)
    tol = 6 * std / math.sqrt(n) + 1e-6
    assert (np.abs(mean - np.asarray(ref)) <= tol).all()
    assert (std > 0).mean() > 0.5  # the rounding really is random


# -------------------------------------------------------- transformations


def test_jit_grad_vmap_agree():
  lhs, rhs = randn(16, (3, 4, 16), (3, 16, 5))
  cfg = presets.int8()

  dn = (((2,), (1,)), ((0,), (0,)))

  def loss(a, b, dn=MK_KN):
    y = aqtr.dot_general(a, b, dn, cfg)
    return jnp.sum(jnp.sin(y)), y

  @jax.jit
  def f(lhs, rhs):
    vmapped = jax.vmap(jax.grad(loss, (0, 1), has_aux=True))(lhs, rhs)
    batched = jax.grad(loss, (0, 1), has_aux=True)(lhs, rhs, dn)
    return vmapped, batched

  # vmap == explicit batch axes (per-channel scales vary along batch)
  (vgrads, vout), (bgrads, bout) = f(lhs, rhs)
  assert_bitwise((vout, *vgrads), (bout, *bgrads))
  # and one example alone gives the same as its slice of the batch
  (g1, out1) = jax.grad(loss, (0, 1), has_aux=True)(lhs[1], rhs[1])
  assert_bitwise((out1, *g1), (vout[1], vgrads[0][1], vgrads[1][1]))


def test_vmap_over_keys_and_in_axes():
  lhs, rhs = randn(17, (4, 16), (5, 16))
  cfg = presets.fully_quantized(8, 8, stochastic_rounding=True)
  keys = jax.random.split(jax.random.key(0), 3)

  def f(k, b):
    return jax.grad(lambda a: aqtr.dot_general(a, b, MK_NK, cfg, key=k).sum())(
      lhs
    )

  g = jax.jit(jax.vmap(f, in_axes=(0, None)))
  out = g(keys, rhs)
  assert out.shape == (3, 4, 16)
  np.testing.assert_array_equal(out[::-1], g(keys[::-1], rhs))  # per key
  assert not np.array_equal(out[0], out[1])


def test_scan_and_remat():
  (x,) = randn(18, (4, 8))
  (ws,) = randn(19, (3, 8, 8))
  cfg = presets.int8()

  def body(c, w):
    return jnp.tanh(aqtr.dot_general(c, w, MK_KN, cfg)), None

  def scanned(ws, step):
    return lax.scan(step, x, ws)[0].sum()

  def unrolled(ws):
    c = x
    for i in range(3):
      c = body(c, ws[i])[0]
    return c.sum()

  @jax.jit
  def grads(ws):
    return (
      jax.grad(scanned)(ws, body),
      jax.grad(scanned)(ws, jax.checkpoint(body)),
      jax.grad(unrolled)(ws),
    )

  scan, remat, want = grads(ws)
  assert np.isfinite(np.asarray(want)).all() and (np.asarray(want) != 0).any()
  np.testing.assert_allclose(scan, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(remat, want, rtol=1e-6, atol=1e-6)


def test_second_call_does_not_retrace():
  lhs, rhs = randn(20, (7, 24), (24, 9))

  def sizes():
    return [f._cache_size() for f in dg_lib.JITTED]  # primal, fwd, bwd

  def grad(a, dn=MK_KN):
    return jax.grad(
      lambda a: aqtr.dot_general(a, rhs, dn, presets.int8()).sum()
    )(a)

  before = sizes()
  aqtr.dot_general(lhs, rhs, MK_KN, presets.int8())
  grad(lhs)
  first = sizes()
  # Equal (not identical) config, other values, list/negative-axis spelling.
  aqtr.dot_general(lhs + 1, rhs, MK_KN, presets.int8())
  aqtr.dot_general(lhs, rhs, (([-1], [0]), ([], [])), presets.int8())
  grad(lhs * 2, (([-1], [0]), ([], [])))
  assert first == [n + 1 for n in before]
  assert sizes() == first


def test_outer_jit_traces_once():
  traces = []

  @jax.jit
  def f(a, b):
    traces.append(1)
    return aqtr.dot_general(a, b, MK_KN, presets.int8())

  lhs, rhs = randn(21, (3, 8), (8, 2))
  f(lhs, rhs)
  f(lhs * 2, rhs)
  assert len(traces) == 1


# --------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
  'name,dtype',
  [
    ('int8', jnp.bfloat16),
    ('int8', jnp.float16),
    ('fp8', jnp.bfloat16),
    ('int8_weight_only', jnp.float16),
  ],
)
def test_low_precision_operands_keep_their_dtype(name, dtype):
  lhs, rhs, g = randn(22, (4, 16), (16, 8), (4, 8), dtype=dtype)
  out, dl, dr = vjp(getattr(presets, name)(), MK_KN, lhs, rhs, g)
  assert (out.dtype, dl.dtype, dr.dtype) == (dtype, dtype, dtype)
  ref = np.asarray(lhs, np.float32) @ np.asarray(rhs, np.float32)
  err = np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref)
  assert err < 0.05


def test_preferred_element_type_and_mixed_dtypes():
  lhs, rhs = randn(23, (4, 16), (16, 8), dtype=jnp.bfloat16)
  out = aqtr.dot_general(
    lhs, rhs, MK_KN, presets.int8(), preferred_element_type=jnp.float32
  )
  assert out.dtype == jnp.float32
  mixed = aqtr.dot_general(lhs.astype(jnp.float32), rhs, MK_KN, presets.int8())
  assert mixed.dtype == jnp.result_type(jnp.float32, jnp.bfloat16)


# ------------------------------------------------------------ bad input


@pytest.mark.parametrize(
  'dn,match',
  [
    ((((1,), (1,)), ((), ())), 'contracting dimensions do not match'),
    ((((2,), (0,)), ((), ())), 'lhs_contracting_dimensions'),
    ((((1,), (0, 1)), ((), ())), 'same length'),
    ((((1,), (0,)), ((0,), (1,))), 'batch dimensions do not match'),
    ((((1,), (0,)), ((0,), ())), 'same length'),
    ((((1, 1), (0, 0)), ((), ())), 'repeats'),
    ((((1,), (0,)), ((1,), (0,))), 'both'),
    (((1,), (0,)), 'dimension_numbers'),
  ],
)
def test_bad_dimension_numbers_name_the_field(dn, match):
  lhs, rhs = randn(0, (3, 4), (4, 2))
  with pytest.raises(ValueError, match=match):
    aqtr.dot_general(lhs, rhs, dn, presets.int8())


def test_non_float_operands_are_rejected():
  lhs = jnp.ones((3, 4), jnp.int32)
  rhs = jnp.ones((4, 2))
  with pytest.raises(TypeError, match='lhs.*floating.*allowed'):
    aqtr.dot_general(lhs, rhs, MK_KN, presets.int8())
  with pytest.raises(TypeError, match='rhs.*floating'):
    aqtr.dot_general(rhs.T, lhs.T, MK_KN, presets.int8())


def test_config_must_be_a_dot_general_config():
  lhs, rhs = randn(0, (3, 4), (4, 2))
  with pytest.raises(TypeError, match='DotGeneralConfig'):
    aqtr.dot_general(lhs, rhs, MK_KN, 'int8')
  with pytest.raises(TypeError, match='DotGeneralConfig'):
    aqtr.dot_general(lhs, rhs, MK_KN, aqtr.TensorConfig())


# --------------------------------------------------- zeros, NaN and inf


@pytest.mark.parametrize('name', ['int8', 'fp8', 'int8_weight_only'])
def test_all_zero_operands_give_zero_without_nan(name):
  z = jnp.zeros((3, 8))
  (w,) = randn(0, (8, 4))
  cfg = getattr(presets, name)()

  @jax.jit
  def f(z, w):
    return (
      vjp(cfg, MK_KN, z, w, jnp.ones((3, 4))),
      vjp(cfg, MK_KN, w.T, z.T, jnp.ones((4, 3))),
    )

  (out, dl, dr), (out_t, dl_t, dr_t) = f(z, w)
  np.testing.assert_array_equal(out, 0)
  np.testing.assert_array_equal(dr, 0)
  assert np.isfinite(np.asarray(dl)).all()
  np.testing.assert_array_equal(out_t, 0)
  np.testing.assert_array_equal(dl_t, 0)
  assert np.isfinite(np.asarray(dr_t)).all()


@pytest.mark.parametrize('name', ['int8', 'fp8'])
@pytest.mark.parametrize(
  'calibration',
  [calibrations.AbsMax(), calibrations.Constant(bound=2.0)],
  ids=['absmax', 'constant'],
)
@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_propagate(name, calibration, bad):
  cfg = with_calibration(getattr(presets, name)(), calibration)
  x = np.random.default_rng(24).standard_normal((4, 8)).astype(np.float32)
  w = np.random.default_rng(25).standard_normal((8, 3)).astype(np.float32)
  x[1, 2] = bad
  finite = np.isfinite(np.asarray(aqtr.dot_general(x, w, MK_KN, cfg)))
  assert not finite[1].any()  # the bad row is not clipped to finite values
  assert np.delete(finite, 1, axis=0).all()  # and the other rows are fine
  finite = np.isfinite(np.asarray(aqtr.dot_general(w.T, x.T, MK_KN, cfg)))
  assert not finite[:, 1].any()
  assert np.delete(finite, 1, axis=1).all()


# --------------------------------------- a calibration defined by a user


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rms(calibrations.Calibration):
  """bound = multiplier * sqrt(mean_G x^2) (a "k-sigma" bound)."""

  multiplier: float = 3.0

  def calibrate(self, x, axes):
    ms = jnp.mean(jnp.square(x), axis=tuple(axes), keepdims=True)
    return self.multiplier * jnp.sqrt(ms)


@pytest.fixture
def rms_registered(monkeypatch):
  """Registers `Rms` for one test only (other tests see the usual names)."""
  registry = calibrations.registry
  monkeypatch.setattr(registry, '_classes', dict(registry._classes))
  calibrations.register('rms_test')(Rms)
  return Rms


def test_user_registered_calibration_works_through_a_config(rms_registered):
  assert 'rms_test' in calibrations.names()
  cls = calibrations.get('rms_test')
  assert cls is rms_registered
  t = aqtr.TensorConfig(
    numerics=numerics.IntSymmetric(bits=8, clip_gradient=True),
    calibration=cls(multiplier=2.0),
    tiling=tilings.PerChannel(),
    rounding=aqtr.NearestEven(),
  )
  cfg = config(t, t)
  lhs, rhs, g = randn(26, (6, 32), (32, 4), (6, 4))
  got, want = _vs_fake_quant(cfg, MK_KN, lhs, rhs, g)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(a)).all()
  # The bound clips: some gradients are masked.
  assert (np.asarray(got[1]) == 0).any()


def test_user_calibration_is_gone_after_the_test():
  # Self-contained (no reliance on test order): run the fixture's patch
  # and its undo here.
  with pytest.MonkeyPatch.context() as mp:
    rms_registered.__wrapped__(mp)
    assert calibrations.get('rms_test') is Rms
  assert 'rms_test' not in calibrations.names()


# ------------------------------------------ stored QTensor operands (serve)


@pytest.mark.parametrize('case', ['mk_kn', 'mk_nk', 'multi'])
def test_quantize_operand_serves_bit_identical_outputs(case):
  """Train == serve: a frozen QTensor operand gives the same output."""
  lhs, rhs, g, dn = _case(case, 30)
  cfg = presets.int8()

  @jax.jit
  def f(lhs, rhs):
    qr = aqtr.quantize_operand(rhs, dn, cfg, operand='rhs')
    ql = aqtr.quantize_operand(lhs, dn, cfg, operand='lhs')
    return (
      aqtr.dot_general(lhs, rhs, dn, cfg),
      aqtr.dot_general(lhs, qr, dn, cfg),
      aqtr.dot_general(ql, rhs, dn, cfg),
      jax.grad(lambda a: aqtr.dot_general(a, rhs, dn, cfg).sum())(lhs),
      jax.grad(lambda a: aqtr.dot_general(a, qr, dn, cfg).sum())(lhs),
    )

  out, served_r, served_l, grad, served_grad = f(lhs, rhs)
  np.testing.assert_array_equal(served_r, out)
  np.testing.assert_array_equal(served_l, out)
  np.testing.assert_array_equal(served_grad, grad)


def test_qtensor_operand_errors():
  lhs, rhs, _, dn = _case('mk_kn', 31)
  qr = aqtr.quantize_operand(rhs, dn, presets.int8())
  with pytest.raises(ValueError, match='config'):
    aqtr.dot_general(lhs, qr, dn)
  with pytest.raises(ValueError, match='quantize_operand'):
    aqtr.dot_general(lhs, qr, dn, presets.fp8())
  with pytest.raises(ValueError, match='not quantized'):
    aqtr.quantize_operand(lhs, dn, presets.int8_weight_only(), operand='lhs')


@pytest.mark.parametrize(
  'shapes', [((0, 8), (8, 3)), ((4, 0), (0, 3)), ((4, 8), (8, 0))]
)
def test_zero_size_dimensions_like_lax(shapes):
  lhs, rhs = jnp.ones(shapes[0]), jnp.ones(shapes[1])
  g = jnp.ones((shapes[0][0], shapes[1][1]))
  want = vjp(presets.float(), MK_KN, lhs, rhs, g)
  got = vjp(presets.int8(), MK_KN, lhs, rhs, g)
  assert_bitwise(got, want)
