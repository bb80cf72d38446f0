"""The calibration contract's checks for stateful and learned calibrations.

A stateful calibration (`aqtr.calibrations.StatefulCalibration`) cannot be
called without state, so `aqtr.testing.calibrations` runs these instead of
its stateless engine, non-finite and zero checks: on fwd.lhs of a dot, a
call without state raises an error naming 'fwd.lhs'; with
`aqtr.state.init`'s state the jitted call gives finite gradients, and its
output is the fake quantization with the bound of the initial state (and,
with `eager=True`, equals the eager run); a NaN/inf group makes its bound
and output non-finite; all-zero input gives zero output, finite gradients
and state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from aqtr import numerics, state
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.dot_general import dot_general

_DN = (((1,), (0,)), ((), ()))


def _input(seed, shape):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * 3.0, jnp.float32)


def _config(c) -> DotGeneralConfig:
  return DotGeneralConfig(
    fwd=DotGeneralRaw(
      lhs=TensorConfig(calibration=c),
      rhs=TensorConfig(numerics=numerics.NoNumerics()),
    )
  )


def run(c, x, w, eager: bool = False):
  """(initial state, (grads, (out, new_state))) of `c` on fwd.lhs, jitted;
  with `eager`, checked against the same run eagerly."""
  cfg = _config(c)
  s = state.init(x, w, _DN, cfg)

  def f(x, w, s):
    def loss(x, w, s):
      out, new = dot_general(x, w, _DN, cfg, state=s)
      return jnp.sum(out * out), (out, new)

    return jax.grad(loss, (0, 1, 2), has_aux=True)(x, w, s)

  got = jax.jit(f)(x, w, s)
  if eager:
    want = f(x, w, s)
    jax.tree.map(np.testing.assert_array_equal, got[1], want[1])
    close = functools.partial(np.testing.assert_allclose, rtol=1e-6)
    jax.tree.map(close, got[0], want[0])  # Sums may reorder under jit.
  return s, got


def check_engine(cls):
  """Needs state (the error names the path); jit; the fake-quant output."""
  c = cls()
  x, w = _input(4, (4, 16)), _input(5, (16, 3))
  try:
    dot_general(x, w, _DN, _config(c))
  except ValueError as e:
    assert 'fwd.lhs' in str(e), e
  else:
    raise AssertionError(f'{cls.__name__} ran without state.')
  s, (grads, (out, _)) = run(c, x, w)
  assert all(jnp.isfinite(g).all() for g in jax.tree.leaves(grads))
  n = TensorConfig().numerics
  bound, _ = c.bound_with_state(x[None, None], (3,), n, s['fwd.lhs'])
  sc = (bound / n.max_value)[0, 0]
  want = (n.quantize(x / sc).astype(jnp.float32) * sc) @ w
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def check_nonfinite(cls):
  """A NaN/inf group: its bound and dot output are non-finite."""
  c = cls()
  x = _input(1, (4, 16))
  x = x.at[0, 3].set(jnp.nan).at[1, 7].set(jnp.inf).at[2, 0].set(-jnp.inf)
  x4, n = x[None, None], TensorConfig().numerics
  st = c.init_state(jnp.nan_to_num(x4), (3,), n)
  b, _ = c.bound_with_state(x4, (3,), n, st)
  assert not jnp.isfinite(b[0, 0, :3]).any(), b
  assert jnp.isfinite(b[0, 0, 3]).all()
  out = run(c, x, _input(2, (16, 5)))[1][1][0]
  assert not jnp.isfinite(out[:3]).any()
  assert jnp.isfinite(out[3]).all()


def check_zeros(cls):
  """All-zero input: zero output; finite gradients and state."""
  grads, (out, new) = run(cls(), jnp.zeros((4, 16)), _input(2, (16, 5)))[1]
  for leaf in jax.tree.leaves((grads, out, new)):
    assert jnp.isfinite(leaf).all()
  np.testing.assert_array_equal(out, 0.0)
