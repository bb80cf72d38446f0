"""What the quantized dot_general's forward pass keeps for its backward.

`Residuals` (a pytree) and `make_residuals`: a backward pass that reuses
the forward quantization keeps q and s of its residual operand (int8: a
quarter of the bytes) instead of the float operand.
"""

from __future__ import annotations

import dataclasses

import jax

from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import DotLayout
from aqtr.core.passes import PassKeys, QuantizedOperand, struct_of
from aqtr.core.qtensor import QTensor
from aqtr.core.sharding import vma_of

__all__ = [
  'Residuals',
  'drhs_contracts_q_lhs_t',
  'make_residuals',
  'reuses_q_lhs',
]


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
    state: the calibration state tree given to the call ({}: stateless).
    learned_lhs, learned_rhs: learned calibrations' d xhat / d param in
      the forward view, or None.
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
  state: dict = dataclasses.field(default_factory=dict)
  learned_lhs: dict | None = None
  learned_rhs: dict | None = None
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
    'state',
    'learned_lhs',
    'learned_rhs',
  ],
  meta_fields=[
    f'{side}_{f}'
    for f in ('struct', 'stored', 'vma')
    for side in ('lhs', 'rhs')
  ],
)


def reuses_q_lhs(lhs, q_lhs, cfg: DotGeneralConfig) -> bool:
  """Whether drhs reuses the forward quantization of L (not L itself)."""
  quantized = q_lhs is not None and q_lhs.scale is not None
  return quantized and (cfg.drhs.use_fwd_quant or isinstance(lhs, QTensor))


def drhs_contracts_q_lhs_t(lhs, rhs, q_lhs, lay, cfg) -> bool:
  """Whether a quantized drhs on [K, N] weights contracts q_L^T [K, M]."""
  return (
    reuses_q_lhs(lhs, q_lhs, cfg)
    and not isinstance(rhs, QTensor)
    and lay.rhs.natural_form() == 'kf'
    and cfg.drhs.quantized
  )


def make_residuals(
  lhs,
  rhs,
  q_lhs: QuantizedOperand | None,
  q_rhs: QuantizedOperand | None,
  lay: DotLayout,
  cfg: DotGeneralConfig,
  keys: PassKeys,
  q_lhs_t: QuantizedOperand | None = None,
) -> Residuals:
  """Keeps q_L for drhs and q_R for dlhs where they are reused, else L, R.

  A stored QTensor has no float form: its gradient partner always reuses
  it. For [K, N] weights a quantized drhs contracts q_L^T [K, M]
  (`q_lhs_t`, written by the forward pass): it is kept instead of q_L.
  """
  lhs_stored, rhs_stored = isinstance(lhs, QTensor), isinstance(rhs, QTensor)
  reuse_l = reuses_q_lhs(lhs, q_lhs, cfg)
  if q_lhs is not None and q_lhs.scale is None:  # Not quantized.
    q_lhs = None
  if q_rhs is not None and q_rhs.scale is None:
    q_rhs = None
  reuse_r = q_rhs is not None and (cfg.dlhs.use_fwd_quant or rhs_stored)
  kept_l = q_lhs if q_lhs_t is None else q_lhs_t
  return Residuals(
    lhs=None if reuse_l else lhs,
    rhs=None if reuse_r else rhs,
    q_lhs=kept_l.without_mask() if reuse_l else None,
    q_rhs=q_rhs.without_mask() if reuse_r else None,
    mask_lhs=None if q_lhs is None else q_lhs.grad_mask(lay.lhs),
    mask_rhs=None if q_rhs is None else q_rhs.grad_mask(lay.rhs),
    key_dlhs=keys.dlhs,
    key_drhs=keys.drhs,
    lhs_struct=struct_of(lhs),
    rhs_struct=struct_of(rhs),
    lhs_stored=lhs_stored,
    rhs_stored=rhs_stored,
    lhs_vma=frozenset() if lhs_stored else vma_of(lhs),
    rhs_vma=frozenset() if rhs_stored else vma_of(rhs),
  )
