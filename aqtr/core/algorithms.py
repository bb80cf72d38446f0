"""The interfaces the engine calls: Calibration, Numerics, Tiling, Sparsity.

Quantizing one operand (`quantizer.quantize_view`) asks three algorithms,
each from its own registry family (`aqtr.calibrations`, `aqtr.numerics`,
`aqtr.tilings`), which subclass these base types:

  Tiling       which elements of the view [batch, tile, free, k] share
               one scale (and the tile size along the contraction; 2-D
               blocks also share it over `free_block` rows);
  Calibration  bound = calibrate(x, shared axes), one per scale group
               (range calibrations: (lo, hi) = calibrate_range(...));
  Numerics     s = scale_from_bound(bound) (default bound / max_value),
               q = quantize(x / s (+ noise)); asymmetric numerics:
               s = scale_from_range(lo, hi), z = zero_point(lo, s),
               q = quantize(x / s + z (+ noise)).

Before quantizing, the engine keeps a subset of the operand's elements:

  Sparsity     x_s = mask(x, contraction axis) * x (`aqtr.sparsity`).

The families import these from here (through their `base` modules); the
core never imports a concrete algorithm.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Annotated, ClassVar

import jax
import jax.numpy as jnp

from aqtr.core import codecs, markers
from aqtr.core.rounding import Rounding

# ------------------------------------------------------------- calibrations


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration(abc.ABC):
  """Base class of the `calibrations` registry: the bound of a scale group.

  `calibrate` reduces a tensor over the axes that share one scale and
  returns `bound` with those axes kept (size 1). The quantizer then sets
  `s = bound / numerics.max_value` (bound 0 -> s = 1; kept a normal
  float32, see `aqtr.core.scale`), optionally rounded up to a power of two.
  Contract (checked for every registered calibration, under jit, with NaN
  or inf anywhere in a group, and with all-NaN groups): the bound is >= 0,
  and non-finite (NaN or inf) wherever its group holds a non-finite value,
  so NaN/inf inputs surface in the output instead of being clipped away.
  Beware: a jitted `jnp.max` on XLA:CPU may skip NaNs (and return -inf for
  an all-NaN group); map NaN to inf first, or add
  `aqtr.calibrations.nonfinite_guard`.

  Attributes:
    po2_scale: round the scale up to a power of two, `s <- 2^ceil(log2 s)`.
      Then fake quant and the real integer dot agree bit for bit.
  """

  po2_scale: Annotated[bool, markers.Po2Scale] = False

  # Whether `calibrate_range` gives (lo, hi) bounds for asymmetric numerics.
  gives_range: ClassVar[bool] = False

  def __post_init__(self):
    if not isinstance(self.po2_scale, bool):
      raise TypeError(
        f'{type(self).__name__}.po2_scale must be a bool, got '
        f'{self.po2_scale!r}.'
      )

  @abc.abstractmethod
  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """The bound per scale group: `x` reduced over `axes`, keepdims.

    (Named `calibrate` rather than `bound` so that algorithms may have a
    field called `bound`, as `Constant` does.)
    """

  def calibrate_range(
    self, x: jax.Array, axes: Sequence[int]
  ) -> tuple[jax.Array, jax.Array]:
    """(lo, hi) per scale group, keepdims, for asymmetric numerics.

    Only calibrations with `gives_range = True` (e.g. `minmax`) define it.
    """
    raise NotImplementedError(
      f'{type(self).__name__} gives no (lo, hi) range (gives_range=False).'
    )

  def bound_for(
    self, x: jax.Array, axes: Sequence[int], numerics: Numerics
  ) -> jax.Array:
    """The bound for quantizing `x` with `numerics` (the quantizer's call).

    Defaults to `calibrate(x, axes)`; a calibration that searches over the
    quantization error (e.g. `Mse`) overrides it to see the numerics.
    (Named `bound_for`, not `bound`, for the same reason as `calibrate`.)

    Args:
      x: float tensor.
      axes: the axes sharing one scale.
      numerics: the operand's numerics.
    """
    del numerics
    return self.calibrate(x, axes)

  def bound_of_finite(
    self, x: jax.Array, axes: Sequence[int], numerics: Numerics
  ) -> jax.Array:
    """`bound_for(x, axes, numerics)` of an `x` known to be finite.

    The quantizer's call where scale groups span rows (per-tensor tilings
    bound the finite values and flag the rows holding NaN / inf apart): a
    calibration may leave out its non-finite guard there (`AbsMax` does,
    one reduction fewer). Defaults to `bound_for`.

    Args:
      x: float tensor without NaN or inf.
      axes: the axes sharing one scale.
      numerics: the operand's numerics.
    """
    return self.bound_for(x, axes, numerics)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatefulCalibration(Calibration):
  """Base of calibrations that carry state (and maybe learned parameters).

  Subclasses implement `init_state` and `bound_with_state`. Those with
  learned parameters set `has_learned = True` and implement `value_grad`.
  `calibrate(x, axes)` is the bound of a fresh state (absmax by default):
  what `aqtr.state.init` and the stateless contract checks see.
  """

  has_learned: ClassVar[bool] = False
  # Whether init_state reads the operand's values (not only its shape).
  init_from_data: ClassVar[bool] = False

  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    return jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True)

  @abc.abstractmethod
  def init_state(self, x, axes: Sequence[int], numerics: Numerics) -> dict:
    """{'stats': {...}, 'learned': {...}} for operand view `x`.

    Args:
      x: the operand's view, an array (forward operands) or a
        ShapeDtypeStruct (gradient operands: their values are not known).
      axes: the view axes sharing one scale.
      numerics: the operand's numerics.
    """

  @abc.abstractmethod
  def bound_with_state(
    self, x: jax.Array, axes: Sequence[int], numerics: Numerics, state: dict
  ) -> tuple[jax.Array, dict]:
    """(bound, new_state): the bound for `x` and the updated state."""

  def value_grad(
    self, x: jax.Array, s: jax.Array, numerics: Numerics, state: dict
  ) -> tuple[dict, jax.Array]:
    """Learned only: ({name: d xhat/d param per element}, x gradient mask).

    Args:
      x: the float view; s: its scale (bound / max_value); numerics, state.
    """
    raise NotImplementedError(type(self).__name__)

  def grad_scale(self, group_size: int, numerics: Numerics) -> float:
    """Learned only: the factor on the learned parameters' gradient."""
    del group_size, numerics
    return 1.0


def group_shape(shape: Sequence[int], axes: Sequence[int]) -> tuple:
  return tuple(1 if i in axes else d for i, d in enumerate(shape))


# ----------------------------------------------------------------- numerics


@dataclasses.dataclass(frozen=True, kw_only=True)
class Numerics(abc.ABC):
  """Base class of the `numerics` registry: the number format.

  A numerics maps an already scaled float `v = x / s` to stored values `q`
  (int8, fp8, ...) such that `x ~ s * unit * q`. It declares the largest
  magnitude `max_value` the calibration bound is mapped to, the dtype fed
  to the dot and, with `grad_mask`, a straight-through gradient mask.
  Subclasses are frozen kw-only dataclasses; validate in `__post_init__`.
  """

  # False only for the passthrough numerics ('none').
  quantizes: ClassVar[bool] = True
  # Whether `quantize` accepts additive rounding noise (stochastic rounding).
  supports_stochastic_rounding: ClassVar[bool] = False
  # The dot family: 'int' (integer dot, int32 accumulation) or 'float'.
  kind: ClassVar[str] = 'float'
  # Affine numerics: `x ~ s * (q - z)` with s, z from `scale_from_range` and
  # `zero_point`, fed by a range calibration (`Calibration.gives_range`).
  asymmetric: ClassVar[bool] = False
  # False: rejected on the gradient operand (lhs) of the dlhs/drhs passes.
  for_gradients: ClassVar[bool] = True

  @property
  @abc.abstractmethod
  def max_value(self) -> float:
    """The magnitude the calibration bound maps to: `s = bound/max_value`."""

  @property
  def unit(self) -> float:
    """Value of one stored step: `x ~ s * unit * q` (0.5 on half grids)."""
    return 1.0

  @property
  @abc.abstractmethod
  def dtype(self) -> jnp.dtype:
    """The stored dtype of `q`."""

  @property
  def dot_dtype(self) -> jnp.dtype:
    """The dtype `q` is given to the dot in (e.g. int4 is widened to int8)."""
    return self.dtype

  def codec(self) -> codecs.Codec:
    """How frozen values are stored (`aqtr.core.codecs`; default raw)."""
    return codecs.Raw()

  @property
  def block_size(self) -> int | None:
    """Block formats (MX, NVFP4): elements per block along the contraction.

    The operand's tiling must tile the contraction in blocks of this size
    (`check_operand`); None: any tiling.
    """
    return None

  @property
  def emulated(self) -> bool:
    """Whether the dot's dtype only holds this format's values (a block
    format, or a narrower float in a wider container such as fp4 in
    float8_e4m3fn): a contraction over several tiles then runs as one f32
    dot of the dequantized operands (`aqtr.core.passes.contract`)."""
    return self.block_size is not None

  def scale_from_bound(self, bound: jax.Array) -> jax.Array:
    """The scale per group from its calibrated bound (keepdims shape).

    Default: `s = bound / max_value`. Override to constrain the scale (MX:
    a power of two). `aqtr.core.scale` then keeps the stored scale
    `s * unit` normal (an all-zero group gets s = 1, a non-finite bound a
    NaN scale), applies the calibration's `po2_scale`, and the quantizer
    computes `q = quantize(x / s)`.
    """
    return bound / self.max_value

  def scale_from_range(self, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Asymmetric numerics: the scale per group from its (lo, hi)."""
    raise NotImplementedError(f'{type(self).__name__} is not asymmetric.')

  def zero_point(self, lo: jax.Array, s: jax.Array) -> jax.Array:
    """Asymmetric numerics: the zero point per group (float32)."""
    raise NotImplementedError(f'{type(self).__name__} is not asymmetric.')

  @abc.abstractmethod
  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    """Rounds the scaled tensor `v` to stored values of `self.dtype`.

    Args:
      v: the scaled float tensor `x / s`.
      noise: uniform noise in [-1/2, 1/2) for stochastic rounding, or None.
    """

  def grad_mask(self, v: jax.Array) -> jax.Array | None:
    """Straight-through gradient mask for `v`, or None to pass all."""
    del v
    return None

  def check_rounding(self, rounding: Rounding) -> None:
    """Raises ValueError when this numerics cannot round with `rounding`.

    `TensorConfig` calls it at construction. Subclasses with more
    conditions (e.g. an unbiased top bucket) extend it.
    """
    if rounding.stochastic and not self.supports_stochastic_rounding:
      raise ValueError(
        f'TensorConfig.rounding: {type(self).__name__} does not support '
        'stochastic rounding; use NearestEven() or a numerics that does '
        '(int_symmetric, int_asymmetric, fp, fp8).'
      )

  def check_operand(self, calibration: Calibration, tiling: Tiling) -> None:
    """Raises ValueError when this numerics cannot use `calibration` or
    `tiling` (`TensorConfig` calls it at construction).

    Asymmetric numerics need a range calibration; block formats need the
    contraction tiled in their blocks (and the scale not shared across
    rows or batch, except by 2-D blocks).
    """
    if self.asymmetric and not calibration.gives_range:
      raise ValueError(
        f'TensorConfig.calibration: {type(self).__name__} is asymmetric and '
        "needs lo/hi bounds; allowed: 'minmax' (a calibration with "
        f'gives_range=True), got {type(calibration).__name__}.'
      )
    block = self.block_size
    if block is not None and not _tiles_in_blocks(tiling, block):
      raise ValueError(
        f'TensorConfig.tiling: {type(self).__name__} uses blocks of {block} '
        f'along the contraction; allowed: SubChannel(tile_size={block}) or '
        f'Block2d(tile_size={block}, free_size=...), got {tiling!r}.'
      )


def _tiles_in_blocks(tiling: Tiling, block: int) -> bool:
  """Whether `tiling` tiles every contraction in blocks of `block`."""
  if tiling.shared != frozenset({'k'}):
    return False
  try:
    return tiling.tile(block) == block == tiling.tile(3 * block)
  except ValueError:
    return False


# ------------------------------------------------------------------ tilings

# The axes of the 4-D view of an operand in a dot.
ROLES = ('batch', 'tile', 'free', 'k')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiling(abc.ABC):
  """Base class of the `tilings` registry: which elements share one scale.

  In a dot every operand is seen as the 4-D view [batch, tile, free, k]:
  the contraction axes (flattened, in dot order) are split into `tile`
  blocks of `k` elements each (one block when not tiled). A tiling names
  the view axes its scale is shared along (the calibration reduces over
  them) and, for sub-channel tilings, the block size. Scales constant
  along `k` factor out of the integer dot, so every tiling runs the real
  int dot. Stored scales have size 1 along the shared `tile`/`k` axes but
  keep the batch and free axes even when shared (equal values), so a row
  holding NaN/inf can carry a NaN scale (`aqtr.core.scale`).
  """

  # The view axes (a subset of ROLES) that share one scale.
  shared: ClassVar[frozenset[str]]

  @abc.abstractmethod
  def tile(self, k: int) -> int | None:
    """Block size along the flattened contraction size `k`; None: untiled.

    Raises:
      ValueError: when the tiling does not fit `k`.
    """

  def free_block(self, f: int) -> int | None:
    """Rows per scale block along the flattened free size `f` (2-D blocks).

    None (the default): the scale is not shared across rows (unless 'free'
    is in `shared`).
    """
    del f
    return None


# ----------------------------------------------------------------- sparsity


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sparsity(abc.ABC):
  """Base class of the `sparsity` registry: which operand elements are kept.

  Before an operand is quantized, the engine keeps a magnitude-chosen
  subset of its elements and zeroes the rest:

    x_s = M * x,   M = sparsity.mask(x, axis) in {0, 1}

  where `axis` is the contraction (the operand in its canonical layout
  [B, F, K] or [B, K, F], K the contraction axes flattened in dot order).
  The mask is made once, in the forward pass, and `x_s` is the operand in
  every pass it appears in (the forward dot, and the residual of the
  backward dots, whether re-quantized or reused), so `Q(x_s)` is what the
  forward computes, stores and serves.

  Gradient (straight-through, Mishra et al. 2021, arXiv 2104.08378): the
  dense operand gets the gradient of the sparse one,
  `dL/dx = dL/dx_s`; with `decay > 0` (SR-STE, Zhou et al. 2021, arXiv
  2102.04010) the pruned elements are also pulled towards zero:
  `dL/dx = dL/dx_s + decay * (1 - M) * x`.

  Schedule: masks start at `start_step` (before it the operand stays
  dense) and are refreshed every `update_step` steps, held in between.

  Subclasses that prune declare `start_step`, `update_step` and `decay` as
  fields (the class attributes below are the defaults of those that do
  not) and call `check_schedule()` in `__post_init__`.
  """

  # False only for the passthrough sparsity ('none').
  prunes: ClassVar[bool] = True
  # Defaults for subclasses without these fields (no schedule, plain STE);
  # plain class attributes, so a subclass's fields keep their own order.
  start_step = 0
  update_step = 1
  decay = 0.0

  @abc.abstractmethod
  def mask(self, x: jax.Array, axis: int) -> jax.Array:
    """The keep-mask (bool, shaped like `x`) of `x` along `axis`.

    Args:
      x: the operand in a canonical 3-D layout (float32).
      axis: the contraction axis of `x` (1 or 2).
    """

  def check_size(self, k: int) -> None:
    """Raises ValueError when the contraction size `k` does not fit."""
    del k

  def check_schedule(self) -> None:
    """Validates `start_step`, `update_step` and `decay` (one-line errors)."""
    name = type(self).__name__
    for field, low in (('start_step', 0), ('update_step', 1)):
      v = getattr(self, field)
      if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f'{name}.{field} must be an int >= {low}, got {v!r}.')
    d = self.decay
    if (
      isinstance(d, bool)
      or not isinstance(d, (int, float))
      or not (0 <= d < float('inf'))
    ):
      raise ValueError(f'{name}.decay must be a finite float >= 0, got {d!r}.')
