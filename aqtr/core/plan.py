"""The plan of one quantized dot: every static fact, computed once.

`aqtr.dot_general` checks its arguments and builds one `Plan` (frozen,
hashable: a static argument of the custom VJP). Everything downstream
(the forward pass, the one backward routine, `aqtr.state.init`,
`quantize_operand`, the freezers' calls) reads the plan instead of
recomputing a layout or a tile:

  layout     each operand's batch / free / contraction axes (`DotLayout`)
  forms      the canonical form each forward operand is quantized in:
             lhs 'fk' [B, M, K]; rhs its natural form ([B, N, K] 'fk' or
             [B, K, N] 'kf'), or a stored QTensor's own
  tiles      the tile size along each pass's contraction (fwd: K;
             dlhs: N; drhs: M), None when untiled
  reuse      whether a backward pass reuses the forward quantization of
             its residual operand (`use_fwd_quant`, or a stored QTensor)
  views      each slot's tiled-view shape (calibration state shapes)
  sharding   the operands' varying manual axes (shard_map) and the
             PartitionSpecs of `quantized_gather` operands

Example:
  >>> import jax, aqtr
  >>> x = jax.ShapeDtypeStruct((4, 64), 'float32')
  >>> w = jax.ShapeDtypeStruct((64, 8), 'float32')
  >>> p = Plan.create(x, w, (((1,), (0,)), ((), ())), aqtr.presets.int8())
  >>> p.rhs.form, p.view(Slot.FWD_RHS), p.view(Slot.DRHS_LHS)
  ('kf', (1, 1, 64, 8), (1, 1, 4, 8))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.core.config import DotGeneralConfig, TensorConfig
from aqtr.core.dimension_numbers import (
  RAGGED,
  DotLayout,
  OperandLayout,
  is_ragged,
  ragged_layout,
)
from aqtr.core.geometry import check_ragged
from aqtr.core.qtensor import QTensor, view_shape
from aqtr.core.sharding import gather_specs, vma_of
from aqtr.core.slots import SIDES, Pass, Side, Slot


@dataclasses.dataclass(frozen=True)
class OperandPlan:
  """One forward operand of the dot.

  Attributes:
    layout: its batch / free / contraction axes and shape.
    form: the canonical form its forward quantization is kept in.
    dtype: its float dtype (a stored QTensor: its scale's).
    stored: whether it is a stored QTensor (frozen: no gradient).
    reused: whether its forward quantization is the residual of the
      other operand's gradient pass (instead of the float operand).
    vma: the manual mesh axes it varies along under shard_map.
    gather: its PartitionSpec entries when `quantized_gather` applies.
  """

  layout: OperandLayout
  form: str
  dtype: np.dtype
  stored: bool = False
  reused: bool = False
  vma: frozenset = frozenset()
  gather: tuple | None = None

  @property
  def struct(self) -> jax.ShapeDtypeStruct:
    """Shape and dtype as the user sees the operand."""
    return jax.ShapeDtypeStruct(self.layout.shape, self.dtype)

  @property
  def free_shape(self) -> tuple[int, ...]:
    return tuple(self.layout.shape[a] for a in self.layout.free)


def _struct(x) -> tuple[tuple[int, ...], np.dtype]:
  if isinstance(x, QTensor):
    return x.layout.shape, np.dtype(x.scale.dtype)
  return tuple(jnp.shape(x)), np.dtype(jnp.result_type(x))


def common_tile(configs, k: int, names=('lhs', 'rhs')) -> int | None:
  """The one tile size the quantized configs ask for along K (None: none).

  Args:
    configs: TensorConfigs (or None) of the operands of one dot.
    k: the size of the contraction.
    names: how to name each operand in errors.
  """
  tiles = set()
  for name, c in zip(names, configs, strict=False):
    if c is not None and c.quantized:
      try:
        tiles.add(c.tiling.tile(k))
      except ValueError as e:  # Name the operand whose tiling refused K.
        raise ValueError(f'{name}: {e}') from e
  tiles -= {None}
  if len(tiles) > 1:
    raise ValueError(
      f'the lhs and rhs tilings ask for different tile sizes {sorted(tiles)} '
      f'along the same contraction of size {k}; use one tile size.'
    )
  return tiles.pop() if tiles else None


@dataclasses.dataclass(frozen=True)
class Plan:
  """Every static fact of one quantized dot (see the module docstring).

  Attributes:
    config: the DotGeneralConfig.
    lhs, rhs: the forward operands' `OperandPlan`s.
    fwd_tile: the forward tile size along K, or None.
    transposed_lhs: whether the forward pass also writes q_L^T [B, K, M]
      for a drhs that emits [K, N] weights from it.
    precision, preferred: as in `lax.dot_general` (preferred: a dtype or
      None).
    ragged: the ragged geometry (`aqtr.ragged_dot`, dimension numbers
      `RAGGED`): rhs [G, K, N] holds one matrix per group, the batch axis
      G, whose segments of the lhs rows [M, K] come from the group sizes
      (`core.geometry`).
  """

  config: DotGeneralConfig
  lhs: OperandPlan
  rhs: OperandPlan
  fwd_tile: int | None = None
  transposed_lhs: bool = False
  precision: Any = None
  preferred: np.dtype | None = None
  ragged: bool = False

  @classmethod
  def create(
    cls,
    lhs,
    rhs,
    dimension_numbers,
    config: DotGeneralConfig,
    precision=None,
    preferred=None,
  ) -> Plan:
    """The plan of `dot_general(lhs, rhs, dimension_numbers, config)`.

    `lhs`, `rhs` are arrays, ShapeDtypeStructs or stored QTensors;
    `dimension_numbers` `RAGGED` plans a ragged dot (`aqtr.ragged_dot`).
    """
    (ls, ld), (rs, rd) = _struct(lhs), _struct(rhs)
    ragged = is_ragged(dimension_numbers)
    if ragged:
      lay = ragged_layout(ls, rs, dimension_numbers)
    else:
      lay = DotLayout.create(ls, rs, dimension_numbers)
    fwd = config.fwd
    tile = common_tile([fwd.lhs, fwd.rhs], lay.lhs.k)
    specs = (not ragged and gather_specs(lhs, rhs, fwd)) or (None, None)
    ops = {}
    for side, x, layout, dtype in (
      (Side.LHS, lhs, lay.lhs, ld),
      (Side.RHS, rhs, lay.rhs, rd),
    ):
      stored = isinstance(x, QTensor)
      if stored:
        form = x.form
      else:
        form = 'fk' if side is Side.LHS else layout.natural_form()
      grad = getattr(config, side.other.grad_pass.value)
      quantized = Slot.forward(side).tensor(config).quantized
      ops[side] = OperandPlan(
        layout=layout,
        form=form,
        dtype=dtype,
        stored=stored,
        reused=quantized and (grad.use_fwd_quant or stored),
        vma=frozenset() if stored else vma_of(x),
        gather=specs[0 if side is Side.LHS else 1],
      )
    transposed = (
      not ragged
      and ops[Side.LHS].reused
      and not ops[Side.RHS].stored
      and ops[Side.RHS].form == 'kf'
      and config.drhs.quantized
    )
    plan = cls(
      config=config,
      lhs=ops[Side.LHS],
      rhs=ops[Side.RHS],
      fwd_tile=tile,
      transposed_lhs=transposed,
      precision=precision,
      preferred=None if preferred is None else np.dtype(preferred),
      ragged=ragged,
    )
    if ragged:
      check_ragged(plan, backward=False)
    return plan

  # ------------------------------------------------------------- reading

  def operand(self, side: Side) -> OperandPlan:
    return self.lhs if side is Side.LHS else self.rhs

  @property
  def layout(self) -> DotLayout:
    return DotLayout(self.lhs.layout, self.rhs.layout)

  @property
  def dimension_numbers(self):
    """lax's dimension numbers of the dot (ragged: `RAGGED`)."""
    return RAGGED if self.ragged else self.layout.dimension_numbers

  @property
  def out_shape(self) -> tuple[int, ...]:
    return self.layout.out_shape

  @property
  def stored(self) -> bool:
    return self.lhs.stored or self.rhs.stored

  @property
  def quantizes_forward(self) -> bool:
    """Whether the forward dot runs on quantized (or stored) operands, or
    on rotated ones (a forward transform)."""
    fwd = self.config.fwd
    quantized = fwd.lhs.quantized or fwd.rhs.quantized
    return quantized or fwd.lhs.rotated or self.stored

  @property
  def out_dtype(self) -> np.dtype:
    if self.preferred is not None:
      return self.preferred
    floats = [o.dtype for o in (self.lhs, self.rhs) if not o.stored]
    return np.dtype(jnp.result_type(*floats) if floats else jnp.float32)

  def tensor(self, slot: Slot) -> TensorConfig:
    return slot.tensor(self.config)

  # --------------------------------------------------- the backward passes

  def partner(self, side: Side) -> OperandPlan:
    """The residual operand of the pass differentiating `side`."""
    return self.operand(side.other)

  def grad_form(self, side: Side) -> str:
    """The form the gradient of `side` is emitted in (its forward form)."""
    return self.operand(side).form

  def tile(self, pass_: Pass) -> int | None:
    """The tile size along `pass_`'s contraction (raises naming the slot).

    fwd contracts K; the pass differentiating side X contracts the free
    axes of its partner Y (dlhs: N, drhs: M).
    """
    if pass_ is Pass.FWD:
      return self.fwd_tile
    side = Side.LHS if pass_ is Pass.DLHS else Side.RHS
    y = self.partner(side)
    raw = getattr(self.config, pass_.value)
    cfgs = [raw.lhs, None if self.reuses(side) else raw.rhs]
    names = [Slot.of(pass_, s).path for s in SIDES]
    axis = 'N' if pass_ is Pass.DLHS else 'M'
    k = y.layout.f
    where = (
      f'the {pass_.value} gradient dot contracts {axis}={k}, the free size '
      f'of the forward {side.other.value}'
    )
    for name, c in zip(names, cfgs, strict=True):
      block = None if c is None else c.numerics.block_size
      if c is not None and c.quantized and block and k % block:
        raise ValueError(
          f'{name}: {type(c.numerics).__name__} has fixed blocks of {block} '
          f'along the contraction, but {where}, which {block} does not '
          f'divide; use shapes whose {axis} is a multiple of {block}, or '
          f'other numerics for config.{name}.'
        )
    try:
      return common_tile(cfgs, k, names)
    except ValueError as e:
      raise ValueError(f'{e} ({where}).') from None

  def grad_copies(self, side: Side) -> int:
    """Copies of g the pass differentiating `side` runs on: one per tile
    of the reused partner (its scales differ per tile), else 1."""
    y = self.partner(side)
    if not self.reuses(side):
      return 1
    return y.layout.k // (self.fwd_tile or y.layout.k)

  def check_transforms(self, backward: bool = True) -> None:
    """Raises naming the slot when a pass's transform does not fit its
    contraction (fwd: K, dlhs: N, drhs: M); `backward=False`: fwd only
    (a call checks its forward, the backward rule its gradient passes, so
    that a serving forward never fails on a gradient pass's sizes)."""
    self.config.fwd.transform.check_size(
      self.lhs.layout.k, f'config.{Slot.FWD_LHS.path}.transform'
    )
    if not backward:
      return
    for side in SIDES:
      pass_ = side.grad_pass
      t = getattr(self.config, pass_.value).transform
      t.check_size(
        self.partner(side).layout.f,
        f'config.{Slot.of(pass_, Side.LHS).path}.transform',
      )

  def reuses(self, side: Side) -> bool:
    """Whether the pass differentiating `side` contracts the partner's
    forward quantization as it is (reused or stored, and not rotated: a
    rotating pass requantizes the rotated partner, a stored one from its
    dequantized values)."""
    raw = getattr(self.config, side.grad_pass.value)
    return self.partner(side).reused and not raw.transform.transforms

  def canonical_shape(self, slot: Slot) -> tuple[int, int, int]:
    """The canonical 3-D shape of the operand in `slot`."""
    if slot.is_forward:
      op = self.operand(slot.side)
      return op.layout.canonical_shape(op.form)
    side = Side.LHS if slot.pass_ is Pass.DLHS else Side.RHS
    y = self.partner(side)
    if slot.is_gradient:  # g: [B*n, M, N]; K of this dot is Y's free axis.
      lay = self.layout
      return (lay.lhs.b * self.grad_copies(side), lay.lhs.f, lay.rhs.f)
    return y.layout.canonical_shape(y.form)  # A requantized residual.

  def form(self, slot: Slot) -> str:
    """The form the operand in `slot` is quantized in."""
    if slot.is_forward:
      return self.operand(slot.side).form
    if slot.is_gradient:  # dlhs contracts g's N (last), drhs its M.
      return 'fk' if slot.pass_ is Pass.DLHS else 'kf'
    side = Side.LHS if slot.pass_ is Pass.DLHS else Side.RHS
    return 'kf' if self.partner(side).form == 'fk' else 'fk'

  def view(self, slot: Slot) -> tuple[int, int, int, int]:
    """The tiled-view shape the operand in `slot` is quantized in."""
    return view_shape(
      self.canonical_shape(slot), self.form(slot), self.tile(slot.pass_)
    )
