"""The contract of the `sparsity` registry.

A sparsity builds from `fdl.Config` with its defaults; it is hashable,
equal to a rebuilt one and a static `jax.jit` argument; its mask is a
deterministic boolean array shaped like the operand, the same whichever
canonical form ([B, F, K] or [B, K, F]) the operand comes in, keeps NaNs
(so they reach the output) and, for a pruning sparsity, prunes random data;
inside a TensorConfig (with int8 numerics), `aqtr.dot_general`
runs under jit and agrees with the reference (prune, fake quant, then
`lax.dot_general`), values and gradients; the gradient of the dense
operand (float numerics) is the straight-through one (that of the pruned
operand), plus
SR-STE's `decay * (1 - M) * x` for classes with a `decay` field; bad field
values raise an error naming the field.
`aqtr.ragged_dot` prunes its forward operands as dot_general does
(`aqtr.testing.ragged`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr import numerics, sparsity
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.dot_general import dot_general
from aqtr.core.quantizer import fake_quant
from aqtr.testing import checks as cc
from aqtr.testing import ragged

_FLOAT = TensorConfig(numerics=numerics.NoNumerics())


def _instances(cls):
  """cls() and, when it has a `decay` field, cls(decay=0.5) (SR-STE)."""
  out = [cls()]
  if 'decay' in {f.name for f in dataclasses.fields(cls)}:
    out.append(cls(decay=0.5))
  return out


def check_builds(cls, bad_fields):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  del bad_fields
  cc.check_builds(cls, sparsity.Sparsity)


def check_static_arg(cls, bad_fields):
  """A static jit argument (through fake_quant)."""
  del bad_fields
  x = jnp.linspace(-3.0, 3.0, 256).reshape(4, 64)
  cc.check_static_arg(
    cls, lambda s, x: fake_quant(x, TensorConfig(sparsity=s)), x
  )


def check_mask(cls, bad_fields):
  """A deterministic bool mask, the same in either form; NaNs are kept."""
  del bad_fields
  s = cls()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
  mask = jax.jit(s.mask, static_argnums=1)
  m = mask(x, 2)
  assert m.dtype == jnp.bool_ and m.shape == x.shape, (m.dtype, m.shape)
  np.testing.assert_array_equal(m, mask(x, 2))
  m_kf = mask(jnp.swapaxes(x, 1, 2), 1)
  np.testing.assert_array_equal(jnp.swapaxes(m_kf, 1, 2), m)
  if s.prunes:
    assert not bool(m.all()), 'a pruning sparsity kept every element'
  else:
    assert bool(m.all()), 'a sparsity with prunes=False must keep all'
  x_nan = x.at[1, 2, 5].set(jnp.nan)
  assert bool(mask(x_nan, 2)[1, 2, 5]), 'a NaN was pruned'


def _cfg(t: TensorConfig) -> DotGeneralConfig:
  """`t` on both forward operands; float backward passes reusing them."""
  bwd = DotGeneralRaw(lhs=_FLOAT, rhs=_FLOAT, use_fwd_quant=True)
  return DotGeneralConfig(fwd=DotGeneralRaw(lhs=t, rhs=t), dlhs=bwd, drhs=bwd)


def _reference(x, w, dn, t):
  (lc, rc), (lb, rb) = dn
  fx = fake_quant(x, t, contracting_axes=lc, batch_axes=lb)
  fw = fake_quant(w, t, contracting_axes=rc, batch_axes=rb)
  return lax.dot_general(fx, fw, dn)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _run(x, w, g, dn, ts):
  out = []
  for t in ts:
    for f in (
      lambda x, w, t=t: dot_general(x, w, dn, _cfg(t)),
      lambda x, w, t=t: _reference(x, w, dn, t),
    ):
      y, vjp = jax.vjp(f, x, w)
      out.append((y, *vjp(g)))
  return out


def check_engine(cls, bad_fields):
  """dot_general (int8) == prune + fake quant + lax, values and grads.

  (Float numerics: `check_gradient`.)
  """
  del bad_fields
  ts = (TensorConfig(sparsity=cls()),)
  for seed, (lshape, rshape, dn) in enumerate(cc.DOTS):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(lshape, np.float32))
    w = jnp.asarray(rng.standard_normal(rshape, np.float32))
    out = jax.eval_shape(lambda x, w, dn=dn: lax.dot_general(x, w, dn), x, w)
    g = jnp.asarray(rng.standard_normal(out.shape, np.float32))
    r = _run(x, w, g, dn, ts)
    for i in range(0, len(r), 2):
      for a, b in zip(r[i], r[i + 1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
        assert jnp.isfinite(a).all()


@functools.partial(jax.jit, static_argnums=3)
def _grads(x, w, g, s):
  """Engine output and VJP, and the formula's, for float numerics."""
  dn = (((1,), (0,)), ((), ()))
  cfg = _cfg(TensorConfig(numerics=numerics.NoNumerics(), sparsity=s))
  y, vjp = jax.vjp(lambda x, w: dot_general(x, w, dn, cfg), x, w)
  m_x = s.mask(x[None], 2)[0]  # [M, K]: the 'fk' form.
  m_w = s.mask(w[None], 1)[0]  # [K, N] weights: the 'kf' form.
  x_s, w_s = jnp.where(m_x, x, 0.0), jnp.where(m_w, w, 0.0)
  want_x = g @ w_s.T + s.decay * jnp.where(m_x, 0.0, x)
  want_w = x_s.T @ g + s.decay * jnp.where(m_w, 0.0, w)
  return (y, *vjp(g)), (x_s @ w_s, want_x, want_w)


def check_gradient(cls, bad_fields):
  """dx = g . w_s + decay (1 - M_x) x, dw = x_s^T . g + decay (1 - M_w) w.

  Float numerics, both operands pruned; x [M, K], w [K, N].
  """
  del bad_fields
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
  for s in _instances(cls):
    got, want = _grads(x, w, g, s)
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(
    cls, bad_fields, family='sparsity', base=sparsity.Sparsity
  )


def check_ragged(cls, bad_fields):
  """aqtr.ragged_dot prunes its forward operands as dot_general does."""
  del bad_fields
  ragged.check_in_ragged(TensorConfig(sparsity=cls()), requant=False)


CHECKS = (
  check_builds,
  check_static_arg,
  check_mask,
  check_engine,
  check_ragged,
  check_gradient,
  check_bad_fields,
)


def check_sparsity(cls, bad_fields):
  """Runs every contract check on the sparsity class `cls`.

  Args:
    cls: a Sparsity subclass (registered or not).
    bad_fields: a list of keyword-argument dicts that must each raise a
      TypeError or ValueError naming their fields ([] without own fields).
  """
  cc.run_all(CHECKS, cls, bad_fields)
