"""`fenced_cotangent`: the identity, whose cotangent passes a fusion fence."""

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.core.dot_general import fenced_cotangent
from aqtr.lora.config import LoraConfig
from aqtr.lora.session import low_rank


def _gelu_adapter(fence):
  """A GELU after a float product whose rhs gradient contracts the rows
  (LoRA's B): the case XLA:CPU recomputed inside a transposing copy."""

  def f(x, b):
    y = x @ b
    y = fenced_cotangent(y) if fence else y
    return jax.nn.gelu(y).sum()

  return f


def test_values_and_gradients_are_the_identitys_bit_for_bit():
  x = jax.random.normal(jax.random.key(0), (64, 8))
  b = jax.random.normal(jax.random.key(1), (8, 32))
  got = jax.jit(jax.grad(_gelu_adapter(True), argnums=(0, 1)))(x, b)
  want = jax.jit(jax.grad(_gelu_adapter(False), argnums=(0, 1)))(x, b)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)


def test_the_fence_is_a_conditional_in_the_gradient_on_cpu():
  x, b = jnp.ones((16, 4)), jnp.ones((4, 8))
  grad = jax.grad(_gelu_adapter(True), argnums=1)
  plain = jax.grad(_gelu_adapter(False), argnums=1)
  assert 'stablehlo.case' in jax.jit(grad).lower(x, b).as_text()
  assert 'stablehlo.case' not in jax.jit(plain).lower(x, b).as_text()
  compiled = jax.jit(grad).lower(x, b).compile().as_text()
  assert ' conditional(' in compiled  # XLA keeps it.


def test_higher_order_derivatives_are_the_identitys():
  f = lambda x: (fenced_cotangent(jnp.tanh(x)) ** 2).sum()  # noqa: E731
  g = lambda x: (jnp.tanh(x) ** 2).sum()  # noqa: E731
  x = jnp.linspace(-1.0, 1.0, 3)
  np.testing.assert_allclose(jax.hessian(f)(x), jax.hessian(g)(x))
  gg = lambda h: jax.grad(lambda x: jax.grad(h)(x).sum())(x)  # noqa: E731
  np.testing.assert_allclose(gg(f), gg(g))


def test_lora_low_rank_float_adapter_is_fenced_and_unchanged():
  x = jax.random.normal(jax.random.key(2), (32, 16))
  a = jax.random.normal(jax.random.key(3), (16, 4))
  b = jax.random.normal(jax.random.key(4), (4, 8))
  cfg = LoraConfig(rank=4, alpha=6.0)

  def loss(a, b, fn):
    return jax.nn.gelu(fn(x, a, b)).sum()

  def fenced(x, a, b):
    return low_rank(x, a, b, (1,), cfg, None, 0)

  def plain(x, a, b):
    return (x @ a) @ b * cfg.scale

  got = jax.jit(jax.grad(lambda a, b: loss(a, b, fenced), (0, 1)))(a, b)
  want = jax.jit(jax.grad(lambda a, b: loss(a, b, plain), (0, 1)))(a, b)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
