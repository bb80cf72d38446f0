"""Tests of aqtr.numerics.Ternary (BitNet b1.58)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics
from aqtr.core.lowering import is_dot, sub_jaxprs
from aqtr.numerics import Ternary

_BITNET = aqtr.TensorConfig(
  numerics=Ternary(), calibration=calibrations.Rms(p=1.0, c=1.0)
)


def dot_dtypes(fn, *args):
  """Operand dtypes of every dot_general in `fn`'s jaxpr (recursively)."""

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if is_dot(e):
        yield tuple(str(v.aval.dtype) for v in e.invars)
      for sub in sub_jaxprs(e):
        yield from walk(sub)

  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_hand_computed_bitnet_weights():
  # gamma = mean|W| = (0.1 + 0.5 + 1.2 + 2.2) / 4 = 1.0 per row.
  w = jnp.array([[0.1, -0.5, 1.2, -2.2], [0.2, 0.2, -0.2, 0.2]])
  qt = aqtr.quantize(w, _BITNET)
  np.testing.assert_allclose(qt.scale.ravel(), [1.0, 0.2], rtol=1e-6)
  # 0.1 -> 0; -0.5 -> 0 (half to even); 1.2 -> 1; -2.2 -> -1 (clipped).
  np.testing.assert_array_equal(
    qt.qvalue.reshape(2, 4), [[0, 0, 1, -1], [1, 1, -1, 1]]
  )
  np.testing.assert_allclose(
    qt.dequant(), [[0, 0, 1, -1], [0.2, 0.2, -0.2, 0.2]], rtol=1e-6
  )


def test_values_are_ternary_int8_and_the_dot_is_int8():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 32)))
  w = jnp.asarray(np.random.default_rng(1).standard_normal((32, 4)))
  qt = aqtr.quantize(x, _BITNET)
  assert qt.qvalue.dtype == jnp.int8
  assert set(np.unique(qt.qvalue).tolist()) == {-1, 0, 1}
  raw = aqtr.DotGeneralRaw(lhs=_BITNET, rhs=_BITNET)
  cfg = aqtr.DotGeneralConfig(fwd=raw)
  dn = (((1,), (0,)), ((), ()))
  dots = dot_dtypes(lambda x, w: aqtr.dot_general(x, w, dn, cfg), x, w)
  assert dots == [('int8', 'int8')]


def test_same_grid_as_int_symmetric_2_bits():
  v = jnp.linspace(-3.0, 3.0, 601)
  np.testing.assert_array_equal(
    Ternary().quantize(v), numerics.IntSymmetric(bits=2).quantize(v)
  )


def test_stochastic_rounding_is_unbiased():
  v = jnp.full((20000,), 0.3)
  u = jax.random.uniform(jax.random.key(0), v.shape, minval=-0.5, maxval=0.5)
  q = Ternary().quantize(v, u).astype(jnp.float32)
  assert float(q.mean()) == pytest.approx(0.3, abs=0.02)
  assert set(np.unique(q).tolist()) <= {0.0, 1.0}


def test_clip_gradient():
  t = aqtr.TensorConfig(
    numerics=Ternary(clip_gradient=True),
    calibration=calibrations.Constant(bound=1.0),
  )
  g = jax.grad(lambda x: aqtr.fake_quant(x, t).sum())(jnp.array([[0.5, 2.0]]))
  np.testing.assert_array_equal(g, [[1.0, 0.0]])


def test_registered_as_ternary():
  assert numerics.get('ternary') is Ternary
