"""Tests of aqtr.calibrations.Mse (MSE-optimal clip search)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import calibrations, numerics
from aqtr.calibrations import Mse
from calibrations import everywhere


def _search(x, n, cal=None, axes=(1,)):
  cal = cal or Mse()
  return jax.jit(lambda x: cal.bound_for(x, axes, n))(jnp.asarray(x))


# Banner et al. 2019: the MSE-optimal clip of N(0, 1) on an int grid with
# 2^(b-1) - 1 levels per side (preserve_zero, preserve_max_val).
@pytest.mark.parametrize(
  ('bits', 'sigma'), [(2, 1.22), (3, 1.95), (4, 2.47), (8, 3.94)]
)
def test_gaussian_oracle(bits, sigma):
  x = np.random.default_rng(0).standard_normal((1, 2**18)).astype(np.float32)
  b = _search(x, numerics.IntSymmetric(bits=bits))
  assert float(b[0, 0]) == pytest.approx(sigma, rel=0.05)


def test_hand_computed_ternary_optimum():
  # 15 ones and a 4 on {-a, 0, a}: err(a) = 15 (1 - a)^2 + (4 - a)^2 for
  # a in (2/3, 2), minimal at a = 19/16 (on the second round's grid).
  x = jnp.array([[1.0] * 15 + [4.0]])
  b = _search(x, numerics.IntSymmetric(bits=2))
  np.testing.assert_allclose(b, [[19 / 16]], rtol=1e-6)
  # One round only tries a = 4k/32: 1.125 and 1.25 tie exactly at 8.5
  # (0.234375 + 8.265625 and 0.9375 + 7.5625); ties keep the larger bound.
  coarse = _search(x, numerics.IntSymmetric(bits=2), Mse(rounds=1))
  np.testing.assert_array_equal(coarse, [[1.25]])


def test_never_worse_than_absmax_for_any_numerics():
  x = np.random.default_rng(3).laplace(size=(8, 256)).astype(np.float32)
  for n in (
    numerics.IntSymmetric(bits=3),
    numerics.IntSymmetric(bits=1, preserve_zero=False),
    numerics.Fp8(),
  ):
    ts = [
      aqtr.TensorConfig(numerics=n, calibration=c)
      for c in (calibrations.AbsMax(), Mse())
    ]
    err = jax.jit(
      lambda x, ts=ts: [
        jnp.sum((aqtr.fake_quant(x, t) - x) ** 2, 1) for t in ts
      ]
    )(x)
    assert (err[1] <= err[0] * (1 + 1e-6)).all(), type(n).__name__


def test_uses_the_operands_numerics():
  x = np.random.default_rng(4).standard_normal((1, 4096)).astype(np.float32)
  b2 = _search(x, numerics.IntSymmetric(bits=2))
  b8 = _search(x, numerics.IntSymmetric(bits=8))
  assert float(b2[0, 0]) < 0.5 * float(b8[0, 0])
  # Without numerics (e.g. a freezer's statistic) the bound is max|x|.
  np.testing.assert_allclose(Mse().calibrate(x, (1,)), np.abs(x).max())


def test_unquantized_numerics_give_absmax():
  x = jnp.array([[1.0, -3.0]])
  np.testing.assert_array_equal(_search(x, numerics.NoNumerics()), [[3.0]])


def test_per_tensor_channel_tile_jit_vmap():
  # On 2-bit ints the bound equals an exhaustive numpy search over the
  # same grid of ratios.
  n = numerics.IntSymmetric(bits=2)
  cal = Mse(steps=64, rounds=1)

  def exhaustive(g):
    m = np.abs(g).max(axis=1, keepdims=True)
    r = (np.arange(64, 0, -1) / 64)[:, None, None]  # larger first: ties
    s = r * m
    q = np.clip(np.round(g / s), -1, 1) * s
    e = np.sum((g - q) ** 2, axis=2)
    return r[np.argmin(e, axis=0), 0, 0] * m[:, 0]

  everywhere.check_groups(cal, exhaustive, n=n, rtol=1e-5)


def test_all_three_passes():
  everywhere.check_passes(
    Mse(steps=8, rounds=1), n=numerics.IntSymmetric(bits=4)
  )


def test_nonfinite_groups_stay_nonfinite():
  x = jnp.ones((3, 8)).at[0, 1].set(jnp.nan).at[1, 2].set(jnp.inf)
  b = _search(x, numerics.IntSymmetric(bits=4))
  assert not jnp.isfinite(b[:2]).any()
  np.testing.assert_allclose(b[2], [1.0])


def test_registered_as_mse():
  assert calibrations.get('mse') is Mse
