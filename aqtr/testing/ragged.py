"""The ragged-dot part of the registries' contracts.

Every registered calibration, numerics, tiling and sparsity runs through
`aqtr.ragged_dot` (lhs [M, K] x rhs [G, K, N], one group empty) under jit
as it runs through dot_general, since both are the same plan:

  reused     `t` on both forward operands, float backward passes reusing
             them: values and gradients == fake quant on both operands
             (rhs with its group axis as a batch axis), then
             `lax.ragged_dot`, differentiated by JAX;
  requant    `t` on every operand of every pass, requantized: each pass
             == its reference (fwd as above; dlhs: g and rhs fake-quantized
             contracting N; drhs: lhs and g contracting the tokens M).
             Where `t` tiles the token axis (which drhs contracts per
             group) drhs refuses it naming `config.drhs.lhs.tiling`, and
             the check runs drhs per channel instead;
  stateful   (stateful or learned calibrations) refused without state
             naming the path; with `aqtr.state.init(x, w, aqtr.RAGGED,
             cfg)` the jitted step has finite gradients, returns state of
             the same shapes, and the stored rhs frozen at that state
             (`aqtr.quantize_operand`) serves the same output bit for bit.

Entry points: `check_in_ragged(t)` and `check_stateful_ragged(cal)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr import numerics, state, tilings
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.dimension_numbers import RAGGED
from aqtr.core.operand import quantize_operand
from aqtr.core.quantizer import fake_quant
from aqtr.core.ragged_dot import ragged_dot

_FLOAT = TensorConfig(numerics=numerics.NoNumerics())
# M x K tokens, G x K x N experts (sizes suit default tilings), group sizes.
M, K, N, SIZES = 32, 128, 128, (12, 0, 20)


def _operands(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((M, K), np.float32))
  w = jnp.asarray(rng.standard_normal((len(SIZES), K, N), np.float32))
  g = jnp.asarray(rng.standard_normal((M, N), np.float32))
  return x, w, g, jnp.asarray(SIZES, jnp.int32)


def _tiles_tokens(t: TensorConfig) -> bool:
  """Whether `t` tiles a contraction of M tokens (drhs refuses it)."""
  if not t.quantized:
    return False
  try:
    return t.tiling.tile(M) is not None
  except ValueError:
    return True


def _fq(a, t, contract, batch=()):
  return fake_quant(a, t, contracting_axes=contract, batch_axes=batch)


def _vjp(f, x, w, g):
  out, vjp = jax.vjp(f, x, w)
  return (out, *vjp(g))


@functools.partial(jax.jit, static_argnums=(4, 5))
def _run(x, w, g, gs, t, t_drhs):
  """Engine and reference (out, dx, dw): reused and (`t_drhs` not None)
  requantized."""
  grad = t if t.numerics.for_gradients else _FLOAT
  reuse = DotGeneralRaw(lhs=_FLOAT, rhs=_FLOAT, use_fwd_quant=True)
  fwd = DotGeneralRaw(lhs=t, rhs=t)
  reused = DotGeneralConfig(fwd=fwd, dlhs=reuse, drhs=reuse)

  def reference(x, w):
    return lax.ragged_dot(_fq(x, t, (1,)), _fq(w, t, (1,), (0,)), gs)

  r = {
    'reused': _vjp(lambda a, b: ragged_dot(a, b, gs, reused), x, w, g),
    'reused_ref': _vjp(reference, x, w, g),
  }
  if t_drhs is None:
    return r
  g_d = t_drhs if t_drhs.numerics.for_gradients else _FLOAT
  requant = DotGeneralConfig(
    fwd=fwd,
    dlhs=DotGeneralRaw(lhs=grad, rhs=t),
    drhs=DotGeneralRaw(lhs=g_d, rhs=t_drhs),
  )
  # Requantized: each pass on its own fake-quantized operands, the
  # gradients masked as the forward numerics' straight-through rule says.
  out, mask_x = jax.vjp(lambda a: _fq(a, t, (1,)), x)
  _, mask_w = jax.vjp(lambda b: _fq(b, t, (1,), (0,)), w)
  _, dlhs = jax.vjp(lambda a: lax.ragged_dot(a, _fq(w, t, (2,), (0,)), gs), x)
  _, drhs = jax.vjp(lambda b: lax.ragged_dot(_fq(x, t_drhs, (0,)), b, gs), w)
  dx = dlhs(_fq(g, grad, (1,)))[0] * mask_x(jnp.ones_like(x))[0]
  dw = drhs(_fq(g, g_d, (0,)))[0] * mask_w(jnp.ones_like(w))[0]
  r['requant'] = _vjp(lambda a, b: ragged_dot(a, b, gs, requant), x, w, g)
  r['requant_ref'] = (reference(x, w), dx, dw)
  return r


def check_in_ragged(t: TensorConfig, *, requant: bool = True) -> None:
  """`t` through aqtr.ragged_dot's three passes vs the references.

  Args:
    t: the TensorConfig under test (numerics, calibration, tiling,
      rounding, sparsity).
    requant: also check `t` on every pass, requantized (a pruning
      sparsity prunes the forward operands only: False).
  """
  x, w, g, gs = _operands()
  t_drhs = t
  if requant and _tiles_tokens(t):
    bad = DotGeneralConfig(drhs=DotGeneralRaw(lhs=t, rhs=t))
    try:
      jax.grad(lambda a: ragged_dot(a, w, gs, bad).sum())(x)
    except ValueError as e:
      assert 'config.drhs.lhs.tiling' in str(e), e
    else:
      raise AssertionError(f'{t.tiling!r} tiled the token axis in drhs.')
    t_drhs = TensorConfig(numerics=numerics.IntSymmetric())
  r = _run(x, w, g, gs, t, t_drhs if requant else None)
  for name in ('reused', 'requant') if requant else ('reused',):
    for a, b in zip(r[name], r[f'{name}_ref'], strict=True):
      assert jnp.isfinite(a).all(), name
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=name)


def check_stateful_ragged(cal) -> None:
  """A stateful / learned calibration on ragged_dot's forward operands.

  Args:
    cal: the calibration instance.
  """
  t = TensorConfig(calibration=cal, tiling=tilings.PerChannel())
  cfg = DotGeneralConfig(fwd=DotGeneralRaw(lhs=t, rhs=t))
  x, w, g, gs = _operands(1)
  try:
    ragged_dot(x, w, gs, cfg)
  except ValueError as e:
    assert 'fwd.lhs' in str(e), e
  else:
    raise AssertionError(f'{type(cal).__name__} ran without state.')
  s = state.init(x, w, RAGGED, cfg)

  @jax.jit
  def step(x, w, s):
    def loss(x, w, s):
      out, new = ragged_dot(x, w, gs, cfg, state=s)
      return jnp.vdot(out, g), (out, new)

    return jax.grad(loss, (0, 1, 2), has_aux=True)(x, w, s)

  grads, (out, new) = step(x, w, s)
  for a in jax.tree.leaves(grads):
    assert jnp.isfinite(a).all()
  shapes = functools.partial(jax.tree.map, jnp.shape)
  assert shapes(new) == shapes(s), (shapes(new), shapes(s))
  del out  # Under grad XLA may fuse the forward differently: compare
  # the forward programs (serve == train per op).
  train, _ = jax.jit(lambda x, w, s: ragged_dot(x, w, gs, cfg, state=s))(
    x, w, s
  )
  qw = quantize_operand(w, RAGGED, cfg, state=s['fwd.rhs'])
  served, _ = jax.jit(lambda x, q, s: ragged_dot(x, q, gs, cfg, state=s))(
    x, qw, {'fwd.lhs': s['fwd.lhs']}
  )
  np.testing.assert_array_equal(served, train)
