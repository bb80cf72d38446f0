"""Field markers: fiddle-free names for config fields, in `Annotated[...]`.

A config class marks a field that users select by tag, e.g.
`bits: Annotated[int, markers.Bits] = 8`. The core does not know Fiddle;
`aqtr.tags` gives every marker a Fiddle tag of the same name, so that
`fdl.Config(IntSymmetric)` carries `aqtr.tags.Bits` on its `bits` field.

Example:
  >>> from typing import Annotated, get_args
  >>> get_args(Annotated[int, Bits])[1].__name__
  'Bits'
"""

from __future__ import annotations


class FieldMarker:
  """Base of the markers (the classes themselves are the markers)."""


class Bits(FieldMarker):
  """Bit width of an integer numerics (every operand)."""


class ClipGradient(FieldMarker):
  """Whether a numerics masks the gradient of clipped values."""


class Po2Scale(FieldMarker):
  """Whether a calibration rounds the scale up to a power of two."""


class Numerics(FieldMarker):
  """The numerics slot of every operand (TensorConfig.numerics)."""


class Calibration(FieldMarker):
  """The calibration slot of every operand (TensorConfig.calibration)."""


class Tiling(FieldMarker):
  """The tiling slot of every operand (TensorConfig.tiling)."""


class Sparsity(FieldMarker):
  """The sparsity slot of every operand (TensorConfig.sparsity)."""


class Rounding(FieldMarker):
  """The rounding slot of every operand (TensorConfig.rounding)."""


class UseFwdQuant(FieldMarker):
  """Whether a dot reuses the forward quantization (backward passes)."""


class Accumulator(FieldMarker):
  """The accumulator of a dot ('auto', 'int32', 'float32')."""


MARKERS = (
  Bits,
  ClipGradient,
  Po2Scale,
  Numerics,
  Calibration,
  Tiling,
  Sparsity,
  Rounding,
  UseFwdQuant,
  Accumulator,
)
