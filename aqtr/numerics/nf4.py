"""NormalFloat4 (QLoRA): the 16-value codebook of normal quantiles."""

from __future__ import annotations

import dataclasses

from aqtr.numerics.base import register
from aqtr.numerics.codebook import Codebook


@register('nf4')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Nf4(Codebook):
  """4-bit NormalFloat (Dettmers et al. 2023, QLoRA, arXiv 2305.14314).

  Math: 16 values in [-1, 1] built from quantiles of N(0, 1): with
  `d = (1/32 + 1/30) / 2`, the 8 positive values are `Phi^-1` at
  `linspace(1 - d, 1/2, 9)[:-1]`, the 7 negative ones `-Phi^-1` at
  `linspace(1 - d, 1/2, 8)[:-1]`, plus an exact 0, all divided by the
  largest (so +-1 are in the table). With block absmax scaling (QLoRA's
  blocks of 64: `SubChannel(tile_size=64)` with the `absmax`
  calibration) `s = max|W_block|` and `q` is the nearest table value.

  Emulated in float32 (see `Codebook`). Meant for weights: Nf4 on the
  gradient operand of dlhs/drhs is rejected when the config is built,
  and it has no stochastic rounding.

  Example:
    >>> import jax.numpy as jnp
    >>> Nf4().quantize(jnp.array([0.03, 0.05, -0.8])).tolist()
    [0.0, 0.07958029955625534, -0.6961928009986877]
  """

  table = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
  )
  for_gradients = False
