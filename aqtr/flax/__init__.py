"""Flax adapters (optional extra `flax`): import a submodule explicitly.

  import aqtr.flax.linen       # ops DotGeneral, Einsum, ConvGeneralDilated;
                               # EinsumDense; convert, report, Removed
  import aqtr.flax.nnx         # the same ops as nnx Modules; set_mode,
                               # convert, report; Frozen, Stats, Removed
  import aqtr.flax.checkpoint  # orbax save / restore of serving trees

`aqtr.flax.linen_convert` (re-exported by linen) and `aqtr.flax.common`
hold the conversion and the shared plumbing; the per-mode math is in
`aqtr.freezers.lifecycle`. `import aqtr` never imports flax. Inside this
package `flax` is the real Flax (absolute imports), not `aqtr.flax`.
"""

from aqtr import extras

try:  # Name the extra to install when one is missing.
  import flax  # noqa: F401
except ImportError as e:
  raise extras.missing('flax', 'aqtr.flax', e) from e
