"""FP4 training recipes as op configs (in `aqtr.presets`).

Two recipes, every GEMM of a training step in 4-bit floats (E2M1):

- `nvfp4_training`: NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149):
  16-element blocks with e4m3 x f32 scales, 16x16 weight blocks,
  stochastic gradients, a random Hadamard transform on the wgrad inputs.
- `mxfp4_training`: a Quartet-style MXFP4 recipe (Castro et al. 2025,
  arXiv 2505.14669): 32-element blocks with E8M0 scales, stochastic
  gradients, Hadamard rotations along each pass's contraction.

Example:
  >>> cfg = nvfp4_training()
  >>> cfg.fwd.rhs.tiling
  Block2d(tile_size=16, free_size=16)
"""

from __future__ import annotations

from aqtr.core.arguments import check_flags
from aqtr.core.config import DotGeneralConfig
from aqtr.core.rounding import Stochastic
from aqtr.numerics.mx import Mx
from aqtr.numerics.nvfp4 import NvFp4
from aqtr.preset_parts import operand, raw
from aqtr.tilings.block2d import Block2d
from aqtr.transforms.hadamard import Hadamard

__all__ = ['mxfp4_training', 'nvfp4_training']


def nvfp4_training(
  rht: bool = True,
  stochastic_rounding: bool = True,
  weight_blocks_2d: bool = True,
) -> DotGeneralConfig:
  """NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149), per dot.

  Every GEMM in NVFP4 (E2M1, 16-element blocks, e4m3 x f32 scales):
    fwd   x: 1x16 blocks along K; w: 16x16 blocks (`Block2d`); nearest.
    dlhs  g: 1x16 along N, stochastic; w requantized along N, 16x16
          blocks: the same values as in fwd (2-D blocks are transpose
          invariant).
    drhs  g and x along the M tokens (1x16), both rotated by a random
          Hadamard transform (RHT-16, fixed signs), g stochastic.
  The paper keeps a few sensitive layers (mostly the last blocks) in
  BF16: leave those to rules (`aqtr.pax` injection, Flax rules) with
  `aqtr.presets.float()`. Every contraction (K, N, M) must be a multiple
  of 16. The call needs `key=` (stochastic rounding).

  Args:
    rht: RHT-16 on the wgrad (drhs) inputs.
    stochastic_rounding: stochastic rounding on the gradients.
    weight_blocks_2d: 16x16 weight blocks (else 1x16 along each pass's
      contraction, so forward and dlhs see different weights).
  """
  check_flags(
    'presets.nvfp4_training',
    rht=rht,
    stochastic_rounding=stochastic_rounding,
    weight_blocks_2d=weight_blocks_2d,
  )
  nv = NvFp4(scale_mode='nearest', clip_gradient=False)
  sr = Stochastic(noise_sharing_axes=()) if stochastic_rounding else None
  w = operand(
    nv, tiling=Block2d(tile_size=16, free_size=16) if weight_blocks_2d else None
  )
  h = Hadamard(block_size=16, signs='seed', seed=0, method='auto')
  t = h if rht else None
  return DotGeneralConfig(
    fwd=raw(operand(nv), w, False),
    dlhs=raw(operand(nv, sr), w, False),
    drhs=raw(operand(nv, sr, transform=t), operand(nv, transform=t), False),
  )


def mxfp4_training(
  hadamard: bool = True, forward_hadamard: bool = True
) -> DotGeneralConfig:
  """A Quartet-style MXFP4 recipe (Castro et al. 2025, arXiv 2505.14669).

  MXFP4 GEMMs (E2M1, 32-blocks, E8M0 `rceil`), stochastic gradients,
  requantized residuals; RHT-32 (fixed signs) along each pass's
  contraction: fwd quantizes x R and R^T w (frozen weights stored
  rotated). No QuEST clipping. K, N, M multiples of 32; needs `key=`.

  Args:
    hadamard: RHT-32 on the dlhs and drhs operands.
    forward_hadamard: RHT-32 on the forward operands (Quartet).
  """
  check_flags(
    'presets.mxfp4_training',
    hadamard=hadamard,
    forward_hadamard=forward_hadamard,
  )
  mx = Mx(element='fp4_e2m1', scale_mode='rceil', clip_gradient=False)
  h = Hadamard(block_size=32, signs='seed', seed=0, method='auto')
  t = h if hadamard else None
  bwd = raw(
    operand(mx, Stochastic(), transform=t), operand(mx, transform=t), False
  )
  f = operand(mx, transform=h if forward_hadamard else None)
  return DotGeneralConfig(fwd=raw(f, f, False), dlhs=bwd, drhs=bwd)
