"""Flax convert/serve of affine (int_asymmetric) weights: the zero point."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax_cases import LinenMLP, bitwise, digits

import aqtr
import aqtr.flax.linen as ql
from aqtr.freezers import Mode


def test_int4_asym_weights_serve_bit_identically_with_their_zero_points():
  cfg = aqtr.freezers.configure(
    aqtr.presets.int4_asym_weight_only(group=32), rhs='weights'
  )
  x, _ = digits(16)
  v = jax.jit(LinenMLP(cfg).init)(jax.random.key(0), x)
  trained = jax.jit(LinenMLP(cfg).apply)(v, x)
  serving = ql.convert(LinenMLP(cfg, Mode.CONVERT), v, x)
  leaves = jax.tree_util.tree_leaves_with_path(serving[ql.FROZEN])
  names = {jax.tree_util.keystr(p).split("'")[-2]: a for p, a in leaves}
  assert names['uint4'].dtype == jnp.uint8  # 4-bit codes, two per byte.
  assert names['uint4'].shape[-1] * 2 == names['scale'].shape[-1]
  assert names['zero_point'].shape == names['scale'].shape
  served = jax.jit(LinenMLP(cfg, Mode.SERVE).apply)(serving, x)
  bitwise(served, trained)
