"""Tests of aqtr.numerics.NoNumerics, the passthrough numerics 'none'."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import aqtr
from aqtr import numerics
from aqtr.numerics import NoNumerics

_DN = (((1,), (0,)), ((), ()))


def _raw(lhs, rhs, **kw):
  return aqtr.DotGeneralRaw(lhs=lhs, rhs=rhs, **kw)


def test_passthrough():
  n = NoNumerics()
  v = jnp.array([1e9, -0.3, jnp.nan, jnp.inf])
  assert n.quantize(v) is v
  assert not n.quantizes and n.grad_mask(v) is None
  assert not aqtr.TensorConfig(numerics=n).quantized
  assert numerics.get('none') is NoNumerics


def test_all_none_config_is_lax_bit_for_bit():
  f = aqtr.TensorConfig(numerics=NoNumerics())
  cfg = aqtr.DotGeneralConfig(fwd=_raw(f, f), dlhs=_raw(f, f), drhs=_raw(f, f))
  assert cfg.is_float
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)

  def grads(dot):
    return jax.jit(jax.value_and_grad(lambda x, w: dot(x, w).sum(), (0, 1)))

  got = grads(lambda x, w: aqtr.dot_general(x, w, _DN, cfg))(x, w)
  want = grads(lambda x, w: lax.dot_general(x, w, _DN))(x, w)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_none_on_one_operand_leaves_it_unquantized():
  f = aqtr.TensorConfig(numerics=NoNumerics())
  q = aqtr.TensorConfig()
  cfg = aqtr.DotGeneralConfig(fwd=_raw(f, q), dlhs=_raw(f, f), drhs=_raw(f, f))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 4)), jnp.float32)
  out = jax.jit(lambda x, w: aqtr.dot_general(x, w, _DN, cfg))(x, w)
  fw = aqtr.fake_quant(w, q, contracting_axes=(0,))
  np.testing.assert_allclose(out, lax.dot_general(x, fw, _DN), rtol=1e-5)
