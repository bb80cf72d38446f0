"""Second-order derivatives through a quantized dot raise a clear error.

The quantized dot's gradient is a straight-through estimate (a custom VJP);
differentiating it again used to return numbers off by 100% silently.
Every second-order transformation now raises, naming second-order
differentiation; first-order gradients are unchanged, and the float preset
still equals lax to every order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr.core import first_order

MK_KN = (((1,), (0,)), ((), ()))
_X = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
_W = jnp.asarray(np.random.default_rng(1).standard_normal((8, 2)), jnp.float32)

_SECOND_ORDER = {
  'hessian': jax.hessian,
  'jacrev_grad': lambda f: jax.jacrev(jax.grad(f)),
  'jacfwd_grad': lambda f: jax.jacfwd(jax.grad(f)),
  'grad_grad': lambda f: jax.grad(lambda x: jax.grad(f)(x).sum()),
}


def _loss(cfg, wrt_w=False):
  def f(v):
    x, w = (_X, v) if wrt_w else (v, _W)
    return jnp.sum(aqtr.dot_general(x, w, MK_KN, cfg) ** 2)

  return f


@pytest.mark.parametrize('op', list(_SECOND_ORDER), ids=str)
@pytest.mark.parametrize('preset', ['int8', 'int8_fwd', 'fp8'])
def test_second_order_raises(preset, op):
  cfg = getattr(aqtr.presets, preset)()
  for wrt_w in (False, True):
    f = _loss(cfg, wrt_w)
    with pytest.raises(NotImplementedError, match='second-order'):
      # Under jit the error comes at trace time (nothing compiles).
      jax.jit(_SECOND_ORDER[op](f))(_W if wrt_w else _X)


def test_second_order_raises_without_jit():
  with pytest.raises(NotImplementedError, match='second-order'):
    jax.jacrev(jax.grad(_loss(aqtr.presets.int8())))(_X)


def test_first_order_is_unchanged_and_jits():
  cfg = aqtr.presets.int8()
  g = jax.jit(jax.grad(_loss(cfg)))(_X)

  @jax.jit
  def by_vjp(x):
    out, pull = jax.vjp(lambda x: aqtr.dot_general(x, _W, MK_KN, cfg), x)
    return pull(2.0 * out)[0]

  np.testing.assert_array_equal(by_vjp(_X), g)
  assert jnp.isfinite(g).all() and (g != 0).any()


@pytest.mark.parametrize('op', list(_SECOND_ORDER), ids=str)
def test_float_preset_equals_lax_to_second_order(op):
  f = _loss(aqtr.presets.float())

  def ref(x):
    return jnp.sum(lax.dot_general(x, _W, MK_KN) ** 2)

  np.testing.assert_array_equal(
    jax.jit(_SECOND_ORDER[op](f))(_X), jax.jit(_SECOND_ORDER[op](ref))(_X)
  )


def test_first_order_only_is_the_identity_and_keeps_none():
  a = jnp.arange(3.0)
  got = first_order.first_order_only(a, None)
  assert got[1] is None
  np.testing.assert_array_equal(got[0], a)
  with pytest.raises(NotImplementedError, match='second-order'):
    jax.jvp(lambda v: first_order.first_order_only(v)[0], (a,), (a,))
  # No tangent flows: no error.
  jax.grad(lambda v: v.sum() + first_order.first_order_only(a)[0].sum())(a)
