"""Tests of aqtr.tilings.PerChannel: one scale per row / column."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import aqtr
from aqtr import tilings
from aqtr.tilings import PerChannel

_T = aqtr.TensorConfig(tiling=PerChannel())


def _x(shape, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _scale(x, contract, batch=()):
  quantize = functools.partial(
    aqtr.quantize, config=_T, contracting_axes=contract, batch_axes=batch
  )
  return jax.jit(quantize)(x).scale


def test_one_scale_per_row_of_the_lhs():
  x = _x((6, 16))
  s = _scale(x, (1,))
  assert s.size == 6
  np.testing.assert_allclose(s.ravel(), jnp.abs(x).max(axis=1) / 127, rtol=1e-6)


def test_one_scale_per_column_of_the_rhs():
  w = _x((16, 5), 1)
  s = _scale(w, (0,))
  assert s.size == 5
  np.testing.assert_allclose(s.ravel(), jnp.abs(w).max(axis=0) / 127, rtol=1e-6)


def test_several_contraction_and_batch_axes():
  # [batch 2, contract 3, free 4, contract 8]: one scale per (batch, free).
  x = _x((2, 3, 4, 8), 2)
  s = _scale(x, (1, 3), (0,))
  assert s.size == 2 * 4
  want = jnp.abs(x).max(axis=(1, 3)) / 127  # [2, 4]
  np.testing.assert_allclose(s.reshape(2, 4), want, rtol=1e-6)


def test_is_the_default_and_does_not_tile():
  assert aqtr.TensorConfig().tiling == PerChannel()
  assert PerChannel.shared == frozenset({'tile', 'k'})
  assert PerChannel().tile(1024) is None
  assert tilings.get('per_channel') is PerChannel
