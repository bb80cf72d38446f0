"""The six operand slots of a quantized dot: pass x side, as one type.

A `dot_general` runs three dots (passes), each with an lhs and an rhs
operand:

  fwd    out = lhs . rhs
  dlhs   dL  = g . Y_R        (its lhs is the cotangent g, its rhs R)
  drhs   dR  = g . Y_L        (its lhs is g, its rhs L)

so six operands are quantized, each by `config.<pass>.<side>`. `Slot`
names them; `slot.path` ('fwd.lhs', ...) is the one place the user-facing
spelling of a slot is made (state trees, error messages, selectors), and
`Slot.parse` reads it back. A sparsity schedule's state lives at
`slot.schedule_path` ('fwd.rhs.sparsity').

Example:
  >>> Slot.DLHS_LHS.path, Slot.parse('fwd.rhs') is Slot.FWD_RHS
  ('dlhs.lhs', True)
"""

from __future__ import annotations

import enum


class Pass(enum.Enum):
  """One of the three dots of a quantized dot_general."""

  FWD = 'fwd'
  DLHS = 'dlhs'
  DRHS = 'drhs'


class Side(enum.Enum):
  """An operand of a dot (in a backward pass the lhs is the gradient g)."""

  LHS = 'lhs'
  RHS = 'rhs'

  @property
  def other(self) -> Side:
    return Side.RHS if self is Side.LHS else Side.LHS

  @property
  def grad_pass(self) -> Pass:
    """The backward pass that differentiates this forward operand."""
    return Pass.DLHS if self is Side.LHS else Pass.DRHS


class Slot(enum.Enum):
  """A (pass, side) operand slot; ordered fwd.lhs < ... < drhs.rhs."""

  FWD_LHS = (Pass.FWD, Side.LHS)
  FWD_RHS = (Pass.FWD, Side.RHS)
  DLHS_LHS = (Pass.DLHS, Side.LHS)
  DLHS_RHS = (Pass.DLHS, Side.RHS)
  DRHS_LHS = (Pass.DRHS, Side.LHS)
  DRHS_RHS = (Pass.DRHS, Side.RHS)

  @property
  def pass_(self) -> Pass:
    return self.value[0]

  @property
  def side(self) -> Side:
    return self.value[1]

  @property
  def path(self) -> str:
    """The user-facing name, e.g. 'dlhs.lhs'."""
    return f'{self.pass_.value}.{self.side.value}'

  @property
  def schedule_path(self) -> str:
    """Where a forward operand's sparsity schedule lives in a state tree."""
    return f'{self.path}.sparsity'

  @property
  def is_forward(self) -> bool:
    return self.pass_ is Pass.FWD

  @property
  def is_gradient(self) -> bool:
    """The cotangent g: the lhs of a backward pass."""
    return not self.is_forward and self.side is Side.LHS

  def tensor(self, config):
    """This slot's TensorConfig in a DotGeneralConfig."""
    return getattr(getattr(config, self.pass_.value), self.side.value)

  def __lt__(self, other: Slot) -> bool:  # Sorted keys in pytrees.
    return _ORDER[self] < _ORDER[other]

  @classmethod
  def of(cls, pass_: Pass, side: Side) -> Slot:
    return cls((pass_, side))

  @classmethod
  def forward(cls, side: Side) -> Slot:
    return cls((Pass.FWD, side))

  @classmethod
  def parse(cls, path: str) -> Slot:
    """'fwd.lhs' -> Slot.FWD_LHS; a clear error for anything else."""
    for slot in cls:
      if slot.path == path:
        return slot
    raise ValueError(
      f'unknown operand path {path!r}; allowed: {[s.path for s in cls]}.'
    )


_ORDER = {s: i for i, s in enumerate(Slot)}
SIDES = (Side.LHS, Side.RHS)
GRADIENT_SLOTS = (Slot.DLHS_LHS, Slot.DRHS_LHS)
