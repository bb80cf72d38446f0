"""Flax adapters (optional extra `flax`): import a submodule explicitly.

  import aqtr.flax.linen       # ops DotGeneral, Einsum, ConvGeneralDilated;
                               # EinsumDense; convert
  import aqtr.flax.nnx         # the same ops as nnx Modules; set_mode,
                               # convert; Frozen, Stats
  import aqtr.flax.checkpoint  # orbax save / restore of serving trees

Stock models (no aqtr ops in them) are quantized by rules:
`aqtr.flax.quantize(model, rules)`, `report`, `convert`, `calibrate`,
`set_mode`, `sizes` (`aqtr.flax.quantized`, `aqtr.flax.serving`; the calls are
caught by `aqtr.flax.intercept`, frozen values held as in `aqtr.flax.frozen`
(one container per framework, for every kind); keys and calibration state in
`aqtr.flax.rule_state`, QT params checked by `aqtr.flax.qt_rules`).

`aqtr.flax.linen_convert` (re-exported by linen) holds the conversion;
`aqtr.flax.common` the one op body the linen, nnx and `aqtr.pax` ops
share. What each mode does to an operand is its freezer's
(`aqtr.freezers.Freezer`), routed by `aqtr.freezers.lifecycle`.
`import aqtr` never imports flax. Inside this package `flax` is the real
Flax (absolute imports), not `aqtr.flax`.
"""

from aqtr import extras

try:  # Name the extra to install when one is missing.
  import flax  # noqa: F401
except ImportError as e:
  raise extras.missing('flax', 'aqtr.flax', e) from e

# Interception of stock models (rules): `aqtr.flax.quantize(model, rules)`.
from aqtr.flax.quantized import calibrate, quantize, set_mode  # noqa: E402
from aqtr.flax.serving import convert, report, sizes  # noqa: E402
from aqtr.rules import Rule  # noqa: E402

__all__ = [
  'Rule',
  'calibrate',
  'convert',
  'quantize',
  'report',
  'set_mode',
  'sizes',
]
