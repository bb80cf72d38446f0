"""One forward operand of one dot call, as a freezer sees it.

`aqtr.freezers.lifecycle` builds one `OperandCall` per frozen operand
(the dot's layout is computed once per call) and hands it to the operand's
freezer, which asks it for what it needs: the operand in canonical layout,
TRAIN's quantization of it (`quantize`: the engine's `quantize_operand`,
in the layout made once per call), a QTensor built from stored parts
(`qtensor`), or the TensorConfig with a fixed range (`with_range`).

Not imported by `aqtr.freezers` (it imports the engine, which imports the
freezer base classes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from aqtr.calibrations.constant import Constant
from aqtr.core.config import DotGeneralConfig, TensorConfig
from aqtr.core.dimension_numbers import DotLayout, OperandLayout
from aqtr.core.operand import quantize_in_layout
from aqtr.core.passes import common_tile
from aqtr.core.qtensor import QTensor


@dataclasses.dataclass(frozen=True)
class OperandCall:
  """A forward operand of one `dot_general` call, for its freezer.

  Attributes:
    side: 'lhs' or 'rhs'.
    x: the float operand (in SERVE it may be a placeholder of zeros when
      the freezer does not read it: `Freezer.reads_float`).
    dot: the layout of the whole dot (both operands).
    dimension_numbers: of the dot.
    config: the dot's DotGeneralConfig.
    key: PRNG key of the dot (stochastic rounding), or None.
    where: the adapter op's name, for error messages.
    how_stats: how to produce CALIBRATE statistics, for error messages.
    state: the operand's calibration state ('fwd.<side>' of the call's
      state tree) when its calibration is stateful, else None.
    sparsity_state: its sparsity schedule's state (the stats of
      'fwd.<side>.sparsity'), else None.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> from aqtr.core.dimension_numbers import DotLayout
    >>> dn = (((1,), (0,)), ((), ()))
    >>> x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    >>> c = OperandCall('rhs', w, DotLayout.create(x.shape, w.shape, dn), dn,
    ...                 aqtr.presets.int8())
    >>> c.free_shape, c.quantize().qvalue.dtype
    ((3,), dtype('int8'))
  """

  side: str
  x: Any
  dot: DotLayout
  dimension_numbers: Any
  config: DotGeneralConfig
  key: jax.Array | None = None
  where: str = 'aqtr op'
  how_stats: str = ''
  state: dict | None = None
  sparsity_state: dict | None = None

  @property
  def layout(self) -> OperandLayout:
    """This operand's batch / free / contraction axes."""
    return getattr(self.dot, self.side)

  @property
  def other(self) -> OperandLayout:
    """The other operand's layout."""
    return self.dot.rhs if self.side == 'lhs' else self.dot.lhs

  @property
  def tensor(self) -> TensorConfig:
    """This operand's forward TensorConfig (`config.fwd.<side>`)."""
    return getattr(self.config.fwd, self.side)

  @property
  def free_shape(self) -> tuple[int, ...]:
    """The sizes of the operand's free (neither batch nor contracted) axes."""
    return tuple(self.layout.shape[a] for a in self.layout.free)

  @property
  def form(self) -> str:
    """The view the engine keeps this operand's QTensor in ('fk' / 'kf')."""
    return 'fk' if self.side == 'lhs' else self.layout.natural_form()

  @property
  def tile(self) -> int | None:
    """The dot's tile size along the contraction (None: untiled), as in
    the view of `quantize()`'s values."""
    return common_tile(
      [self.config.fwd.lhs, self.config.fwd.rhs], self.layout.k
    )

  def canonical(self) -> jax.Array:
    """The operand as [batch, free, contraction] (each axis group merged)."""
    return self.layout.to_canonical(self.x, 'fk')

  def quantize(self) -> QTensor:
    """TRAIN's forward quantization of the operand (bit for bit)."""
    return quantize_in_layout(
      jnp.asarray(self.x),
      self.layout,
      self.config,
      operand=self.side,
      key=self.key,
      state=self.state,
      sparsity_state=self.sparsity_state,
    )

  def qtensor(
    self,
    qvalue: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array | None = None,
  ) -> QTensor:
    """A QTensor of this operand from stored `qvalue`, `scale` (and z).

    They must be in the view `quantize()` returns (`.qvalue`, `.scale`,
    `.zero_point`: None unless the numerics are affine).
    """
    return QTensor(qvalue, scale, self.layout, self.form, zero_point)

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

  def error(self, message: str) -> ValueError:
    """A ValueError naming the op and this operand."""
    return ValueError(f'{self.where}: {message}')


__all__ = ['OperandCall']
