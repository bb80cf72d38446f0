"""Tests for aqtr/core/rounding.py: nearest-even, stochastic, keys."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.core import rounding


def test_nearest_even_has_no_noise():
  r = aqtr.NearestEven()
  assert r.noise(None, (2, 3)) is None
  assert not r.stochastic
  assert hash(r) == hash(aqtr.NearestEven()) and r == aqtr.NearestEven()


@pytest.mark.parametrize('bits', [8, 16])
def test_noise_is_uniform_and_centered(bits):
  u = np.asarray(rounding.uniform_grid(jax.random.key(0), (400, 500), bits))
  assert u.shape == (400, 500) and u.dtype == np.float32
  assert u.min() >= -0.5 and u.max() < 0.5
  n = u.size
  assert abs(u.mean()) < 5 * math.sqrt(1 / 12 / n)
  # 16 bins hold equally many grid points.
  hist, _ = np.histogram(u, bins=16, range=(-0.5, 0.5))
  p = hist / n
  assert np.abs(p - 1 / 16).max() < 5 * math.sqrt(15 / 256 / n)


@pytest.mark.parametrize('bits', [8, 16])
def test_uniform_grid(bits):
  u = np.asarray(rounding.uniform_grid(jax.random.key(1), (3, 7), bits))
  assert u.shape == (3, 7)
  j = (u + 0.5) * 2**bits - 0.5
  np.testing.assert_array_equal(j, np.round(j))
  assert j.min() >= 0 and j.max() <= 2**bits - 1
  assert np.unique(j).size > 15  # Every draw gets its own bits.


def test_uniform16_is_the_16_bit_grid():
  key = jax.random.key(2)
  np.testing.assert_array_equal(
    rounding.uniform16(key, (5,)), rounding.uniform_grid(key, (5,), 16)
  )


@pytest.mark.parametrize('bits', [4, 32])
def test_noise_bits_are_checked(bits):
  with pytest.raises(ValueError, match='noise bits'):
    rounding.uniform_grid(jax.random.key(0), (2,), bits)


def test_stochastic_noise_is_on_the_8_bit_grid():
  r = aqtr.Stochastic()
  assert r.stochastic
  u = np.asarray(r.noise(jax.random.key(0), (40, 50)))
  assert u.shape == (40, 50) and u.dtype == np.float32
  np.testing.assert_array_equal(
    u, rounding.uniform_grid(jax.random.key(0), (40, 50), 8)
  )


def test_noise_is_deterministic_per_key():
  r = aqtr.Stochastic()
  a = r.noise(jax.random.key(3), (4, 5))
  b = r.noise(jax.random.key(3), (4, 5))
  c = r.noise(jax.random.key(4), (4, 5))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_noise_sharing_axes_broadcast_one_draw():
  r = aqtr.Stochastic(noise_sharing_axes=(0, -1))
  u = np.asarray(r.noise(jax.random.key(5), (3, 4, 5)))
  np.testing.assert_array_equal(u, np.broadcast_to(u[:1, :, :1], u.shape))
  assert np.unique(u[0, :, 0]).size == 4


def test_noise_errors_name_the_problem():
  with pytest.raises(ValueError, match='key'):
    aqtr.Stochastic().noise(None, (2,))
  with pytest.raises(ValueError, match='noise_sharing_axes has axis 2'):
    aqtr.Stochastic(noise_sharing_axes=(2,)).noise(jax.random.key(0), (2, 3))
  with pytest.raises(TypeError, match='noise_sharing_axes'):
    aqtr.Stochastic(noise_sharing_axes=[0])
  with pytest.raises(TypeError, match='noise_sharing_axes'):
    aqtr.Stochastic(noise_sharing_axes=(True,))


def test_stochastic_config_is_frozen_and_hashable():
  r = aqtr.Stochastic(noise_sharing_axes=(1,))
  assert r == aqtr.Stochastic(noise_sharing_axes=(1,))
  assert hash(r) == hash(aqtr.Stochastic(noise_sharing_axes=(1,)))
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.noise_sharing_axes = ()


def test_as_typed_key_accepts_typed_and_raw_keys():
  typed = jax.random.key(7)
  assert rounding.as_typed_key(typed) is typed
  raw = jax.random.PRNGKey(7)
  wrapped = rounding.as_typed_key(raw)
  assert jnp.issubdtype(wrapped.dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(
    jax.random.key_data(wrapped), jax.random.key_data(typed)
  )
  np.testing.assert_array_equal(
    jax.random.uniform(wrapped, (3,)), jax.random.uniform(typed, (3,))
  )
  # a numpy raw key works too
  assert rounding.as_typed_key(np.asarray(raw)) is not None
  assert rounding.as_typed_key(None) is None


@pytest.mark.parametrize(
  'bad',
  [jnp.zeros(3), jnp.zeros((2,), jnp.int32), jnp.zeros((4,), jnp.uint32)],
)
def test_as_typed_key_rejects_other_arrays(bad):
  with pytest.raises(TypeError, match='key must be None, a typed PRNG key'):
    rounding.as_typed_key(bad)


def test_rounding_is_a_base_class():
  assert issubclass(aqtr.Stochastic, aqtr.Rounding)
  assert issubclass(aqtr.NearestEven, aqtr.Rounding)
  with pytest.raises(TypeError):
    aqtr.Rounding()
