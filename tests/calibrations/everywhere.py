"""Checks that a calibration works per tensor, channel and tile, in all passes.

Used by the oracle tests of the catalogue calibrations (rms, percentile,
mse): `check_groups` compares the quantizer's scales with a numpy oracle of
the bound over each tiling's groups, under jit and vmap; `check_passes`
runs `aqtr.dot_general` with the calibration on every operand of fwd, dlhs
and drhs and compares values and gradients with fake quant + lax.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import aqtr
from aqtr import numerics, tilings

M, K, N, T = 8, 64, 16, 16
TILE = tilings.SubChannel(tile_size=8)  # divides M, K and N: all passes


def groups(x: np.ndarray, tiling: str) -> np.ndarray:
  """The scale groups of an [M, K] operand contracting K, one per row.

  In the order of the quantizer's scale (tile-major for sub-channel).
  """
  if tiling == 'per_tensor':
    return x.reshape(1, -1)
  if tiling == 'per_channel':
    return x
  return x.reshape(M, K // T, T).transpose(1, 0, 2).reshape(-1, T)


TILINGS = {
  'per_tensor': tilings.PerTensor(),
  'per_channel': tilings.PerChannel(),
  'subchannel': tilings.SubChannel(tile_size=T),
}


def check_groups(cal, oracle, n=None, rtol=1e-5, seed=0):
  """Scales = oracle(group rows) / qmax for each tiling, under jit and vmap.

  Args:
    cal: the calibration.
    oracle: numpy `[G, n] -> [G]` bound of each group (a row).
    n: the numerics (default int8 symmetric).
    rtol: tolerance on the scale.
    seed: data seed.
  """
  n = n or numerics.IntSymmetric()
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((3, M, K)).astype(np.float32)
  x[..., 5] *= 6.0  # an outlier column
  for name, tiling in TILINGS.items():
    t = aqtr.TensorConfig(numerics=n, calibration=cal, tiling=tiling)
    # One jit of a vmap over the 3 slices: each slice its own groups.
    scales = jax.jit(jax.vmap(lambda xi, t=t: aqtr.quantize(xi, t).scale))
    got = np.asarray(scales(jnp.asarray(x))).reshape(len(x), -1)
    if name == 'per_tensor':  # stored per row (NaN rows), one value
      np.testing.assert_array_equal(got, np.broadcast_to(got[:, :1], got.shape))
      got = got[:, :1]
    want = np.stack([oracle(groups(xi, name)) for xi in x]) / n.max_value
    np.testing.assert_allclose(got, want, rtol=rtol, err_msg=name)


def check_passes(cal, n=None, tiling=TILE):
  """`cal` on every operand of fwd, dlhs and drhs == fake quant + lax."""
  n = n or numerics.IntSymmetric()
  t = aqtr.TensorConfig(numerics=n, calibration=cal, tiling=tiling)
  raw = aqtr.DotGeneralRaw(lhs=t, rhs=t)
  cfg = aqtr.DotGeneralConfig(fwd=raw, dlhs=raw, drhs=raw)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  dn = (((1,), (0,)), ((), ()))

  @jax.jit
  def engine(x, w, g):
    out, vjp = jax.vjp(lambda x, w: aqtr.dot_general(x, w, dn, cfg), x, w)
    return (out, *vjp(g))

  @jax.jit
  def reference(x, w, g):
    def fq(a, axis):
      return aqtr.fake_quant(a, t, contracting_axes=(axis,))

    out = lax.dot_general(fq(x, 1), fq(w, 0), dn)
    dx = lax.dot_general(fq(g, 1), fq(w, 1), (((1,), (1,)), ((), ())))
    dw = lax.dot_general(fq(x, 0), fq(g, 0), (((0,), (0,)), ((), ())))
    return out, dx, dw

  for a, b in zip(engine(x, w, g), reference(x, w, g), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
