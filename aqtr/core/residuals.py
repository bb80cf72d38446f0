"""The residuals of the quantized dot's custom VJP (`dot_general.py`).

What the forward pass keeps for the two backward passes, as a registered
pytree: arrays are data, shapes/dtypes and flags are static metadata.
"""

from __future__ import annotations

import dataclasses

import jax

from aqtr.core.passes import QuantizedOperand

__all__ = ['Residuals']


@dataclasses.dataclass(frozen=True)
class Residuals:
  """What the forward pass keeps for the backward passes.

  A backward pass that reuses the forward quantization keeps q and s of
  its residual operand instead of the float operand (int8: a quarter of
  the bytes); a float operand is kept only where a pass needs it.

  Attributes:
    lhs, rhs: the float operands L, R, or None where not needed.
    q_lhs: the forward quantization of L for drhs: [B, T, M, t], or
      [B, T, t, M] ('kf', written transposed) for [K, N] weights.
    q_rhs: the forward quantization of R for dlhs.
    mask_lhs, mask_rhs: the forward numerics' straight-through gradient
      masks in the operands' layouts, or None.
    key_dlhs, key_drhs: PRNG keys of the backward passes, or None.
    sr_lhs, sr_rhs: SR-STE terms `decay * (1 - M) * x` added to the
      operands' gradients (`aqtr.core.sparsify`), or None.
    lhs_struct, rhs_struct: the operands' shapes and dtypes (static).
    lhs_stored, rhs_stored: whether the operand is a stored QTensor, which
      gets no gradient (static).
    lhs_vma, rhs_vma: the manual mesh axes the operand varies along under
      `shard_map` (static; empty elsewhere).
  """

  lhs: jax.Array | None = None
  rhs: jax.Array | None = None
  q_lhs: QuantizedOperand | None = None
  q_rhs: QuantizedOperand | None = None
  mask_lhs: jax.Array | None = None
  mask_rhs: jax.Array | None = None
  key_dlhs: jax.Array | None = None
  key_drhs: jax.Array | None = None
  sr_lhs: jax.Array | None = None
  sr_rhs: jax.Array | None = None
  lhs_struct: jax.ShapeDtypeStruct | None = None
  rhs_struct: jax.ShapeDtypeStruct | None = None
  lhs_stored: bool = False
  rhs_stored: bool = False
  lhs_vma: frozenset = frozenset()
  rhs_vma: frozenset = frozenset()


jax.tree_util.register_dataclass(
  Residuals,
  data_fields=[
    'lhs',
    'rhs',
    'q_lhs',
    'q_rhs',
    'mask_lhs',
    'mask_rhs',
    'key_dlhs',
    'key_drhs',
    'sr_lhs',
    'sr_rhs',
  ],
  meta_fields=[
    f'{side}_{f}'
    for f in ('struct', 'stored', 'vma')
    for side in ('lhs', 'rhs')
  ],
)
