"""Inputs closed over by `jit` (constants XLA folds) quantize like inputs
passed as arguments, bit for bit.

XLA:CPU's constant folding got the sign bit wrong when it read it by a
bit cast (`jnp.copysign` / `jnp.signbit`) of a transposed view: MX and
NVFP4 dots with a closed-over operand came out with flipped codes
(relative error 1.4 instead of 0.14). The grids now take signs by
comparisons (`aqtr.core.prims.negative`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.core import prims

DN = (((1,), (0,)), ((), ()))
X = jax.random.normal(jax.random.key(0), (8, 64)) * 3
W = jax.random.normal(jax.random.key(1), (64, 16))


@pytest.mark.parametrize('preset', ['mxfp8', 'nvfp4', 'fp8', 'int8'])
def test_a_closed_over_operand_quantizes_like_an_argument(preset):
  cfg = getattr(aqtr.presets, preset)()

  def f(a, b):
    return aqtr.dot_general(a, b, DN, config=cfg)

  want = jax.jit(f)(X, W)
  np.testing.assert_array_equal(jax.jit(lambda b: f(X, b))(W), want)
  np.testing.assert_array_equal(jax.jit(lambda a: f(a, W))(X), want)


def test_negative_reads_the_sign_of_zeros_and_not_of_nan():
  v = jnp.array([-2.0, -0.0, 0.0, 3.0, jnp.nan, -jnp.inf])
  assert prims.negative(v).tolist() == [True, True, False, False, False, True]
  # Constant-folded (closed over, transposed) like computed at run time.
  m = jnp.arange(-8.0, 8.0).reshape(4, 4)
  folded = jax.jit(lambda: prims.negative(m.T * 1.5))()
  np.testing.assert_array_equal(folded, np.asarray(m.T) < 0)
