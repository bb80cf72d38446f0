"""ragged_dot on the shared engine pieces: zero points, refusals.

ragged_dot is a geometry of dot_general's plan (same quantizer, passes
and contraction core), so affine numerics are exact against the
per-expert dot_general reference. State, rounding and sparsity:
tests/core/test_ragged_state.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics

DN = (((1,), (0,)), ((), ()))
SIZES = jnp.array([3, 0, 5])


def _affine(weights_only: bool):
  t = aqtr.TensorConfig(
    numerics=numerics.IntAsymmetric(bits=8), calibration=calibrations.MinMax()
  )
  if weights_only:
    f = aqtr.TensorConfig(numerics=numerics.NoNumerics())
    return aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=f, rhs=t))
  return aqtr.DotGeneralConfig(fwd=aqtr.DotGeneralRaw(lhs=t, rhs=t))


def _reference(x, w, cfg):
  """Each expert's rows through dot_general with the same config."""
  return jnp.concatenate(
    [
      aqtr.dot_general(x[:3], w[0], DN, cfg),
      aqtr.dot_general(x[3:], w[2], DN, cfg),
    ]
  )


@pytest.mark.parametrize(
  'cfg',
  [_affine(False), _affine(True), aqtr.presets.int4_asym_weight_only(32)],
  ids=['both_affine', 'weights_affine', 'int4_asym_g32'],
)
def test_affine_forward_matches_per_expert_dot_general(cfg):
  x = jax.random.normal(jax.random.key(0), (8, 64))
  w = jax.random.normal(jax.random.key(1), (3, 64, 16))
  got = aqtr.ragged_dot(x, w, SIZES, cfg)
  want = _reference(x, w, cfg)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_affine_reused_gradients_match_per_expert_dot_general():
  cfg = _affine(False)
  t = cfg.fwd.lhs
  raw = aqtr.DotGeneralRaw(
    lhs=aqtr.TensorConfig(numerics=numerics.NoNumerics()),
    rhs=t,
    use_fwd_quant=True,
  )
  cfg = aqtr.DotGeneralConfig(fwd=cfg.fwd, dlhs=raw, drhs=raw)
  x = jax.random.normal(jax.random.key(0), (8, 64))
  w = jax.random.normal(jax.random.key(1), (3, 64, 16))
  g = jax.random.normal(jax.random.key(2), (8, 16))

  def ragged(x, w):
    return jnp.vdot(aqtr.ragged_dot(x, w, SIZES, cfg), g)

  def per_expert(x, w):
    return jnp.vdot(_reference(x, w, cfg), g)

  got = jax.grad(ragged, (0, 1))(x, w)
  want = jax.grad(per_expert, (0, 1))(x, w)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_stateful_config_without_state_is_refused_naming_the_slot():
  x, w = jnp.ones((8, 16)), jnp.ones((3, 16, 4))
  with pytest.raises(ValueError, match=r'fwd\.lhs.*DelayedScaling.*state'):
    aqtr.ragged_dot(x, w, SIZES, aqtr.presets.fp8_delayed())


def test_stored_qtensor_is_refused():
  x, w = jnp.ones((8, 16)), jnp.ones((3, 16, 4))
  q = aqtr.quantize(x)
  with pytest.raises(ValueError, match='lhs is a stored QTensor'):
    aqtr.ragged_dot(q, w, SIZES, aqtr.presets.int8())
