"""First-order only: a clear error instead of a wrong second derivative.

The quantized dot's gradient is a straight-through estimate (the rounding's
derivative taken as the identity), written as a custom VJP. Differentiating
that VJP again (`jax.hessian`, `jax.jacrev(jax.grad(f))`, `jax.jacfwd` of a
gradient, grad of grad) would differentiate the quantizers inside the
backward pass, whose true derivative is zero almost everywhere: a silently
wrong number. The backward pass therefore returns its gradients through
`first_order_only`, an identity whose derivative raises.

Example:
  >>> import jax, jax.numpy as jnp
  >>> first_order_only(jnp.ones(2))[0].tolist()
  [1.0, 1.0]
  >>> try:
  ...   jax.grad(lambda x: first_order_only(x)[0].sum())(jnp.ones(2))
  ... except NotImplementedError as e:
  ...   print(str(e)[:40])
  second-order differentiation (jax.hessia
"""

from __future__ import annotations

import jax

MESSAGE = (
  'second-order differentiation (jax.hessian, jax.jacrev/jacfwd of '
  'jax.grad, grad of grad) through a quantized aqtr.dot_general is not '
  'supported: its gradient is a straight-through estimate with no '
  'derivative of its own. Differentiate once, or use aqtr.presets.float() '
  '(exactly lax.dot_general, any order) where you need second derivatives.'
)


@jax.custom_jvp
def _identity(xs):
  return xs


@_identity.defjvp
def _identity_jvp(primals, tangents):
  del primals, tangents
  raise NotImplementedError(MESSAGE)


def first_order_only(*xs):
  """Returns `xs` unchanged; differentiating the result raises.

  None entries pass through. Only a real (non-zero) tangent raises: JAX
  does not call the rule when nothing the values depend on is
  differentiated.
  """
  arrays = [x for x in xs if x is not None]
  out = iter(_identity(arrays) if arrays else ())
  return tuple(None if x is None else next(out) for x in xs)
