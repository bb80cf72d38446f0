"""Named configs. Every algorithm is an explicit instance in its field.

Presets spell out the whole tree (no field left to a dataclass default) so
Fiddle selectors and tree walkers see every leaf.

Example:
  >>> import aqtr
  >>> aqtr.presets.int8().drhs.lhs.numerics.bits
  8
"""

from __future__ import annotations

from aqtr.calibrations.absmax import AbsMax
from aqtr.calibrations.delayed_scaling import DelayedScaling
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.rounding import NearestEven, Rounding, Stochastic
from aqtr.freezers.base import NoFreezer
from aqtr.numerics.base import Numerics
from aqtr.numerics.fp8 import Fp8
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.none import NoNumerics
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.per_tensor import PerTensor

__all__ = [
  'float',
  'fp8',
  'fp8_delayed',
  'fully_quantized',
  'int4_weight_only',
  'int8',
  'int8_fwd',
  'int8_weight_only',
]


def _t(numerics: Numerics, rounding: Rounding | None = None) -> TensorConfig:
  return TensorConfig(
    numerics=numerics,
    calibration=AbsMax(clip_scale=1.0, po2_scale=False),
    tiling=PerChannel(),
    rounding=rounding or NearestEven(),
    freezer=NoFreezer(),
  )


def _none() -> TensorConfig:
  return _t(NoNumerics())


def _int(bits: int, **kw) -> Numerics:
  return IntSymmetric(
    bits=bits,
    preserve_zero=True,
    preserve_max_val=True,
    clip_gradient=False,
    **kw,
  )


def _raw(lhs: TensorConfig, rhs: TensorConfig, fwd_quant: bool):
  return DotGeneralRaw(
    lhs=lhs, rhs=rhs, use_fwd_quant=fwd_quant, accumulator='auto'
  )


def float() -> DotGeneralConfig:  # The preset's name.
  """No quantization anywhere: `lax.dot_general` bit for bit."""
  return DotGeneralConfig(
    fwd=_raw(_none(), _none(), False),
    dlhs=_raw(_none(), _none(), False),
    drhs=_raw(_none(), _none(), False),
  )


def fully_quantized(
  fwd_bits: int | None = 8,
  bwd_bits: int | None = 8,
  stochastic_rounding: bool = False,
) -> DotGeneralConfig:
  """AQT's fully quantized recipe: int fwd, dlhs and drhs, per-channel absmax.

  The backward passes reuse the forward quantization of the residual operand
  (`use_fwd_quant=True`) and quantize the gradient to `bwd_bits`, with
  stochastic rounding when asked (the call then needs `key=`).

  Args:
    fwd_bits: forward bits (1..8), or None for a float forward.
    bwd_bits: gradient bits (1..8), or None for float backward passes.
    stochastic_rounding: stochastic rounding on the gradient operand.
  """
  fwd = _int(fwd_bits) if fwd_bits is not None else NoNumerics()
  sr = Stochastic(noise_sharing_axes=()) if stochastic_rounding else None
  if bwd_bits is None:
    if stochastic_rounding:
      raise ValueError(
        'fully_quantized: stochastic_rounding needs bwd_bits (1..8), got None.'
      )
    g = _none()
  else:
    g = _t(_int(bwd_bits), sr)
  return DotGeneralConfig(
    fwd=_raw(_t(fwd), _t(fwd), False),
    dlhs=_raw(g, _t(fwd), True),
    drhs=_raw(g, _t(fwd), True),
  )


def int8() -> DotGeneralConfig:
  """int8 forward, dlhs and drhs; per-channel absmax; nearest rounding."""
  return fully_quantized(8, 8, False)


def int8_fwd() -> DotGeneralConfig:
  """int8 forward; float gradients of the quantized forward (STE)."""
  return fully_quantized(8, None, False)


def _weight_only(numerics: Numerics) -> DotGeneralConfig:
  w = _t(numerics)
  return DotGeneralConfig(
    fwd=_raw(_none(), w, False),
    dlhs=_raw(_none(), w, True),
    drhs=_raw(_none(), _none(), True),
  )


def int8_weight_only() -> DotGeneralConfig:
  """int8 rhs (weights) only, per output channel; activations stay float."""
  return _weight_only(_int(8))


def int4_weight_only() -> DotGeneralConfig:
  """int4 rhs (weights) only, stored as int4; activations stay float."""
  return _weight_only(_int(4, storage='int4'))


def fp8() -> DotGeneralConfig:
  """HFP8: e4m3 forward operands, e5m2 gradients, per-channel absmax."""
  e4 = _t(Fp8(dtype_name='float8_e4m3fn', clip_gradient=False))
  e5 = _t(Fp8(dtype_name='float8_e5m2', clip_gradient=False))
  return DotGeneralConfig(
    fwd=_raw(e4, e4, False),
    dlhs=_raw(e5, e4, True),
    drhs=_raw(e5, e4, True),
  )


def fp8_delayed(history_length: int = 16) -> DotGeneralConfig:
  """FP8 with delayed scaling (Peng et al. 2023, arXiv 2310.18313).

  e4m3 weights and activations, e5m2 gradients, each per tensor with the
  bound taken from the max of its last `history_length` amax values
  (`DelayedScaling`); the gradients' histories update in the backward
  passes. Calls need `state=aqtr.state.init(...)`.
  """

  def t(dtype_name):
    return TensorConfig(
      numerics=Fp8(dtype_name=dtype_name, clip_gradient=False),
      calibration=DelayedScaling(
        history_length=history_length, po2_scale=False
      ),
      tiling=PerTensor(),
      rounding=NearestEven(),
      freezer=NoFreezer(),
    )

  e4, e5 = t('float8_e4m3fn'), t('float8_e5m2')
  return DotGeneralConfig(
    fwd=_raw(e4, e4, False),
    dlhs=_raw(e5, e4, True),
    drhs=_raw(e5, e4, True),
  )
