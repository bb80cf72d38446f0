"""Absolute-maximum calibration."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.calibrations.base import Calibration, register
from aqtr.core import prims
from aqtr.core.prims import per_platform

# XLA:CPU hands a float reduction of this many elements or more to its
# reduction library (one kernel each, fast on large operands, but its max
# skips NaN); a smaller one runs as XLA's own loops, two kernels per
# reduction (a reduce-window, then a reduce). The integer max over the
# bits (`prims.abs_max_bits`) is one kernel with the bit cast that feeds
# it, but never the library's: on a 1024 x 1024 operand it runs 2x (rows)
# to 12x (columns) slower than the library's two, so it is taken only
# below this size (measured on jax 0.10.2; either form gives the same
# bits). From 4096 to 32767 values both forms cost about the same alone,
# but a batch-8 decoding step (activations [8, 512] and [8, 2048], KV
# queries, keys and values [8, 8, 1, 64], probabilities [8, 8, 1, 256])
# ran 8-13 % faster with the one kernel (66 fewer of ~320 per step).
LIBRARY_MIN_SIZE = 32768


@register('absmax')
@dataclasses.dataclass(frozen=True, kw_only=True)
class AbsMax(Calibration):
  """bound = clip_scale * max_G |x| (AQT's AbsMaxCalibration).

  With clip_scale < 1 the largest values are clipped; pair it with the
  numerics' clip_gradient. A group holding NaN gets the bound inf (a NaN
  counts as larger than any value). For GPU the float max propagates NaN:
  one reduction. For CPU, an operand of fewer than `LIBRARY_MIN_SIZE`
  values (a decoding step's activations) takes one integer max over its
  bits (`prims.abs_max_bits`: NaN bits lie above inf's; one kernel, the
  fewest for small operands); a larger one takes two reductions that
  XLA:CPU runs in its reduction library, the float max (which skips NaN
  there) and a `sum(x - x)` flag (NaN where the group holds NaN or inf),
  because an integer max is no library kernel and runs 2-12x slower on
  large operands. Every form gives the same bits (the CPU forms flush a
  subnormal float32 max to +0, as XLA:CPU's float max does).

  Attributes:
    clip_scale: multiplier on the absolute maximum, finite and > 0.

  Example:
    >>> import jax.numpy as jnp
    >>> AbsMax(clip_scale=0.5).calibrate(jnp.array([[1., -4.]]), axes=(1,))
    Array([[2.]], dtype=float32)
  """

  clip_scale: float = 1.0

  def __post_init__(self):
    super().__post_init__()
    c = self.clip_scale
    if isinstance(c, bool) or not isinstance(c, int | float):
      raise TypeError(f'AbsMax.clip_scale must be a float, got {c!r}.')
    if not (math.isfinite(c) and c > 0):
      raise ValueError(f'AbsMax.clip_scale must be finite and > 0, got {c}.')

  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    axes = tuple(axes)

    def cpu(x):
      if x.size < LIBRARY_MIN_SIZE:
        # One integer max over the bits: bound and NaN flag at once.
        b = prims.abs_max_bits(x, axes)
        if b is not None:
          return b
      b = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
      # 0 where the group is finite, NaN where it holds a NaN or inf: two
      # plain reductions XLA:CPU runs in one library kernel each (its
      # library max skips NaN; a select before the max would be a pass of
      # its own, writing |x| back).
      flag = jnp.sum(x - x, axis=axes, keepdims=True)
      return prims.where(flag == flag, b, float('inf'))

    def gpu(x):
      # One reduction: XLA:GPU's max propagates NaN (and an inf is its own
      # bound). Two reductions of one operand here became a transposing
      # fusion writing two f32 copies of it (H100, fp8 8192^3: 1.05x ->
      # 1.35x bf16 with one; measured with the max taken in the input's
      # bf16, here of its f32 convert, which fuses into the reduction:
      # equal values, not yet re-timed on a GPU).
      b = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
      return prims.where(b == b, b, float('inf'))

    b = per_platform(x, cpu=cpu, gpu=gpu)
    return b if self.clip_scale == 1.0 else b * self.clip_scale

  def bound_of_finite(self, x, axes, numerics) -> jax.Array:
    """`calibrate` without the non-finite flag (x holds no NaN / inf)."""
    del numerics
    b = jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True)
    return b if self.clip_scale == 1.0 else b * self.clip_scale
