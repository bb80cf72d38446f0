"""`LoraConfig`: rank, scale, dropout and the frozen base of LoRA / QLoRA.

LoRA (Hu et al. 2021, arXiv 2106.09685) trains, for a frozen weight `W`
[d_in, d_out], two small matrices `A` [d_in, r] and `B` [r, d_out] and
computes `y = x W + dropout(x) A B * alpha / r` (`B` starts at zero, so
training starts from the base model). QLoRA (Dettmers et al. 2023, arXiv
2305.14314) stores `W` in 4-bit NormalFloat with one absmax scale per 64
weights (`nf4()`) and, optionally, quantizes those scales again to 8 bits
(`double_quant`: 256 scales per second-level block).

Example:
  >>> c = LoraConfig(rank=8, alpha=16.0, base='nf4', double_quant=True)
  >>> c.scale, describe_base(c)
  (2.0, 'Nf4/t64')
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from aqtr import presets
from aqtr import rules as rules_lib
from aqtr.calibrations.absmax import AbsMax
from aqtr.core.config import DotGeneralConfig
from aqtr.core.slot_state import is_stateful
from aqtr.numerics.nf4 import Nf4
from aqtr.tilings.subchannel import SubChannel

__all__ = ['LoraConfig', 'base_config', 'describe_base', 'nf4']

_BASES = "None (float), 'nf4', a preset name or a DotGeneralConfig"


def nf4(group: int = 64) -> DotGeneralConfig:
  """QLoRA's base weights: nf4 with an absmax scale per `group` inputs.

  Weight-only (activations and gradients stay float); the table is
  `aqtr.numerics.Nf4` (arXiv 2305.14314), one scale per `group`
  consecutive contraction elements (`SubChannel(tile_size=group)`).

  Example:
    >>> nf4().fwd.rhs.tiling.tile_size
    64
  """
  if not isinstance(group, int) or isinstance(group, bool) or group < 1:
    raise ValueError(f'nf4: group must be an int >= 1, got {group!r}.')
  cfg = presets.int4_weight_only()
  w = dataclasses.replace(
    cfg.fwd.rhs,
    numerics=Nf4(),
    tiling=SubChannel(tile_size=group, tile_count=0),
    calibration=AbsMax(clip_scale=1.0, po2_scale=False),
  )
  return dataclasses.replace(
    cfg,
    fwd=dataclasses.replace(cfg.fwd, rhs=w),
    dlhs=dataclasses.replace(cfg.dlhs, rhs=w),
  )


def base_config(
  base: Any, field: str = 'LoraConfig.base'
) -> DotGeneralConfig | None:
  """`LoraConfig.base` as a DotGeneralConfig (None: a float base).

  Args:
    base: a `LoraConfig.base` value.
    field: what the errors name (the argument `base` came from).

  Returns:
    The base's DotGeneralConfig, or None for a float base.
  """
  if base is None or base == 'float':
    return None
  if base == 'nf4':
    return nf4()
  if isinstance(base, str):
    if base not in presets.__all__:
      raise ValueError(f'{field}: unknown preset {base!r}; use {_BASES}.')
    base = aqtr_fiddle.config(base)
  if isinstance(base, fdl.Buildable):
    base = aqtr_fiddle.build(base)
  if not isinstance(base, DotGeneralConfig):
    raise TypeError(f'{field} must be {_BASES}, got {base!r}.')
  if base.is_float or not base.fwd.rhs.quantized:
    return None
  return base


def _frozen_problem(cfg: DotGeneralConfig) -> str:
  """Why the weight operand of `cfg` cannot be stored frozen ('' if it can)."""
  w = cfg.fwd.rhs
  if w.rounding.stochastic:
    return 'it rounds stochastically (a frozen weight is rounded once)'
  if is_stateful(w):
    return (
      f'its calibration {type(w.calibration).__name__} keeps state '
      '(a frozen weight is calibrated once)'
    )
  if w.sparsity.prunes:
    return 'it prunes the weight (adapters would train on pruned zeros)'
  return ''


def describe_base(config: LoraConfig) -> str:
  """The base weights' format in one short word ('float', 'Nf4/t64', ...)."""
  cfg = base_config(config.base)
  if cfg is None:
    return 'float'
  return rules_lib.describe(cfg).split(' | ')[0].removeprefix('fwd fx')


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """How one weight op gets its low-rank adapter.

  Attributes:
    rank: r, the adapters' inner size (1 <= r <= min(d_in, d_out)).
    alpha: the adapter output is scaled by alpha / r.
    dropout: dropout rate on the adapter's input x (0 <= p < 1); applied
      only inside `aqtr.lora.dropout(key)`.
    base: the frozen base weight's format: None (float: plain LoRA),
      'nf4' (QLoRA: nf4, one absmax scale per 64), a preset name (e.g.
      'int8_weight_only', 'int4_weight_only') or a DotGeneralConfig.
    double_quant: store the base's scales in 8 bits, 256 per block
      (QLoRA's double quantization); needs a quantized base.
    adapter: a DotGeneralConfig (or preset name) for the two adapter
      matmuls x A and (x A) B (quantized on the fly), or None (float).
  """

  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  base: Any = None
  double_quant: bool = False
  adapter: Any = None

  def __post_init__(self):
    r = self.rank
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
      raise ValueError(f'LoraConfig.rank must be an int >= 1, got {r!r}.')
    a = self.alpha
    if (
      not isinstance(a, int | float)
      or isinstance(a, bool)
      or not 0 < a < math.inf
    ):
      raise ValueError(f'LoraConfig.alpha must be > 0 and finite, got {a!r}.')
    p = self.dropout
    if not isinstance(p, int | float) or isinstance(p, bool) or not 0 <= p < 1:
      raise ValueError(f'LoraConfig.dropout must be in [0, 1), got {p!r}.')
    cfg = base_config(self.base)
    if cfg is not None and _frozen_problem(cfg):
      raise ValueError(
        f'LoraConfig.base cannot be frozen: {_frozen_problem(cfg)}; use a '
        "round-to-nearest, stateless weight format such as 'nf4' or "
        "'int8_weight_only'."
      )
    if not isinstance(self.double_quant, bool):
      raise TypeError(
        f'LoraConfig.double_quant must be a bool, got {self.double_quant!r}.'
      )
    if self.double_quant and cfg is None:
      raise ValueError(
        "LoraConfig.double_quant quantizes the base weights' scales, but "
        "base is float; set base='nf4' (or another quantized base)."
      )
    adapter_config(self)

  @property
  def scale(self) -> float:
    """alpha / rank, the factor on the adapter's output."""
    return float(self.alpha) / self.rank


def adapter_config(config: LoraConfig) -> DotGeneralConfig | None:
  """The adapter matmuls' DotGeneralConfig (None: float)."""
  a = config.adapter
  if a is None:
    return None
  if isinstance(a, str):
    if a not in presets.__all__:
      raise ValueError(
        f'LoraConfig.adapter: unknown preset {a!r}; use None, a preset name '
        'or a DotGeneralConfig.'
      )
    a = aqtr_fiddle.build(aqtr_fiddle.config(a))
  if not isinstance(a, DotGeneralConfig):
    raise TypeError(
      'LoraConfig.adapter must be None, a preset name or a DotGeneralConfig, '
      f'got {a!r}.'
    )
  if a.fwd.lhs.rounding.stochastic or a.fwd.rhs.rounding.stochastic:
    raise ValueError(
      'LoraConfig.adapter rounds stochastically; adapters get no PRNG key: '
      'use a round-to-nearest config.'
    )
  return None if a.is_float else a
