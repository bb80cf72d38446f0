"""Named configs. Every algorithm is an explicit instance in its field.

Presets spell out the whole tree (no field left to a dataclass default) so
Fiddle selectors and tree walkers see every leaf.

Example:
  >>> import aqtr
  >>> aqtr.presets.int8().drhs.lhs.numerics.bits
  8
"""

from __future__ import annotations

import builtins

from aqtr.calibrations.constant import Constant
from aqtr.calibrations.delayed_scaling import DelayedScaling
from aqtr.calibrations.lsq import Lsq
from aqtr.calibrations.minmax import MinMax
from aqtr.core.arguments import check_flags, check_int
from aqtr.core.config import DotGeneralConfig, TensorConfig
from aqtr.core.rounding import Stochastic
from aqtr.fp4_recipes import mxfp4_training, nvfp4_training
from aqtr.fp8_recipes import deepseek_v3_fp8, maxtext_deepseek_fp8
from aqtr.numerics.base import Numerics
from aqtr.numerics.fp8 import Fp8
from aqtr.numerics.int_asymmetric import IntAsymmetric
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.mx import Mx
from aqtr.numerics.none import NoNumerics
from aqtr.numerics.nvfp4 import NvFp4
from aqtr.preset_parts import operand, raw
from aqtr.sparsity.n_m import NM
from aqtr.tilings.per_tensor import PerTensor
from aqtr.tilings.subchannel import SubChannel

__all__ = [
  'aqt_v4',
  'deepseek_v3_fp8',
  'float',
  'fp8',
  'fp8_delayed',
  'fp8_full',
  'fp8_nanoo',
  'fully_quantized',
  'int4_asym_weight_only',
  'int4_lsq',
  'int4_weight_only',
  'int8',
  'int8_fwd',
  'int8_sparse_2_4',
  'int8_weight_only',
  'maxtext_deepseek_fp8',
  'mxfp4_training',
  'mxfp4_weight_only',
  'mxfp8',
  'nvfp4',
  'nvfp4_training',
  'nvfp4_weight_only',
  'switchback',
  'w4a8',
]


def _none() -> TensorConfig:
  return operand(NoNumerics())


def _int(bits: int, **kw) -> Numerics:
  return IntSymmetric(
    bits=bits,
    preserve_zero=True,
    preserve_max_val=True,
    clip_gradient=False,
    **kw,
  )


def float() -> DotGeneralConfig:  # The preset's name.
  """No quantization anywhere: `lax.dot_general` bit for bit."""
  return DotGeneralConfig(
    fwd=raw(_none(), _none(), False),
    dlhs=raw(_none(), _none(), False),
    drhs=raw(_none(), _none(), False),
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
  check_int('presets.fully_quantized', 'fwd_bits', fwd_bits, 1, 8, none=True)
  check_int('presets.fully_quantized', 'bwd_bits', bwd_bits, 1, 8, none=True)
  check_flags(
    'presets.fully_quantized', stochastic_rounding=stochastic_rounding
  )
  fwd = _int(fwd_bits) if fwd_bits is not None else NoNumerics()
  sr = Stochastic(noise_sharing_axes=()) if stochastic_rounding else None
  if bwd_bits is None:
    if stochastic_rounding:
      raise ValueError(
        'fully_quantized: stochastic_rounding needs bwd_bits (1..8), got None.'
      )
    g = _none()
  else:
    g = operand(_int(bwd_bits), sr)
  return DotGeneralConfig(
    fwd=raw(operand(fwd), operand(fwd), False),
    dlhs=raw(g, operand(fwd), True),
    drhs=raw(g, operand(fwd), True),
  )


def int8() -> DotGeneralConfig:
  """int8 forward, dlhs and drhs; per-channel absmax; nearest rounding."""
  return fully_quantized(8, 8, False)


def int8_fwd() -> DotGeneralConfig:
  """int8 forward; float gradients of the quantized forward (STE)."""
  return fully_quantized(8, None, False)


def int8_sparse_2_4(
  start_step: int = 0, update_step: int = 1, decay: float = 0.0
) -> DotGeneralConfig:
  """`int8` with 2:4 sparse weights: 2 of every 4 along the contraction.

  The weights (fwd.rhs, and their dlhs residual) are pruned to 2:4 by
  magnitude before they are quantized (Mishra et al. 2021, arXiv
  2104.08378); the dense weights get the straight-through gradient, with
  SR-STE's `decay * (1 - M) * w` when `decay > 0` (Zhou et al. 2021, arXiv
  2102.04010). Serve with `aqtr.freezers.SparseWeightsFreezer` to store
  them compressed.

  Args:
    start_step: the first step the mask applies (dense before).
    update_step: steps between mask refreshes (held in between).
    decay: the SR-STE decay (0: plain straight-through).
  """
  check_int('presets.int8_sparse_2_4', 'start_step', start_step, 0)
  check_int('presets.int8_sparse_2_4', 'update_step', update_step, 1)
  cfg = int8()
  nm = NM(
    n=2,
    m=4,
    block=1,
    offset=0,
    start_step=start_step,
    update_step=update_step,
    decay=decay,
  )
  w = operand(_int(8), sparsity=nm)
  return DotGeneralConfig(
    fwd=raw(cfg.fwd.lhs, w, False),
    dlhs=raw(cfg.dlhs.lhs, w, True),
    drhs=cfg.drhs,
  )


def _weight_only(
  numerics: Numerics, lhs: TensorConfig | None = None, **kw
) -> DotGeneralConfig:
  """Quantized weights (rhs); activations `lhs` in the forward only (float
  when None); the backward passes reuse the forward's operands."""
  w = operand(numerics, **kw)
  return DotGeneralConfig(
    fwd=raw(_none() if lhs is None else lhs, w, False),
    dlhs=raw(_none(), w, True),
    drhs=raw(_none(), _none(), True),
  )


def int8_weight_only() -> DotGeneralConfig:
  """int8 rhs (weights) only, per output channel; activations stay float."""
  return _weight_only(_int(8))


def int4_weight_only() -> DotGeneralConfig:
  """int4 rhs (weights) only, stored as int4; activations stay float."""
  return _weight_only(_int(4, storage='int4'))


def w4a8() -> DotGeneralConfig:
  """int4 weights x int8 activations: `int4_weight_only` with int8 rows.

  Forward `y = (q_x q_w) s_x s_w`: x in int8 per row (`q_x = round(x /
  s_x)`, `s_x = max_k |x| / 127`), w in int4 per output column (`s_w =
  max_k |w| / 7`, stored as int4); the dot is int8 x int8 -> int32 on
  the widened codes. On CPU a served model's decoding steps (up to 16
  rows with AVX-512 VNNI, 4 with AVX2) read the int4 codes as stored,
  two a byte (docs/decoding.md, Speed). The backward passes reuse the
  forward's quantized operands, with g in float: dX = g (s_w q_w)^T and
  dW = (s_x q_x)^T g.

  Example:
    >>> cfg = w4a8()
    >>> cfg.fwd.lhs.numerics.bits, cfg.fwd.rhs.numerics.bits
    (8, 4)
  """
  return _weight_only(_int(4, storage='int4'), lhs=operand(_int(8)))


def fp8() -> DotGeneralConfig:
  """HFP8: e4m3 forward operands, e5m2 gradients, per-channel absmax."""
  e4 = operand(Fp8(dtype_name='float8_e4m3fn', clip_gradient=False))
  e5 = operand(Fp8(dtype_name='float8_e5m2', clip_gradient=False))
  return DotGeneralConfig(
    fwd=raw(e4, e4, False),
    dlhs=raw(e5, e4, True),
    drhs=raw(e5, e4, True),
  )


def fp8_nanoo() -> DotGeneralConfig:
  """fp8 for AMD MI300 (MaxText's nanoo_fp8): e4m3fnuz fwd, e5m2fnuz grads.

  As `fp8` with the fnuz formats (exponent bias one higher, e4m3fnuz max
  240), per-channel absmax scales.
  """
  e4 = operand(Fp8(dtype_name='float8_e4m3fnuz', clip_gradient=False))
  e5 = operand(Fp8(dtype_name='float8_e5m2fnuz', clip_gradient=False))
  return DotGeneralConfig(
    fwd=raw(e4, e4, False),
    dlhs=raw(e5, e4, True),
    drhs=raw(e5, e4, True),
  )


def fp8_full(constant_bounds=None) -> DotGeneralConfig:
  """MaxText's fp8_full: all six operands fp8, per tensor, static bounds.

  fwd e4m3 x e4m3; dlhs and drhs requantize both operands to e5m2 (FP8
  formats: Micikevicius et al. 2022, arXiv 2209.05433). Scale s = bound /
  max_value per tensor; bound = the absmax, or the static bound (`Constant`,
  values beyond clip) of `constant_bounds`: None or 6 in MaxText's order
  fwd lhs, fwd rhs, dlhs lhs, dlhs rhs, drhs lhs, drhs rhs (None: absmax).
  """
  b = (None,) * 6 if constant_bounds is None else constant_bounds
  if not (isinstance(b, tuple | list) and len(b) == 6) or any(
    v is not None and (type(v) not in (int, builtins.float) or v <= 0)
    for v in b
  ):
    raise ValueError(
      'presets.fp8_full: constant_bounds must be None or 6 bounds (> 0 or '
      f'None), got {constant_bounds!r}.'
    )

  def t(dtype_name: str, bound) -> TensorConfig:
    cal = None if bound is None else Constant(bound=builtins.float(bound))
    fp = Fp8(dtype_name=dtype_name, clip_gradient=False)
    return operand(fp, tiling=PerTensor(), calibration=cal)

  e4, e5 = 'float8_e4m3fn', 'float8_e5m2'
  return DotGeneralConfig(
    fwd=raw(t(e4, b[0]), t(e4, b[1]), False),
    dlhs=raw(t(e5, b[2]), t(e5, b[3]), False),
    drhs=raw(t(e5, b[4]), t(e5, b[5]), False),
  )


def switchback() -> DotGeneralConfig:
  """SwitchBack (Wortsman et al. 2023, arXiv 2304.13013).

  int8 forward and input gradient, float weight gradient: the inputs x and
  the gradient g are quantized row-wise (per token), the weights
  tensor-wise; dX = g . W reuses the forward int8 weights; dW = g^T . x
  runs in float on the float operands.
  """
  row = operand(_int(8))
  whole = operand(_int(8), tiling=PerTensor())
  return DotGeneralConfig(
    fwd=raw(row, whole, False),
    dlhs=raw(row, whole, True),
    drhs=raw(_none(), _none(), False),
  )


def aqt_v4() -> DotGeneralConfig:
  """AQT's `config_v4`: int8 fwd, int8 dlhs with stochastic rounding.

  fwd: int8 per-channel absmax on both operands; dlhs: the gradient int8
  with stochastic rounding (needs `key=`), the weights quantized again
  to int8; drhs: float (g^T . x on the float operands). After AQT
  (Lew et al. 2022, github.com/google/aqt) and Gupta et al. 2015
  (arXiv 1502.02551) for the rounding.
  """
  q = operand(_int(8))
  g = operand(_int(8), Stochastic(noise_sharing_axes=()))
  return DotGeneralConfig(
    fwd=raw(q, q, False),
    dlhs=raw(g, q, False),
    drhs=raw(_none(), _none(), False),
  )


def mxfp8() -> DotGeneralConfig:
  """MXFP8 (OCP MX v1.0): e4m3 fwd, e5m2 gradients, blocks of 32.

  Every operand of every pass in 32-element blocks with an E8M0 scale
  (the contractions must be multiples of 32); the backward passes reuse
  the forward MXFP8 residuals.
  """
  e4 = operand(Mx(element='fp8_e4m3', clip_gradient=False))
  e5 = operand(Mx(element='fp8_e5m2', clip_gradient=False))
  return DotGeneralConfig(
    fwd=raw(e4, e4, False),
    dlhs=raw(e5, e4, True),
    drhs=raw(e5, e4, True),
  )


def mxfp4_weight_only() -> DotGeneralConfig:
  """MXFP4 (E2M1, blocks of 32, E8M0 scales) weights; float activations."""
  return _weight_only(Mx(element='fp4_e2m1', clip_gradient=False))


def nvfp4_weight_only() -> DotGeneralConfig:
  """NVFP4 (E2M1, blocks of 16, e4m3 x f32 scales) weights; float
  activations (the weights of `nvfp4`, the activations of `float`)."""
  return _weight_only(NvFp4(clip_gradient=False))


def nvfp4() -> DotGeneralConfig:
  """NVFP4 (E2M1, blocks of 16, e4m3 x f32 scales) forward; float grads.

  Both forward operands in NVFP4; the backward passes are float dots of g
  with the dequantized forward operands (straight-through).
  """
  f = operand(NvFp4(clip_gradient=False))
  return DotGeneralConfig(
    fwd=raw(f, f, False),
    dlhs=raw(_none(), f, True),
    drhs=raw(_none(), f, True),
  )


def int4_asym_weight_only(group: int = 128) -> DotGeneralConfig:
  """The common LLM W4 recipe: int4 affine weights in groups, float x.

  Weights: `int_asymmetric` 4 bits (uint8 storage, zero point per group),
  `minmax` range, `group` elements per group along the contraction
  (sub-channel tiles; the contraction must be a multiple of `group`).

  Args:
    group: elements per scale group, an int > 0.
  """
  check_int('presets.int4_asym_weight_only', 'group', group, 1)
  return _weight_only(
    IntAsymmetric(bits=4, storage='uint8', clip_gradient=False),
    tiling=SubChannel(tile_size=group, tile_count=0),
    calibration=MinMax(po2_scale=False),
  )


def fp8_delayed(history_length: int = 16) -> DotGeneralConfig:
  """FP8 with delayed scaling (Peng et al. 2023, arXiv 2310.18313).

  e4m3 weights and activations, e5m2 gradients, each per tensor with the
  bound taken from the max of its last `history_length` amax values
  (`DelayedScaling`); the gradients' histories update in the backward
  passes. Calls need `state=aqtr.state.init(...)`.

  Args:
    history_length: amax values kept per tensor, >= 1.
  """
  check_int('presets.fp8_delayed', 'history_length', history_length, 1)
  cal = DelayedScaling(history_length=history_length, po2_scale=False)

  def t(dtype_name: str) -> TensorConfig:
    return operand(
      Fp8(dtype_name=dtype_name, clip_gradient=False),
      tiling=PerTensor(),
      calibration=cal,
    )

  e4, e5 = t('float8_e4m3fn'), t('float8_e5m2')
  return DotGeneralConfig(
    fwd=raw(e4, e4, False),
    dlhs=raw(e5, e4, True),
    drhs=raw(e5, e4, True),
  )


def int4_lsq() -> DotGeneralConfig:
  """LSQ (Esser et al. 2020, arXiv 1902.08153): int4 with learned steps.

  Forward: weights int4 per output channel and activations int4 per
  tensor, each with a learned step size (`Lsq`, trained by the one custom
  VJP with the paper's step gradient; init 2 mean|x| / sqrt(7)); the
  backward passes are float (quantization-aware training, as in the
  paper). Calls need `state=aqtr.state.init(...)`; the Flax ops keep the
  steps as params named 'aqtr_learned'.
  """
  int4 = IntSymmetric(bits=4, preserve_max_val=True, clip_gradient=False)
  acts = operand(int4, tiling=PerTensor(), calibration=Lsq())
  weights = operand(int4, calibration=Lsq())
  return DotGeneralConfig(
    fwd=raw(acts, weights, False),
    dlhs=raw(_none(), _none(), False),
    drhs=raw(_none(), _none(), False),
  )
