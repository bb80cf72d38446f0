"""LayerStats streaming and the weight-as-matrix view."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqtr.ptq.collect import input_matrix
from aqtr.ptq.stats import (
  LayerStats,
  as_matrix,
  from_matrix,
  merge,
  output_error,
)


def test_streaming_equals_all_at_once():
  x = jax.random.normal(jax.random.key(0), (96, 12))
  whole = LayerStats.from_activations(x)
  parts = [LayerStats.from_activations(x[i : i + 32]) for i in (0, 32, 64)]
  acc = LayerStats.zeros(12)
  for p in parts:
    acc = merge(acc, p)
  for a, b in zip(acc, whole, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(acc.mean_abs, jnp.mean(jnp.abs(x), 0), 1e-5)
  np.testing.assert_allclose(acc.hessian, 2 * x.T @ x / 96, 1e-4, 1e-4)


def test_matrix_view_round_trips_and_gives_the_output_error():
  # A weight contracting two dims listed out of order by the dot.
  w = jax.random.normal(jax.random.key(1), (3, 5, 4))
  lhs = jax.random.normal(jax.random.key(2), (7, 4, 3))
  dn = (((1, 2), (2, 0)), ((), ()))
  w2 = as_matrix(w, dn[0][1])
  assert w2.shape == (12, 5)
  np.testing.assert_array_equal(from_matrix(w2, (2, 0), w.shape), w)
  x2 = input_matrix(lhs, dn)
  out = jax.lax.dot_general(lhs, w, dn)
  np.testing.assert_allclose(x2 @ w2, out, rtol=1e-5, atol=1e-5)
  s = LayerStats.from_activations(x2)
  np.testing.assert_allclose(
    output_error(w2, s.xtx), jnp.sum(out**2), rtol=1e-4
  )


def test_bad_input_is_one_line():
  with pytest.raises(ValueError, match='x2d must be'):
    LayerStats.from_activations(jnp.ones((2, 3, 4)))
  with pytest.raises(ValueError, match='different d_in'):
    merge(LayerStats.zeros(3), LayerStats.zeros(4))
  with pytest.raises(ValueError, match='not distinct axes'):
    as_matrix(jnp.ones((2, 3)), (0, 0))
  with pytest.raises(ValueError, match='batch dimensions'):
    input_matrix(jnp.ones((2, 3, 4)), (((2,), (1,)), ((0,), (0,))))
