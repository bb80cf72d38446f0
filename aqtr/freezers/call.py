"""One dot call and its forward operands, as the lifecycle and freezers see it.

An adapter op (`aqtr.flax`, `aqtr.pax`) makes one `DotCall` per quantized
`dot_general` and hands it to `aqtr.freezers.lifecycle.run`; the call's
`Plan` (layout, forms, tiles) is made once, and each frozen forward
operand gets an `OperandCall` view of it for its freezer, which asks it
for what it needs: the operand in canonical layout, TRAIN's quantization
of it (`quantize`: the engine's `quantize_planned`, bit for bit), a QTensor
built from stored parts (`qtensor`), or the TensorConfig with a fixed
range (`with_range`).

Errors raised here carry no op name: the adapter adds it at its boundary
(`FreezerError.needs` tells it which hint to append).

Not imported by `aqtr.freezers` (it imports the engine, which imports the
freezer base classes).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from aqtr.calibrations.constant import Constant
from aqtr.core.config import DotGeneralConfig, TensorConfig
from aqtr.core.dimension_numbers import OperandLayout
from aqtr.core.operand import quantize_planned
from aqtr.core.plan import Plan
from aqtr.core.qtensor import QTensor, stored_form
from aqtr.core.slots import Side, Slot


class FreezerError(ValueError):
  """A freezer's error about one operand; `needs` names what would fix it
  ('stats': run CALIBRATE first; None: the message says it)."""

  def __init__(self, message: str, needs: str | None = None):
    super().__init__(message)
    self.needs = needs


@dataclasses.dataclass(frozen=True)
class DotCall:
  """One `dot_general` call of an adapter op.

  Attributes:
    lhs, rhs: the float operands (in SERVE a freezer that does not read
      its operand may get a placeholder of zeros: `Freezer.reads_float`).
    dimension_numbers: of the dot.
    config: its DotGeneralConfig.
    key: PRNG key (stochastic rounding), or None.
    precision, preferred_element_type: as in `lax.dot_general`.
    state: the call's calibration state tree (`aqtr.state`), or None.
    group_sizes: a ragged dot's [G] group sizes (`dimension_numbers` is
      `aqtr.RAGGED`: `aqtr.ragged_dot`'s [M, K] . [G, K, N]), else None.
    out_sharding: the output's sharding (explicit mesh axes need it), or
      None.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> dn = (((1,), (0,)), ((), ()))
    >>> c = DotCall(jnp.ones((2, 4)), jnp.ones((4, 3)), dn, aqtr.presets.int8())
    >>> c.operand('rhs').free_shape, c.operand('rhs').quantize().qvalue.dtype
    ((3,), dtype('int8'))
  """

  lhs: Any
  rhs: Any
  dimension_numbers: Any
  config: DotGeneralConfig
  key: jax.Array | None = None
  precision: Any = None
  preferred_element_type: Any = None
  state: Mapping | None = None
  group_sizes: Any = None
  out_sharding: Any = None

  @functools.cached_property
  def plan(self) -> Plan:
    """The call's plan (made once)."""
    return Plan.create(
      self.lhs,
      self.rhs,
      self.dimension_numbers,
      self.config,
      self.precision,
      self.preferred_element_type,
    )

  def operand(self, side: str | Side) -> OperandCall:
    return OperandCall(self, Side(side))

  def replace(self, **changes) -> DotCall:
    return dataclasses.replace(self, **changes)


# A pytree (arrays as leaves), so `jax.jit(lifecycle.run, static_argnums=1)`
# takes a DotCall.
jax.tree_util.register_dataclass(
  DotCall,
  data_fields=['lhs', 'rhs', 'key', 'state', 'group_sizes'],
  meta_fields=[
    'dimension_numbers',
    'config',
    'precision',
    'preferred_element_type',
    'out_sharding',
  ],
)


@dataclasses.dataclass(frozen=True)
class OperandCall:
  """A forward operand of one `DotCall`, for its freezer.

  Attributes:
    call: the DotCall.
    side_: which operand (`side` is its name, 'lhs' / 'rhs').
  """

  call: DotCall
  side_: Side

  @property
  def side(self) -> str:
    return self.side_.value

  @property
  def slot(self) -> Slot:
    return Slot.forward(self.side_)

  @property
  def x(self):
    return self.call.lhs if self.side_ is Side.LHS else self.call.rhs

  @property
  def layout(self) -> OperandLayout:
    """This operand's batch / free / contraction axes."""
    return self.call.plan.operand(self.side_).layout

  @property
  def tensor(self) -> TensorConfig:
    """This operand's forward TensorConfig (`config.fwd.<side>`)."""
    return self.slot.tensor(self.call.config)

  @property
  def free_shape(self) -> tuple[int, ...]:
    """The sizes of the operand's free (neither batch nor contracted) axes."""
    return self.call.plan.operand(self.side_).free_shape

  @property
  def form(self) -> str:
    """The view the engine keeps this operand's QTensor in ('fk' / 'kf')."""
    return self.call.plan.operand(self.side_).form

  @property
  def tile(self) -> int | None:
    """The dot's tile size along the contraction (None: untiled), as in
    the view of `quantize()`'s values."""
    return self.call.plan.fwd_tile

  def canonical(self) -> jax.Array:
    """The operand as [batch, free, contraction] (each axis group merged)."""
    return self.layout.to_canonical(self.x, 'fk')

  def quantize(self) -> QTensor:
    """TRAIN's forward quantization of the operand (bit for bit)."""
    state = self.call.state or {}
    return quantize_planned(
      jnp.asarray(self.x),
      self.call.plan,
      self.side_,
      key=self.call.key,
      state=state.get(self.slot.path),
      schedule=state.get(self.slot.schedule_path),
    )

  def qtensor(
    self,
    qvalue: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None = None,
  ) -> QTensor:
    """A QTensor of this operand from stored `qvalue`, `scale` (and z).

    They must be in the view `quantize()` returns (`.qvalue`, `.scale`,
    `.zero_point`: None unless the numerics are affine), or, for a 'kf'
    operand, that view with its last two axes swapped (the contraction
    minor, `aqtr.freezers.weights.minor_k`), which the scale's shape tells
    (`aqtr.core.qtensor.stored_form`).
    """
    t = self.tensor.transform if self.tensor.rotated else None
    form = self.form
    if scale is not None:
      form = stored_form(jnp.shape(scale), self.form)
    return QTensor(qvalue, scale, self.layout, form, zero_point, t)

  def over_free(self, b: jax.Array) -> jax.Array:
    """`b` (a scalar, or over the free axes) reshaped to broadcast with x."""
    shape = self.layout.shape
    if jnp.ndim(b) == 0:
      return jnp.reshape(b, (1,) * len(shape))
    free = set(self.layout.free)
    return jnp.reshape(
      b, tuple(d if a in free else 1 for a, d in enumerate(shape))
    )

  def with_range(self, bound: float) -> TensorConfig:
    """This operand's TensorConfig with the fixed range `Constant(bound)`."""
    return dataclasses.replace(self.tensor, calibration=Constant(bound=bound))

  def error(self, message: str, needs: str | None = None) -> FreezerError:
    """An error about this operand (the adapter names the op)."""
    return FreezerError(message, needs)


__all__ = ['DotCall', 'FreezerError', 'OperandCall']
