"""Tests of aqtr.calibrations.Rms (absmean p=1, k-sigma p=2)."""

import jax.numpy as jnp
import numpy as np
import pytest

from aqtr import calibrations, numerics
from aqtr.calibrations import Rms
from calibrations import everywhere


def test_hand_computed_bounds():
  x = jnp.array([[3.0, -4.0], [0.0, 0.0], [1.0, -1.0]])
  np.testing.assert_allclose(
    Rms(p=1, c=1.0).calibrate(x, (1,)).ravel(), [3.5, 0, 1]
  )
  np.testing.assert_allclose(
    Rms(p=2, c=2.0).calibrate(x, (1,)).ravel(), [2 * np.sqrt(12.5), 0, 2]
  )
  # p=3: (mean |x|^3)^(1/3) of (3, 4) = (91/2)^(1/3).
  np.testing.assert_allclose(
    Rms(p=3, c=1.0).calibrate(x, (1,))[0], [(91 / 2) ** (1 / 3)], rtol=1e-6
  )


def test_large_values_do_not_overflow():
  x = jnp.array([[3e30, -4e30]])
  b = Rms(p=2, c=1.0).calibrate(x, (1,))
  np.testing.assert_allclose(b, [[np.sqrt(12.5) * 1e30]], rtol=1e-6)


def test_per_tensor_channel_tile_jit_vmap():
  p, cal = 1.5, Rms(p=1.5, c=2.5)

  def oracle(g):
    return 2.5 * np.mean(np.abs(g) ** p, axis=1) ** (1 / p)

  everywhere.check_groups(cal, oracle, rtol=2e-5)


def test_all_three_passes():
  everywhere.check_passes(Rms(p=1, c=1.0))


def test_bitnet_absmean_with_ternary_grid():
  # BitNet b1.58: W~ = RoundClip(W / mean|W|, -1, 1) * mean|W|.
  w = jnp.array([[0.2, -0.9, 0.05, 1.6]])
  n = numerics.IntSymmetric(bits=2)  # the grid {-1, 0, 1}
  b = Rms(p=1, c=1.0).calibrate(w, (1,))
  gamma = float(np.mean(np.abs(w)))
  assert float(b[0, 0]) == pytest.approx(gamma)
  q = n.quantize(w / b)
  np.testing.assert_array_equal(q, [[0, -1, 0, 1]])


def test_registered_as_rms():
  assert calibrations.get('rms') is Rms
