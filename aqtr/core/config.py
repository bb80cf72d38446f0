"""The frozen config tree: DotGeneralConfig > DotGeneralRaw > TensorConfig.

  DotGeneralConfig
    fwd:  DotGeneralRaw   out    = lhs . rhs
    dlhs: DotGeneralRaw   d lhs  = g . rhs_residual   (its lhs operand is g)
    drhs: DotGeneralRaw   d rhs  = g . lhs_residual   (its lhs operand is g)
  DotGeneralRaw:  lhs, rhs: TensorConfig; use_fwd_quant; accumulator
  TensorConfig:   numerics, calibration, tiling, sparsity, rounding,
                  transform

Every node is a frozen kw-only dataclass with defaults, hence hashable: a
config is a static argument of `jit` and of the engine's VJP. The
defaults are int8 symmetric, per-channel absmax, no sparsity,
round-to-nearest-even and no freezer, built by registry name
('int_symmetric', 'absmax', 'per_channel', 'none'): the core imports no
concrete algorithm.
Validation happens at construction and names the field and the fix.

Example:
  >>> from aqtr import numerics
  >>> cfg = TensorConfig(numerics=numerics.NoNumerics())
  >>> cfg.quantized
  False
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from aqtr.core import markers
from aqtr.core.algorithms import Calibration, Numerics, Sparsity, Tiling
from aqtr.core.registry import factory, family
from aqtr.core.rounding import NearestEven, Rounding
from aqtr.core.slots import Slot

_ACCUMULATORS = ('auto', 'int32', 'float32')


def _check_type(owner: str, field: str, value, cls: type) -> None:
  if not isinstance(value, cls):
    raise TypeError(
      f'{owner}.{field} must be an instance of {cls.__module__}.'
      f'{cls.__qualname__}, got {value!r}.'
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorConfig:
  """How one operand of one dot is quantized.

  Attributes:
    numerics: the number format ('none' leaves the operand in float).
    calibration: how the bound of each scale group is found.
    tiling: which elements share a scale.
    sparsity: which elements are kept (zeroed before quantization; 'none'
      keeps all). Forward operands only, see `DotGeneralConfig`.
    rounding: NearestEven() or Stochastic(...) (needs a key at call time).
    transform: an `aqtr.transforms.Transform` ('none' by default): an
      orthogonal R applied along the contraction of this operand's pass
      before quantization, to both operands of the pass (so both sides of
      a pass must name the same transform). A rotating backward pass
      requantizes its residual (`use_fwd_quant=False`); the NVFP4 recipe
      rotates the wgrad GEMM's inputs, `drhs.lhs` and `drhs.rhs`. A
      rotating forward pass (Quartet, arXiv 2505.14669) quantizes x R and
      R^T w: a frozen weight is stored rotated and SERVE rotates the
      activation alike; R must be fixed (not drawn from a key), no
      backward pass reuses the forward quantization, and the gradient
      passes straight through unmasked (no clip_gradient, learned
      calibration or sparsity on a rotated forward operand).
    freezer: an `aqtr.freezers.Freezer`: what a model stores of this
      operand for serving (only config.fwd operands are frozen).
    quantized_gather: forward operands under explicit mesh axes: quantize
      on the devices that hold the operand's shards, so the all-gather the
      dot needs (FSDP weights) moves the quantized values and scales (int8:
      a quarter of the f32 bytes) instead of the float operand. The values
      are unchanged; without a sharded operand it does nothing.
  """

  numerics: Annotated[Numerics, markers.Numerics] = dataclasses.field(
    default_factory=factory('numerics', 'int_symmetric')
  )
  calibration: Annotated[Calibration, markers.Calibration] = dataclasses.field(
    default_factory=factory('calibrations', 'absmax')
  )
  tiling: Annotated[Tiling, markers.Tiling] = dataclasses.field(
    default_factory=factory('tilings', 'per_channel')
  )
  sparsity: Annotated[Sparsity, markers.Sparsity] = dataclasses.field(
    default_factory=factory('sparsity', 'none')
  )
  rounding: Annotated[Rounding, markers.Rounding] = dataclasses.field(
    default_factory=NearestEven
  )
  transform: object = dataclasses.field(
    default_factory=factory('transforms', 'none')
  )
  freezer: object = dataclasses.field(
    default_factory=factory('freezers', 'none')
  )
  quantized_gather: bool = False

  def __post_init__(self):
    if not isinstance(self.quantized_gather, bool):
      raise TypeError(
        'TensorConfig.quantized_gather must be a bool, got '
        f'{self.quantized_gather!r}.'
      )
    _check_type('TensorConfig', 'numerics', self.numerics, Numerics)
    _check_type('TensorConfig', 'calibration', self.calibration, Calibration)
    _check_type('TensorConfig', 'tiling', self.tiling, Tiling)
    _check_type('TensorConfig', 'sparsity', self.sparsity, Sparsity)
    _check_type('TensorConfig', 'rounding', self.rounding, Rounding)
    transform_base = family('transforms').base
    _check_type('TensorConfig', 'transform', self.transform, transform_base)
    freezer_base = family('freezers').base
    _check_type('TensorConfig', 'freezer', self.freezer, freezer_base)
    if self.numerics.quantizes:
      self.numerics.check_rounding(self.rounding)
      self.numerics.check_operand(self.calibration, self.tiling)

  @property
  def quantized(self) -> bool:
    return self.numerics.quantizes

  @property
  def sparse(self) -> bool:
    """Whether the sparsity prunes (anything but 'none')."""
    return self.sparsity.prunes

  @property
  def rotated(self) -> bool:
    """Whether the transform rotates (anything but 'none')."""
    return self.transform.transforms


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotGeneralRaw:
  """One quantized dot: how its lhs and rhs operands are quantized.

  Attributes:
    lhs: quantization of the lhs operand (in dlhs/drhs: the gradient g).
    rhs: quantization of the rhs operand (in dlhs/drhs: the residual).
    use_fwd_quant: backward passes only. Reuse the forward quantization of
      the residual operand (its forward scale is folded into g) instead of
      quantizing the float residual again; `rhs` is then unused. With
      unquantized numerics this makes the gradient that of the fake-quant
      forward (g . dequant(Y)).
    accumulator: 'auto' (int32 for int x int, else float32), 'int32' (both
      operands integer) or 'float32'.
  """

  lhs: TensorConfig = dataclasses.field(default_factory=TensorConfig)
  rhs: TensorConfig = dataclasses.field(default_factory=TensorConfig)
  use_fwd_quant: Annotated[bool, markers.UseFwdQuant] = False
  accumulator: Annotated[str, markers.Accumulator] = 'auto'

  def __post_init__(self):
    _check_type('DotGeneralRaw', 'lhs', self.lhs, TensorConfig)
    _check_type('DotGeneralRaw', 'rhs', self.rhs, TensorConfig)
    if not isinstance(self.use_fwd_quant, bool):
      raise TypeError(
        f'DotGeneralRaw.use_fwd_quant must be a bool, got '
        f'{self.use_fwd_quant!r}.'
      )
    if self.accumulator not in _ACCUMULATORS:
      raise ValueError(
        f'DotGeneralRaw.accumulator must be one of {_ACCUMULATORS}, got '
        f'{self.accumulator!r}.'
      )
    if self.accumulator == 'int32':
      for side in ('lhs', 'rhs'):
        n = getattr(self, side).numerics
        if side == 'rhs' and self.use_fwd_quant:
          continue
        if not (n.quantizes and n.kind == 'int'):
          raise ValueError(
            f"DotGeneralRaw.accumulator='int32' needs integer numerics on "
            f'both operands; {side} has {type(n).__name__}. Use '
            "accumulator='auto' or 'float32'."
          )

  @property
  def quantized(self) -> bool:
    return self.lhs.quantized or (self.rhs.quantized and not self.use_fwd_quant)

  @property
  def transform(self):
    """The pass's transform (both operands name the same one)."""
    return self.lhs.transform


def _float_raw(**kw) -> DotGeneralRaw:
  t = TensorConfig(numerics=factory('numerics', 'none')())
  return DotGeneralRaw(lhs=t, rhs=t, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotGeneralConfig:
  """Quantization of a dot_general's forward pass and both gradients.

  Attributes:
    fwd: the forward dot `lhs . rhs`.
    dlhs: the lhs-gradient dot `g . rhs`.
    drhs: the rhs-gradient dot `g . lhs`.

  Example:
    >>> DotGeneralConfig().fwd.lhs.numerics.bits
    8
  """

  fwd: DotGeneralRaw = dataclasses.field(default_factory=DotGeneralRaw)
  dlhs: DotGeneralRaw = dataclasses.field(
    default_factory=lambda: DotGeneralRaw(use_fwd_quant=True)
  )
  drhs: DotGeneralRaw = dataclasses.field(
    default_factory=lambda: DotGeneralRaw(use_fwd_quant=True)
  )

  def __post_init__(self):
    for name in ('fwd', 'dlhs', 'drhs'):
      _check_type('DotGeneralConfig', name, getattr(self, name), DotGeneralRaw)
    if self.fwd.use_fwd_quant:
      raise ValueError(
        'DotGeneralConfig.fwd.use_fwd_quant must be False: only the backward '
        'passes (dlhs, drhs) can reuse the forward quantization.'
      )
    for name in ('dlhs', 'drhs'):
      n = getattr(self, name).lhs.numerics
      if n.quantizes and not n.for_gradients:
        raise ValueError(
          f'DotGeneralConfig.{name}.lhs.numerics: {type(n).__name__} is not '
          f'meant for gradients (the lhs operand of {name}); use int, fp8 or '
          "'none' numerics there."
        )
    _check_sparsity(self)
    _check_transforms(self)
    _check_gather(self)

  @property
  def needs_key(self) -> bool:
    """True when some quantized operand rounds stochastically, or a
    transform draws its rotation from the key."""
    return any(
      (t.quantized and t.rounding.stochastic) or t.transform.needs_key
      for raw in (self.fwd, self.dlhs, self.drhs)
      for t in (raw.lhs, raw.rhs)
    )

  @property
  def is_float(self) -> bool:
    """True when no pass quantizes or prunes (the config equals lax)."""
    fwd_q = self.fwd.lhs.quantized or self.fwd.rhs.quantized
    sparse = self.fwd.lhs.sparse or self.fwd.rhs.sparse
    rotated = any(r.lhs.rotated for r in (self.fwd, self.dlhs, self.drhs))
    return not (
      fwd_q or sparse or rotated or self.dlhs.quantized or self.drhs.quantized
    )


# The residual operand of each backward pass -> the forward operand it is.
RESIDUAL_OF = {Slot.DLHS_RHS: Slot.FWD_RHS, Slot.DRHS_RHS: Slot.FWD_LHS}


def _check_sparsity(cfg: DotGeneralConfig) -> None:
  """Sparsity: forward operands; their residual slots none or the same.

  The mask is made in the forward pass, along the forward contraction, and
  the pruned operand is also the residual of the backward passes: a
  residual slot (dlhs.rhs, drhs.rhs) may repeat the forward sparsity (role
  tags set both) or leave it 'none'. The gradient operand g (dlhs.lhs,
  drhs.lhs) is never pruned.
  """
  for name in ('dlhs', 'drhs'):
    s = getattr(cfg, name).lhs.sparsity
    if s.prunes:
      raise ValueError(
        f'DotGeneralConfig.{name}.lhs.sparsity: {s!r} is on the gradient '
        f'operand g (the lhs of {name}), which cannot be pruned; allowed: '
        "NoSparsity() ('none'). Prune the forward operands (fwd.lhs, fwd.rhs)."
      )
  for slot, fwd_slot in RESIDUAL_OF.items():
    path, fwd_path = slot.path, fwd_slot.path
    s, f = slot.tensor(cfg).sparsity, fwd_slot.tensor(cfg).sparsity
    if s.prunes and s != f:
      raise ValueError(
        f'DotGeneralConfig.{path}.sparsity: {s!r} differs from '
        f'{fwd_path}.sparsity {f!r}; the residual is the pruned forward '
        f"operand: allowed: NoSparsity() ('none') or the same as {fwd_path}."
      )


def _check_fwd_transform(cfg: DotGeneralConfig) -> None:
  """A forward transform: fixed R, plain straight-through gradients.

  The forward quantization is then of the rotated operands: it is not
  reused by the backward passes (their residual is the float operand), it
  must be reproducible when a weight is frozen (no R drawn from a key),
  and the straight-through gradient may not be masked or learned in the
  rotated coordinates (clip_gradient, learned calibrations, sparsity).
  """
  t = cfg.fwd.lhs.transform
  if not t.transforms:
    return
  if t.needs_key:
    raise ValueError(
      f'DotGeneralConfig.{Slot.FWD_LHS.path}.transform: {t!r} draws R '
      'from the key, '
      'but a forward R must be the same at SERVE as when the weight was '
      "frozen; allowed: signs='seed' or 'none'."
    )
  for name in ('dlhs', 'drhs'):
    if getattr(cfg, name).use_fwd_quant:
      raise ValueError(
        f'DotGeneralConfig.{name}.use_fwd_quant=True, but fwd rotates its '
        f'operands ({t!r}), so the forward quantization is of rotated '
        f'values; allowed: False (the residual is the float operand).'
      )
  for slot in (Slot.FWD_LHS, Slot.FWD_RHS):
    tc = slot.tensor(cfg)
    where = f'DotGeneralConfig.{slot.path}'
    if tc.quantized and getattr(tc.numerics, 'clip_gradient', False):
      raise ValueError(
        f'{where}.numerics.clip_gradient=True with a forward transform: '
        'the clip mask would be in the rotated coordinates; allowed: '
        'clip_gradient=False.'
      )
    if tc.quantized and getattr(tc.calibration, 'has_learned', False):
      raise ValueError(
        f'{where}.calibration: {type(tc.calibration).__name__} learns in '
        'the rotated coordinates, which a forward transform does not '
        'support; allowed: a calibration without learned parameters.'
      )
    if tc.sparse:
      raise ValueError(
        f'{where}.sparsity: {tc.sparsity!r} with a forward transform (the '
        "rotation undoes the pruning pattern); allowed: 'none'."
      )


def _check_transforms(cfg: DotGeneralConfig) -> None:
  """Transforms: one R per pass, on both of its operands.

  A pass rotates both of its operands by the same R along its
  contraction, so that the float product is unchanged. A rotating
  backward pass requantizes its residual (a reused forward quantization
  was made without its R); a rotating forward pass: `_check_fwd_transform`.
  """
  for name in ('fwd', 'dlhs', 'drhs'):
    raw = getattr(cfg, name)
    lt, rt = raw.lhs.transform, raw.rhs.transform
    if lt != rt:
      raise ValueError(
        f'DotGeneralConfig.{name}.rhs.transform: {rt!r} differs from '
        f'{name}.lhs.transform {lt!r}; both operands of a dot must be '
        'rotated by the same R: allowed: the same transform on both.'
      )
    if name != 'fwd' and lt.transforms and raw.use_fwd_quant:
      raise ValueError(
        f'DotGeneralConfig.{name}.use_fwd_quant: {name} rotates its '
        f'operands ({lt!r}), so its residual must be rotated and quantized '
        f"afresh; allowed: False, or {name} transforms 'none'."
      )
  _check_fwd_transform(cfg)


def _check_gather(cfg: DotGeneralConfig) -> None:
  """quantized_gather: forward operands; their residual slots off or the
  same (the residual is the forward operand); never the gradient g."""
  for side in ('lhs', 'rhs'):
    t = getattr(cfg.fwd, side)
    if t.quantized_gather and not t.quantized:
      raise ValueError(
        f'DotGeneralConfig.fwd.{side}.quantized_gather=True but its numerics '
        f'{type(t.numerics).__name__} do not quantize: there is nothing to '
        'gather quantized; quantize the operand or set it to False.'
      )
  for name in ('dlhs', 'drhs'):
    if getattr(cfg, name).lhs.quantized_gather:
      raise ValueError(
        f'DotGeneralConfig.{name}.lhs.quantized_gather=True is on the '
        f'gradient operand g (the lhs of {name}), which is never gathered; '
        'set it on the forward operands (fwd.lhs, fwd.rhs) instead.'
      )
  for slot, fwd_slot in RESIDUAL_OF.items():
    path, fwd_path = slot.path, fwd_slot.path
    on = slot.tensor(cfg).quantized_gather
    if on and not fwd_slot.tensor(cfg).quantized_gather:
      raise ValueError(
        f'DotGeneralConfig.{path}.quantized_gather=True but '
        f'{fwd_path}.quantized_gather is False: only forward operands are '
        f'gathered quantized; set it on {fwd_path} (the residual follows).'
      )


def float_config() -> DotGeneralConfig:
  """The all-float config (equals `lax.dot_general` bit for bit)."""
  return DotGeneralConfig(
    fwd=_float_raw(), dlhs=_float_raw(), drhs=_float_raw()
  )
