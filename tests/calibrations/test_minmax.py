"""Tests of aqtr.calibrations.MinMax (lo/hi bounds for affine numerics)."""

import jax.numpy as jnp
import numpy as np

from aqtr import calibrations
from aqtr.calibrations import MinMax


def test_range_holds_zero_and_the_extremes():
  x = jnp.array([[1.0, 3.0, 2.0], [-2.0, -1.0, -0.5], [-4.0, 0.0, 5.0]])
  lo, hi = MinMax().calibrate_range(x, axes=(1,))
  np.testing.assert_array_equal(lo.ravel(), [0, -2, -4])
  np.testing.assert_array_equal(hi.ravel(), [3, 0, 5])
  # The symmetric bound is absmax.
  np.testing.assert_array_equal(MinMax().calibrate(x, (1,)).ravel(), [3, 2, 5])


def test_per_tensor_and_nonfinite():
  x = jnp.array([[1.0, -3.0], [jnp.nan, 0.0]])
  lo, hi = MinMax().calibrate_range(x, axes=(0, 1))
  assert lo.shape == (1, 1) and np.isnan(lo).all() and np.isnan(hi).all()
  lo, hi = MinMax().calibrate_range(x, axes=(1,))
  assert (lo[0], hi[0]) == (-3.0, 1.0)


def test_registered():
  assert calibrations.get('minmax') is MinMax
