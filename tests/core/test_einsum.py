"""Tests for aqtr.einsum: two-operand einsum through the quantized dot."""

from __future__ import annotations

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax import lax

import aqtr
from aqtr import calibrations, numerics, presets, tilings
from aqtr.core import einsum as einsum_lib
from aqtr.core.lowering import is_dot, sub_jaxprs


def tensor(quantized=True) -> aqtr.TensorConfig:
  return aqtr.TensorConfig(
    numerics=numerics.IntSymmetric(bits=8)
    if quantized
    else numerics.NoNumerics(),
    calibration=calibrations.AbsMax(po2_scale=True),
    tiling=tilings.PerChannel(),
    rounding=aqtr.NearestEven(),
  )


def config(lhs=True, rhs=True) -> aqtr.DotGeneralConfig:
  """po2 int8 forward on the chosen operands; float gradients (STE)."""
  fwd = aqtr.DotGeneralRaw(lhs=tensor(lhs), rhs=tensor(rhs))
  bwd = aqtr.DotGeneralRaw(
    lhs=tensor(False), rhs=tensor(False), use_fwd_quant=True
  )
  return aqtr.DotGeneralConfig(fwd=fwd, dlhs=bwd, drhs=bwd)


def randn(seed, *shapes):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def assert_bitwise(got, want):
  for a, b in zip(got, want, strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def fq_operands(subscripts, lhs, rhs, cfg):
  """Fake-quantizes both operands as the einsum's dot would see them."""
  ls, rs, os = einsum_lib.parse(subscripts, lhs.ndim, rhs.ndim)
  (lc, rc), (lb, rb) = einsum_lib.dimension_numbers(
    subscripts, lhs.ndim, rhs.ndim
  )
  del ls, rs, os
  fl = aqtr.fake_quant(lhs, cfg.fwd.lhs, contracting_axes=lc, batch_axes=lb)
  fr = aqtr.fake_quant(rhs, cfg.fwd.rhs, contracting_axes=rc, batch_axes=rb)
  return fl, fr


@st.composite
def einsum_problems(draw, summed=True):
  """Random subscripts: batch, contracted, free and (optionally) summed."""
  pool = iter(draw(st.permutations(list('abcdefghijkl'))))
  counts = dict(b=(0, 2), c=(0, 2), l=(0, 2), r=(0, 2), sl=(0, int(summed)))
  roles = {
    role: [next(pool) for _ in range(draw(st.integers(lo, hi)))]
    for role, (lo, hi) in counts.items()
  }
  size = {c: draw(st.integers(1, 3)) for r in roles.values() for c in r}
  lhs = draw(
    st.permutations(roles['b'] + roles['c'] + roles['l'] + roles['sl'])
  )
  rhs = draw(st.permutations(roles['b'] + roles['c'] + roles['r']))
  out = draw(st.permutations(roles['b'] + roles['l'] + roles['r']))
  swap = draw(st.booleans())
  if swap:
    lhs, rhs = rhs, lhs
  subscripts = f'{"".join(lhs)},{"".join(rhs)}->{"".join(out)}'
  shapes = (tuple(size[c] for c in lhs), tuple(size[c] for c in rhs))
  return subscripts, shapes, draw(st.integers(0, 2**16))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _vs_jnp(subscripts, cfg, lhs, rhs, g):
  def ours(a, b):
    return aqtr.einsum(subscripts, a, b, config=cfg)

  out, pull = jax.vjp(ours, lhs, rhs)
  want, want_pull = jax.vjp(lambda a, b: jnp.einsum(subscripts, a, b), lhs, rhs)
  return (out, *pull(g)), (want, *want_pull(g))


def _problem_arrays(problem):
  subscripts, (ls, rs), seed = problem
  out_shape = jax.eval_shape(
    lambda a, b: jnp.einsum(subscripts, a, b),
    jax.ShapeDtypeStruct(ls, jnp.float32),
    jax.ShapeDtypeStruct(rs, jnp.float32),
  ).shape
  return randn(seed, ls, rs, out_shape)


@hypothesis.settings(
  deadline=None,
  max_examples=5,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
@hypothesis.given(einsum_problems(), st.sampled_from(['none', 'float']))
def test_float_config_is_jnp_einsum_bit_for_bit(problem, which):
  lhs, rhs, g = _problem_arrays(problem)
  cfg = None if which == 'none' else presets.float()
  assert_bitwise(*_vs_jnp(problem[0], cfg, lhs, rhs, g))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _vs_fake_quant(subscripts, cfg, lhs, rhs, g):
  out, pull = jax.vjp(
    lambda a, b: aqtr.einsum(subscripts, a, b, config=cfg), lhs, rhs
  )

  def ref(a, b):
    return jnp.einsum(subscripts, *fq_operands(subscripts, a, b, cfg))

  want, want_pull = jax.vjp(ref, lhs, rhs)
  return (out, *pull(g)), (want, *want_pull(g))


@hypothesis.settings(
  deadline=None,
  max_examples=4,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
@hypothesis.given(einsum_problems(summed=False))
def test_po2_int8_einsum_equals_fake_quant_einsum(problem):
  """Forward bit for bit (exact sums); gradients to float rounding."""
  lhs, rhs, g = _problem_arrays(problem)
  got, want = _vs_fake_quant(problem[0], config(), lhs, rhs, g)
  np.testing.assert_array_equal(got[0], want[0])
  for a, b in zip(got[1:], want[1:], strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  'subscripts,shapes',
  [
    ('bnd,bmd->bnm', ((2, 3, 8), (2, 4, 8))),
    ('...k,kn->...n', ((2, 3, 8), (8, 4))),
    ('abk,kc->bca', ((2, 3, 8), (8, 4))),
    ('ij,jk', ((3, 8), (8, 4))),
    ('k...,kn->n...', ((8, 2, 3), (8, 4))),
    ('bA,cb', ((8, 3), (4, 8))),
  ],
)
def test_po2_int8_forward_equals_fake_quant(subscripts, shapes):
  lhs, rhs = randn(1, *shapes)
  out = jax.eval_shape(lambda a, b: jnp.einsum(subscripts, a, b), lhs, rhs)
  (g,) = randn(2, out.shape)
  got, want = _vs_fake_quant(subscripts, config(), lhs, rhs, g)
  np.testing.assert_array_equal(got[0], want[0])
  for a, b in zip(got[1:], want[1:], strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_config_lhs_means_the_first_operand():
  """Quantizing only config.fwd.lhs quantizes the operand written first."""
  w, x = randn(3, (8, 4), (3, 8))
  only_lhs = config(lhs=True, rhs=False)
  t = only_lhs.fwd.lhs

  @jax.jit
  def f(w, x):
    got = aqtr.einsum('kn,mk->mn', w, x, config=only_lhs)
    fw = aqtr.fake_quant(w, t, contracting_axes=(0,))
    fx = aqtr.fake_quant(x, t, contracting_axes=(1,))
    return got, jnp.einsum('kn,mk->mn', fw, x), jnp.einsum('kn,mk->mn', w, fx)

  got, want, wrong = f(w, x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # and it really differs from quantizing the second operand
  assert not np.allclose(got, wrong, atol=1e-7)


def test_summed_letters_are_summed_before_the_dot():
  x, w = randn(4, (2, 3, 8), (8, 4))
  cfg = config()
  got = aqtr.einsum('zmk,kn->mn', x, w, config=cfg)
  want = aqtr.einsum('mk,kn->mn', x.sum(0), w, config=cfg)
  np.testing.assert_array_equal(got, want)


def test_einsum_equals_dot_general_with_its_dimension_numbers():
  x, w = randn(5, (2, 3, 8), (4, 8))
  dn = einsum_lib.dimension_numbers('btd,fd->btf', 3, 2)
  assert dn == (((2,), (1,)), ((), ()))
  cfg = presets.int8()
  got = aqtr.einsum('btd,fd->btf', x, w, config=cfg)
  np.testing.assert_array_equal(got, aqtr.dot_general(x, w, dn, cfg))


def test_dimension_numbers_rejects_summed_axes():
  with pytest.raises(ValueError, match='sums an axis'):
    einsum_lib.dimension_numbers('zmk,kn->mn', 3, 2)


def test_int8_einsum_runs_int8_dots():
  x, w = randn(6, (2, 3, 8), (8, 4))

  def f(x, w):
    return jax.grad(
      lambda a, b: aqtr.einsum(
        'btd,df->btf', a, b, config=presets.int8()
      ).sum(),
      (0, 1),
    )(x, w)

  def int32_dots(jaxpr):  # As lowered for CPU (`lowering.sub_jaxprs`).
    n = 0
    for e in jaxpr.eqns:
      pref = e.params.get('preferred_element_type', jnp.int32)  # Native: int32.
      n += is_dot(e) and pref == jnp.int32
      n += sum(int32_dots(sub) for sub in sub_jaxprs(e))
    return n

  assert int32_dots(jax.make_jaxpr(f)(x, w).jaxpr) == 3


def test_stochastic_rounding_needs_key():
  x, w = randn(7, (3, 8), (8, 4))
  cfg = presets.fully_quantized(8, 8, stochastic_rounding=True)
  with pytest.raises(ValueError, match='key'):
    aqtr.einsum('mk,kn->mn', x, w, config=cfg)
  out = aqtr.einsum('mk,kn->mn', x, w, config=cfg, key=jax.random.key(0))
  assert out.shape == (3, 4)


def test_quantized_output_close_to_float():
  x, w = randn(8, (4, 6, 32), (32, 8))
  got = aqtr.einsum('btd,df->btf', x, w, config=presets.int8())
  want = jnp.einsum('btd,df->btf', x, w)
  err = np.linalg.norm(np.asarray(got - want)) / np.linalg.norm(
    np.asarray(want)
  )
  assert err < 0.02


@pytest.mark.parametrize(
  'subscripts,shapes,match',
  [
    ('ij,jk,kl->il', ((2, 3), (3, 4)), 'exactly two operands'),
    ('ii,ij->j', ((3, 3), (3, 4)), 'repeats a letter'),
    ('ijk,jk->i', ((2, 3), (3, 4)), 'rank'),
    ('ij,jk->iz', ((2, 3), (3, 4)), 'output'),
    ('ij,jk->iik', ((2, 3), (3, 4)), 'output'),
    ('i1,1k->ik', ((2, 3), (3, 4)), 'letters'),
  ],
)
def test_bad_subscripts(subscripts, shapes, match):
  lhs, rhs = jnp.ones(shapes[0]), jnp.ones(shapes[1])
  with pytest.raises(ValueError, match=match):
    aqtr.einsum(subscripts, lhs, rhs, config=presets.int8())


def test_float_config_passes_precision_and_preferred_type():
  x, w = (a.astype(jnp.bfloat16) for a in randn(9, (3, 8), (8, 4)))
  kw = dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  got = aqtr.einsum('mk,kn->mn', x, w, config=presets.float(), **kw)
  assert_bitwise([got], [jnp.einsum('mk,kn->mn', x, w, **kw)])


def _broadcast_operands(subscripts, lhs, rhs):
  """Both operands with every size-1 shared letter broadcast explicitly."""
  ls, rs, _ = einsum_lib.parse(subscripts, lhs.ndim, rhs.ndim)
  size = {}
  for s, x in ((ls, lhs), (rs, rhs)):
    for c, n in zip(s, x.shape, strict=True):
      size[c] = max(size.get(c, 1), n)
  return tuple(
    jnp.broadcast_to(x, tuple(size[c] for c in s))
    for s, x in ((ls, lhs), (rs, rhs))
  )


@pytest.mark.parametrize(
  'subscripts,shapes',
  [
    ('bthd,bshd->bhts', ((2, 8, 4, 16), (2, 8, 1, 16))),  # MQA scores
    ('bhts,bshd->bthd', ((2, 4, 8, 8), (2, 8, 1, 16))),  # MQA values
    ('bthd,bshd->bhts', ((2, 8, 1, 16), (2, 8, 4, 16))),  # lhs broadcasts
    ('gbij,gbjk->gbik', ((1, 3, 4, 5), (2, 1, 5, 6))),  # both, two axes
    ('btkgd,bskd->bkgts', ((2, 8, 1, 4, 16), (2, 8, 1, 16))),  # equal 1s
  ],
)
def test_size_one_batch_axes_broadcast_as_in_jnp_einsum(subscripts, shapes):
  """Multi-query attention: a size-1 head axis broadcasts (it is squeezed,
  not materialized); the forward equals the explicitly broadcast einsum
  bit for bit and the gradients flow to the size-1 operand."""
  lhs, rhs = randn(0, *shapes)
  want = jnp.einsum(subscripts, lhs, rhs)
  assert_bitwise([aqtr.einsum(subscripts, lhs, rhs)], [want])
  cfg = presets.int8()
  got = aqtr.einsum(subscripts, lhs, rhs, config=cfg)
  full = aqtr.einsum(
    subscripts, *_broadcast_operands(subscripts, lhs, rhs), config=cfg
  )
  assert_bitwise([got], [full])
  assert float(jnp.abs(got - want).max()) < 0.05 * float(jnp.abs(want).max())

  def loss(fn):
    return jax.grad(
      lambda a, b: jnp.sum(fn(subscripts, a, b) ** 2), argnums=(0, 1)
    )(lhs, rhs)

  grads = loss(functools.partial(aqtr.einsum, config=cfg))
  for g, g0, x in zip(grads, loss(jnp.einsum), (lhs, rhs), strict=True):
    assert g.shape == x.shape
    assert float(jnp.abs(g - g0).max()) < 0.1 * float(jnp.abs(g0).max())


def test_broadcasting_dot_general_is_lax_on_broadcast_operands():
  lhs, rhs = randn(1, (2, 8, 4, 16), (2, 1, 16, 8))
  dn = (((3,), (2,)), ((0, 1), (0, 1)))
  want = lax.dot_general(lhs, jnp.broadcast_to(rhs, (2, 8, 16, 8)), dn)
  assert_bitwise([aqtr.dot_general(lhs, rhs, dn)], [want])
  out = aqtr.dot_general(lhs, rhs, dn, presets.int8())
  assert out.shape == want.shape == (2, 8, 4, 8)
  with pytest.raises(ValueError, match='batch dimensions do not match'):
    aqtr.dot_general(lhs, rhs[:, :, :, :1].repeat(3, 1), dn, presets.int8())
