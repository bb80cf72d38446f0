"""Tests of aqtr.tilings.PerTensor: one scale for the whole tensor."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import tilings
from aqtr.tilings import PerTensor

_T = aqtr.TensorConfig(tiling=PerTensor())


@pytest.mark.parametrize(
  'shape, contract, batch',
  [((6, 16), (1,), ()), ((2, 3, 8, 4), (2, 3), (0,)), ((16, 5), (0,), ())],
)
def test_one_scale_for_the_tensor(shape, contract, batch):
  x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
  quantize = functools.partial(
    aqtr.quantize, config=_T, contracting_axes=contract, batch_axes=batch
  )
  qt = jax.jit(quantize)(x)
  # Stored per row (so a row holding NaN/inf can be marked), one value.
  assert qt.scale.shape == (qt.qvalue.shape[0], 1, qt.qvalue.shape[2], 1)
  assert np.unique(qt.scale).size == 1
  np.testing.assert_allclose(
    qt.scale.ravel()[0], jnp.abs(x).max() / 127, rtol=1e-6
  )
  assert int(jnp.abs(qt.qvalue.astype(jnp.int32)).max()) == 127
  assert qt.dequant().shape == shape


def test_shares_every_view_axis_and_does_not_tile():
  assert PerTensor.shared == frozenset(tilings.ROLES)
  assert PerTensor().tile(1024) is None and PerTensor().tile(7) is None
  assert tilings.get('per_tensor') is PerTensor
