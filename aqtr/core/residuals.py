"""What the forward pass keeps for the backward passes: one record a side.

A backward pass that reuses the forward quantization of its residual
operand keeps q and s of it (int8: a quarter of the bytes) instead of the
float operand; a float operand is kept only where a pass needs it. What
is static (shapes, dtypes, forms, stored operands, mesh axes) lives in the
plan, not here.
"""

from __future__ import annotations

import dataclasses

import jax

from aqtr.core.passes import QuantizedOperand
from aqtr.core.slots import Side


@dataclasses.dataclass(frozen=True)
class SideResidual:
  """One forward operand's residuals.

  Attributes:
    x: the float operand (pruned), or None where no pass needs it.
    q: its forward quantization, kept where the other operand's gradient
      pass reuses it (for [K, N] weights' drhs: q_L^T, 'kf'), else None.
    mask: the forward numerics' straight-through gradient mask in the
      operand's layout, or None.
    key: the PRNG key of the pass differentiating this operand, or None.
    decay: the sparsity's SR-STE term `decay * (1 - M) * x` added to its
      gradient (`core.sparsify`), or None.
    learned: a learned calibration's {name: d xhat / d param} in the
      forward view, or None.
  """

  x: jax.Array | None = None
  q: QuantizedOperand | None = None
  mask: jax.Array | None = None
  key: jax.Array | None = None
  decay: jax.Array | None = None
  learned: dict | None = None


jax.tree_util.register_dataclass(
  SideResidual,
  data_fields=[f.name for f in dataclasses.fields(SideResidual)],
  meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class Residuals:
  """Both sides' residuals and the state the call was given.

  Attributes:
    lhs, rhs: the `SideResidual`s.
    state: the call's typed state ({Slot: SlotState}; {} stateless).
    groups: a ragged dot's group sizes [G] (`core.geometry`), else None.
  """

  lhs: SideResidual
  rhs: SideResidual
  state: dict = dataclasses.field(default_factory=dict)
  groups: jax.Array | None = None

  def side(self, side: Side) -> SideResidual:
    return self.lhs if side is Side.LHS else self.rhs


jax.tree_util.register_dataclass(
  Residuals, data_fields=['lhs', 'rhs', 'state', 'groups'], meta_fields=[]
)
