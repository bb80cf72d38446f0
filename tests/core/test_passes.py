"""The tile sum of the sub-channel dots (`aqtr.core.passes.tile_sum`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqtr.core import passes


@pytest.mark.parametrize('n', [1, 2, 7, 32, 33, 70])
def test_tile_sum_is_the_sum_over_tiles(n):
  x = jax.random.normal(jax.random.key(n), (2, n, 5, 3))
  got = jax.jit(passes.tile_sum)(x)
  assert got.shape == (2, 5, 3)
  np.testing.assert_allclose(got, x.sum(axis=1), rtol=1e-5, atol=1e-5)
  ints = jnp.arange(2 * n * 15).reshape(2, n, 5, 3)
  np.testing.assert_array_equal(passes.tile_sum(ints), ints.sum(axis=1))


@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 host devices')
def test_under_a_mesh_it_is_sum_itself():
  x = jax.random.normal(jax.random.key(0), (1, 40, 4, 4))
  mesh = jax.make_mesh((2,), ('k',))
  with jax.set_mesh(mesh):
    got = jax.jit(passes.tile_sum)(x)
  np.testing.assert_array_equal(got, jax.jit(lambda x: x.sum(axis=1))(x))


def _dots(f, *args) -> list[str]:
  text = jax.jit(f).lower(*args).compile().as_text()
  return [line for line in text.splitlines() if ' dot(' in line]


def test_a_one_row_int8_dot_runs_as_two_rows_and_is_exact():
  # Decoding at batch 1: XLA:CPU would emit the one-row integer dot as a
  # slow loop; the engine adds a zero row. Integer sums: exact.
  import aqtr

  cfg = aqtr.presets.int8()
  dn = (((1,), (0,)), ((), ()))
  w = jax.random.normal(jax.random.key(0), (64, 48))
  q = aqtr.quantize_operand(w, dn, cfg, operand='rhs')
  x = jax.random.normal(jax.random.key(1), (3, 64))
  got = jax.jit(lambda x, q: aqtr.dot_general(x, q, dn, cfg))(x[:1], q)
  rows = jax.jit(lambda x, q: aqtr.dot_general(x, q, dn, cfg))(x, q)
  np.testing.assert_array_equal(got, rows[:1])
  if jax.default_backend() == 'cpu':
    dots = _dots(lambda x, q: aqtr.dot_general(x, q, dn, cfg), x[:1], q)
    assert dots and all('s32[2,48]' in d for d in dots), dots
