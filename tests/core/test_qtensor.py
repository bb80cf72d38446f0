"""Tests for aqtr.QTensor and the tiled views (aqtr/core/qtensor.py)."""

from __future__ import annotations

import dataclasses

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import aqtr
from aqtr import tilings
from aqtr.core import qtensor as qtensor_lib
from aqtr.core.dimension_numbers import OperandLayout


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
  st.integers(1, 3),
  st.integers(1, 4),
  st.integers(1, 4),
  st.integers(1, 4),
  st.sampled_from(['fk', 'kf']),
)
def test_view_round_trip(b, f, t, n, form):
  k = t * n
  shape = (b, f, k) if form == 'fk' else (b, k, f)
  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  for tile in (None, t):
    v = np.asarray(qtensor_lib.to_view(x, form, tile))
    nt = 1 if tile is None else n
    tt = k if tile is None else t
    assert v.shape == ((b, nt, f, tt) if form == 'fk' else (b, nt, tt, f))
    np.testing.assert_array_equal(qtensor_lib.from_view(v, form), x)


def test_view_tiles_split_k_in_order():
  x = np.arange(2 * 3 * 8).reshape(2, 3, 8)  # [B, F, K]
  v = np.asarray(qtensor_lib.to_view(x, 'fk', 4))  # [B, T, F, t]
  np.testing.assert_array_equal(v[:, 1], x[:, :, 4:])
  xt = x.transpose(0, 2, 1)  # [B, K, F]
  v = np.asarray(qtensor_lib.to_view(xt, 'kf', 4))  # [B, T, t, F]
  np.testing.assert_array_equal(v[:, 1], xt[:, 4:])


def test_role_axes_cover_the_tiling_roles():
  for form in ('fk', 'kf'):
    axes = qtensor_lib.ROLE_AXES[form]
    assert set(axes) == set(tilings.ROLES)
    assert sorted(axes.values()) == [0, 1, 2, 3]


def _qt():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
  return x, aqtr.quantize(x)


def test_qtensor_is_a_pytree():
  x, qt = _qt()
  leaves, treedef = jax.tree_util.tree_flatten(qt)
  assert len(leaves) == 2
  assert leaves[0] is qt.qvalue and leaves[1] is qt.scale
  back = jax.tree_util.tree_unflatten(treedef, leaves)
  assert back.layout == qt.layout and back.form == qt.form
  doubled = jax.tree_util.tree_map(lambda a: a, qt)
  np.testing.assert_array_equal(doubled.dequant(), qt.dequant())


def test_qtensor_crosses_jit_and_dequantizes_inside():
  x, qt = _qt()

  @jax.jit
  def f(qt):
    return qt.dequant(jnp.bfloat16), qt

  dq, same = f(qt)
  assert dq.dtype == jnp.bfloat16 and dq.shape == x.shape
  assert isinstance(same, aqtr.QTensor) and same.layout == qt.layout
  np.testing.assert_array_equal(dq, qt.dequant().astype(jnp.bfloat16))


def test_qtensor_is_frozen():
  _, qt = _qt()
  with pytest.raises(dataclasses.FrozenInstanceError):
    qt.scale = None


def test_dequant_restores_the_original_layout():
  x = jnp.asarray(
    np.random.default_rng(1).standard_normal((4, 3, 5)), jnp.float32
  )
  qt = aqtr.quantize(x, contracting_axes=(0, 2), batch_axes=(1,))
  assert qt.layout == OperandLayout((4, 3, 5), (1,), (0, 2))
  assert qt.qvalue.shape == (3, 1, 1, 20)  # [B, T, F, K], F empty
  dq = np.asarray(qt.dequant())
  assert dq.shape == x.shape
  np.testing.assert_allclose(dq, x, atol=np.abs(x).max() / 127)


def test_dequant_without_scale_is_the_values():
  v = jnp.arange(6.0).reshape(1, 1, 2, 3)
  qt = aqtr.QTensor(v, None, OperandLayout((2, 3), (), (1,)), 'fk')
  np.testing.assert_array_equal(qt.dequant(), np.arange(6.0).reshape(2, 3))
