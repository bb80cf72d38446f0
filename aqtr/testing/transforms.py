"""The contract of the `transforms` registry.

A transform builds from `fdl.Config` with its defaults; it is hashable,
equal to a rebuilt one and a static `jax.jit` argument; applied along the
contraction to both operands of a dot (with one key when it draws from
one) it leaves the float product unchanged to float rounding, values and
gradients, for either operand layout and a contraction that is not the
last axis; `inverse` undoes `apply` and norms are kept (orthogonal); the
shape is kept and the result is float32 for bf16 inputs (the identity
returns its input); a contraction it
does not fit raises a ValueError naming the operand and the size; bad
field values raise an error naming the field.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr import transforms
from aqtr.testing import checks as cc

_K = 256
_KEY = jax.random.key(7)


def _operands():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, _K)) * np.exp(rng.uniform(-2, 2, (1, _K)))
  w = rng.standard_normal((_K, 6))
  return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)


def _rotated_dot(t, x, w, key):
  """x . w with both operands rotated along the contraction K."""
  xr = t.apply(x, 1, key, operand='lhs')
  wr = t.apply(w, 0, key, operand='rhs')
  return xr @ wr


def check_builds(cls, bad_fields):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  del bad_fields
  cc.check_builds(cls, transforms.Transform)


def check_static_arg(cls, bad_fields):
  """A static jit argument."""
  del bad_fields
  x, _ = _operands()
  cc.check_static_arg(cls, lambda t, x: t.apply(x, 1, _KEY), x)


def check_exact(cls, bad_fields):
  """(x R)(R^T w) == x w to float rounding: values and gradients, jitted."""
  del bad_fields
  t = cls()
  x, w = _operands()
  g = jnp.asarray(np.random.default_rng(1).standard_normal((8, 6)), 'f4')

  @jax.jit
  def both(x, w):
    a, vjp_a = jax.vjp(lambda x, w: _rotated_dot(t, x, w, _KEY), x, w)
    b, vjp_b = jax.vjp(lambda x, w: x @ w, x, w)
    return (a, *vjp_a(g)), (b, *vjp_b(g))

  for got, want in zip(*both(x, w), strict=True):
    assert got.shape == want.shape and got.dtype == jnp.float32
    tol = 1e-5 * float(jnp.abs(want).max())
    np.testing.assert_allclose(got, want, atol=tol, rtol=1e-5)
  # The wgrad GEMM contracts the first (token) axis: x^T g.
  tok = jax.jit(
    lambda x, g: lax.dot_general(
      t.apply(x.T, 0, _KEY), t.apply(g, 0, _KEY), (((0,), (0,)), ((), ()))
    )
  )(x, jnp.ones((_K, 3)))
  want = x @ jnp.ones((_K, 3))
  np.testing.assert_allclose(tok, want, atol=1e-5 * float(jnp.abs(want).max()))


def check_orthogonal(cls, bad_fields):
  """`inverse` undoes `apply`; norms are kept; shapes kept; bf16 -> f32."""
  del bad_fields
  t = cls()
  x, _ = _operands()
  x3 = x.reshape(2, 4, _K).transpose(0, 2, 1)  # contraction in the middle
  for a in (x, x3):
    axis = 1 if a.ndim == 3 else -1
    r = jax.jit(lambda a, axis=axis: t.apply(a, axis, _KEY))(a)
    assert r.shape == a.shape
    back = jax.jit(lambda r, axis=axis: t.inverse(r, axis, _KEY))(r)
    tol = 1e-5 * float(jnp.abs(a).max())
    np.testing.assert_allclose(back, a, atol=tol)
    np.testing.assert_allclose(
      jnp.linalg.norm(r, axis=axis), jnp.linalg.norm(a, axis=axis), rtol=1e-5
    )
  if t.transforms:  # The identity returns its input as it is.
    assert t.apply(x.astype(jnp.bfloat16), 1, _KEY).dtype == jnp.float32


def check_sizes(cls, bad_fields):
  """A contraction that does not fit: ValueError naming operand and size."""
  del bad_fields
  t = cls()
  t.check_size(_K, 'fwd.lhs')
  if not t.transforms:
    return
  for k in (_K + 2, 3 * 5 * 7):
    try:
      t.check_size(k, 'drhs.lhs')
    except ValueError as e:
      assert 'drhs.lhs' in str(e) and str(k) in str(e), str(e)
      with cc.raises(ValueError) as err:
        t.apply(jnp.ones((2, k)), 1, _KEY, operand='drhs.rhs')
      assert 'drhs.rhs' in str(err[0]) and str(k) in str(err[0])
      return
  raise cc.ContractError(
    f'{cls.__qualname__} accepts every contraction size: check_size should '
    'reject the sizes it cannot rotate (or the test sizes need updating).'
  )


def check_bad_fields(cls, bad_fields):
  """Each bad-field example raises an error naming its fields."""
  cc.check_bad_fields(
    cls, bad_fields, family='transforms', base=transforms.Transform
  )


CHECKS = (
  check_builds,
  check_static_arg,
  check_exact,
  check_orthogonal,
  check_sizes,
  check_bad_fields,
)


def check_transform(cls, bad_fields):
  """Runs every contract check on the transform class `cls`.

  Args:
    cls: a Transform subclass (registered or not).
    bad_fields: a list of keyword-argument dicts that must each raise a
      TypeError or ValueError naming their fields ([] without own fields).
  """
  cc.run_all(CHECKS, cls, bad_fields)
