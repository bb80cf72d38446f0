"""DeepSeek's FP8 training recipes as op configs (in `aqtr.presets`).

Two recipes, for rules on any model (`aqtr.flax.quantize`, `aqtr.pax`):

- `maxtext_deepseek_fp8`: MaxText's DeepSeek-V3 fine-tuning recipe
  (w8a8g8): e4m3 weights and activations, e5m2 gradients; static scales
  for weights and activations, dynamic ones for gradients.
- `deepseek_v3_fp8`: the DeepSeek-V3 paper's framework (arXiv 2412.19437,
  section 3.3): e4m3 for every GEMM input, gradients included, online
  (current) scales, activations in 1x128 tiles along the contraction,
  weights in 128x128 blocks.

Example:
  >>> cfg = deepseek_v3_fp8(tile=32)
  >>> cfg.fwd.rhs.tiling
  Block2d(tile_size=32, free_size=32)
"""

from __future__ import annotations

import builtins
import dataclasses

from aqtr.calibrations.constant import Constant
from aqtr.core.config import DotGeneralConfig
from aqtr.freezers.base import configure
from aqtr.numerics.fp8 import Fp8
from aqtr.preset_parts import operand, raw
from aqtr.tilings.block2d import Block2d
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.per_tensor import PerTensor
from aqtr.tilings.subchannel import SubChannel

__all__ = ['deepseek_v3_fp8', 'maxtext_deepseek_fp8']

E4M3, E5M2 = 'float8_e4m3fn', 'float8_e5m2'


def _fp8(dtype_name: str, tiling, calibration=None, gather=False):
  return operand(
    Fp8(dtype_name=dtype_name, clip_gradient=False),
    tiling=tiling,
    calibration=calibration,
    quantized_gather=gather,
  )


def maxtext_deepseek_fp8(
  bound: float | None = None, quantized_gather: bool = True
) -> DotGeneralConfig:
  """MaxText's DeepSeek-V3 FP8 fine-tuning recipe (w8a8g8), per dot.

    fwd   activations e4m3 per tensor, static: the fixed range +-`bound`
          (MaxText's 'fixed,-b,b'), or with `bound=None` the mean absmax
          recorded by CALIBRATE (the 'calibration' freezer:
          `aqtr.flax.calibrate`; TRAIN and SERVE then use it); weights
          e4m3 per output channel (frozen by `convert`: static in SERVE).
    dlhs  gradients e5m2, dynamic per row; the weights' forward fp8
          codes reused.
    drhs  gradients e5m2, dynamic per column; the activations' forward
          fp8 codes reused.
  With `quantized_gather`, weights sharded over the devices that need
  them whole (FSDP, explicit mesh axes) are quantized on their shards:
  the all-gather moves fp8 values + f32 scales
  (`TensorConfig.quantized_gather`).

  Args:
    bound: the activations' fixed range (> 0), or None to calibrate it.
    quantized_gather: gather FSDP weights in fp8.

  Returns:
    The DotGeneralConfig.
  """
  if bound is not None and (
    type(bound) not in (int, builtins.float) or not bound > 0
  ):
    raise ValueError(
      'presets.maxtext_deepseek_fp8: bound must be None (calibrate) or a '
      f'range > 0 such as 224.0, got {bound!r}.'
    )
  cal = None if bound is None else Constant(bound=builtins.float(bound))
  acts = _fp8(E4M3, PerTensor(), cal)
  grads = _fp8(E5M2, PerChannel())
  cfg = DotGeneralConfig(
    fwd=raw(acts, _fp8(E4M3, PerChannel(), gather=quantized_gather), False),
    dlhs=raw(grads, _fp8(E4M3, PerChannel()), True),
    drhs=raw(grads, _fp8(E4M3, PerChannel()), True),
  )
  return cfg if bound is not None else configure(cfg, lhs='calibration')


def deepseek_v3_fp8(
  tile: int = 128, experts: bool = False, quantized_gather: bool = True
) -> DotGeneralConfig:
  """The DeepSeek-V3 paper's FP8 framework (arXiv 2412.19437), per dot.

  e4m3 for every GEMM input, online scales (the current tensor's absmax
  per tile, no history):
    fwd   x: 1 x `tile` tiles along K; w: `tile` x `tile` blocks.
    dlhs  dY: 1 x `tile` along N; w requantized in the same blocks (2-D
          blocks are transpose invariant: the forward's values).
    drhs  X and dY: `tile` x 1 along the M tokens (requantized); with
          `experts` (the grouped GEMM of `aqtr.ragged_dot`, whose drhs
          contracts each expert's tokens: tiles along M would straddle
          experts) one scale per column over all tokens instead.
  With `quantized_gather` the forward weight blocks are quantized on
  their shards (FSDP): the all-gather moves fp8 values + scales.
  Every contraction (K, N, and M for dots) must be a multiple of `tile`.

  Args:
    tile: the tile and block size (128 in the paper).
    experts: the config of the MoE experts' ragged dots.
    quantized_gather: gather FSDP weights in fp8.

  Returns:
    The DotGeneralConfig.
  """
  if type(tile) is not int or tile < 1:
    raise ValueError(
      f'presets.deepseek_v3_fp8: tile must be an int >= 1, got {tile!r}.'
    )
  if not isinstance(experts, bool):
    raise ValueError(
      f'presets.deepseek_v3_fp8: experts must be a bool, got {experts!r}.'
    )
  row = _fp8(E4M3, SubChannel(tile_size=tile))
  block = _fp8(E4M3, Block2d(tile_size=tile, free_size=tile))
  gathered = dataclasses.replace(block, quantized_gather=quantized_gather)
  col = _fp8(E4M3, PerChannel()) if experts else row
  return DotGeneralConfig(
    fwd=raw(row, gathered, False),
    dlhs=raw(row, block, False),
    drhs=raw(col, col, False),
  )
