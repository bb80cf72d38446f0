"""Every catalogue numerics composes with every tiling, in the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr import calibrations, numerics, tilings

NUMERICS = {
  'int4': numerics.IntSymmetric(bits=4),
  'int4_asym': numerics.IntAsymmetric(bits=4, storage='uint8'),
  'e2m1': numerics.Fp(exponent_bits=2, mantissa_bits=1),
  'e4m3fnuz': numerics.Fp8(dtype_name='float8_e4m3fnuz'),
}
TILINGS = {
  'per_tensor': tilings.PerTensor(),
  'per_channel': tilings.PerChannel(),
  'subchannel': tilings.SubChannel(tile_size=32),
  'block2d': tilings.Block2d(tile_size=32, free_size=16),
}
_DN = (((1,), (0,)), ((), ()))
_FLOAT = aqtr.TensorConfig(numerics=numerics.NoNumerics())


def _t(n, tiling):
  cal = calibrations.MinMax() if n.asymmetric else calibrations.AbsMax()
  return aqtr.TensorConfig(numerics=n, calibration=cal, tiling=tiling)


def _both(x, w, g, t):
  """(engine, reference) values and gradients for `t` on both operands."""
  raw = aqtr.DotGeneralRaw
  bwd = raw(lhs=_FLOAT, rhs=_FLOAT, use_fwd_quant=True)
  cfg = aqtr.DotGeneralConfig(fwd=raw(lhs=t, rhs=t), dlhs=bwd, drhs=bwd)

  def reference(x, w):
    fx = aqtr.fake_quant(x, t)
    fw = aqtr.fake_quant(w, t, contracting_axes=(0,))
    return lax.dot_general(fx, fw, _DN)

  out = []
  for f in (lambda x, w: aqtr.dot_general(x, w, _DN, cfg), reference):
    y, vjp = jax.vjp(f, x, w)
    out.append((y, *vjp(g)))
  return out


def _check(pairs):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((24, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 40)) + 0.5, jnp.float32)
  g = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
  run = jax.jit(
    lambda x, w, g: {
      p: _both(x, w, g, _t(NUMERICS[p[0]], TILINGS[p[1]])) for p in pairs
    }
  )
  for name, (got, want) in run(x, w, g).items():
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=name)


def test_each_numerics_with_another_tiling():
  """Fast: every numerics and every tiling once (a Latin pairing)."""
  _check(list(zip(sorted(NUMERICS), sorted(TILINGS), strict=True)))


@pytest.mark.slow
@pytest.mark.parametrize('numerics_name', sorted(NUMERICS))
def test_numerics_compose_with_every_tiling(numerics_name):
  _check([(numerics_name, t) for t in sorted(TILINGS)])
