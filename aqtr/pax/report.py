"""What `aqtr.pax.inject` did: op path -> config, and the rules left unused.

Configs are shown in one short line: a preset name when the config equals
a preset, else per pass `lhs x rhs` with `f` (float), `i<bits>`, `e4m3` /
`e5m2`, and `fq` for a backward residual that reuses the forward
quantization; `@0.9` is an absmax clip scale, `/t128` a sub-channel tile,
`~sr` stochastic rounding, `:2of4` N:M sparsity (`:magnitude` another).

Example:
  >>> import aqtr
  >>> describe(aqtr.presets.int8()), describe(None)
  ('int8', 'float')
  >>> describe(aqtr.presets.fully_quantized(4, 8))
  'fwd i4xi4 | dlhs i8xfq | drhs i8xfq'
  >>> describe(aqtr.sparsity.configure(aqtr.presets.float(), rhs='n_m'))
  'fwd fxf:2of4 | dlhs fxf:2of4 | drhs fxf'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aqtr import presets
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig

__all__ = ['InjectionReport', 'OpEntry', 'describe']

_PRESETS = (
  'int8',
  'int8_sparse_2_4',
  'int8_fwd',
  'int8_weight_only',
  'int4_weight_only',
  'fp8',
  'float',
)


def _sparsity(t: TensorConfig) -> str:
  sp = t.sparsity
  if not sp.prunes:
    return ''
  if hasattr(sp, 'n') and hasattr(sp, 'm'):
    return f':{sp.n}of{sp.m}'
  return f':{getattr(sp, "registered_name", type(sp).__name__)}'


def _tensor(t: TensorConfig) -> str:
  n = t.numerics
  if not n.quantizes:
    return 'f' + _sparsity(t)
  if n.kind == 'int' and hasattr(n, 'bits'):
    s = f'i{n.bits}'
  elif hasattr(n, 'dtype_name'):
    s = n.dtype_name.removeprefix('float8_').removesuffix('fn')
  else:
    s = type(n).__name__
  clip = getattr(t.calibration, 'clip_scale', 1.0)
  if clip != 1.0:
    s += f'@{clip:g}'
  tile = getattr(t.tiling, 'tile_size', 0) or getattr(t.tiling, 'tile_count', 0)
  if tile:
    s += f'/t{tile}'
  if t.rounding.stochastic:
    s += '~sr'
  return s + _sparsity(t)


def _raw(r: DotGeneralRaw) -> str:
  rhs = 'fq' if r.use_fwd_quant else _tensor(r.rhs)
  return f'{_tensor(r.lhs)}x{rhs}'


def describe(config: Any) -> str:
  """A one-line summary of an op config (see the module docstring).

  Args:
    config: a DotGeneralConfig, None (float) or any other value.

  Returns:
    The preset name when `config` equals one, else a per-pass summary.
  """
  if config is None:
    return 'float'
  if not isinstance(config, DotGeneralConfig):
    return repr(config)
  for name in _PRESETS:
    preset = getattr(presets, name, None)
    if preset is not None and config == preset():
      return name
  if config.is_float:
    return 'float'
  return ' | '.join(
    f'{p} {_raw(getattr(config, p))}' for p in ('fwd', 'dlhs', 'drhs')
  )


@dataclasses.dataclass(frozen=True)
class OpEntry:
  """One op of the injected config.

  Attributes:
    path: dotted op path.
    op: op class name.
    config: the op's built config (None: float).
    rule: index of the rule that set it, or None (left as it was).
  """

  path: str
  op: str
  config: Any
  rule: int | None

  @property
  def quantized(self) -> bool:
    """Whether the op runs quantized."""
    c = self.config
    return c is not None and not (
      isinstance(c, DotGeneralConfig) and c.is_float
    )


@dataclasses.dataclass(frozen=True)
class InjectionReport:
  """Every op path with its config, and which rules matched what.

  Attributes:
    ops: one entry per op site, in tree order.
    rules: the rules, in order (first match wins).
    wins: per rule, the number of ops it set.
    hits: per rule, the number of ops it matched (including ops an earlier
      rule took).
    unshared: paths whose shared config node was replaced by a copy.
  """

  ops: tuple[OpEntry, ...]
  rules: tuple[Any, ...]
  wins: tuple[int, ...]
  hits: tuple[int, ...]
  unshared: tuple[str, ...] = ()

  @property
  def unused_rules(self) -> list[Any]:
    """The rules that set no op (matched nothing, or only shadowed ops)."""
    return [r for r, w in zip(self.rules, self.wins, strict=True) if not w]

  def configs(self) -> dict[str, Any]:
    """Op path -> built config (None: float)."""
    return {e.path: e.config for e in self.ops}

  def quantized_paths(self) -> list[str]:
    """The paths of the ops that run quantized, in tree order."""
    return [e.path for e in self.ops if e.quantized]

  def unused_text(self) -> str:
    """One line per unused rule, saying whether it matched at all."""
    lines = []
    for i, (r, w, h) in enumerate(
      zip(self.rules, self.wins, self.hits, strict=True)
    ):
      if w:
        continue
      why = (
        f'its {h} matching op(s) were taken by earlier rules'
        if h
        else 'matched no op'
      )
      lines.append(f'  rule {i} {r.label()}: {why}')
    return '\n'.join(lines)

  def __str__(self) -> str:
    width = max((len(e.path) for e in self.ops), default=0)
    lines = [f'{len(self.quantized_paths())}/{len(self.ops)} ops quantized']
    for e in self.ops:
      src = f'rule {e.rule}' if e.rule is not None else 'unchanged'
      lines.append(f'  {e.path:<{width}}  {describe(e.config)}  [{src}]')
    if self.unshared:
      lines.append('shared nodes copied at: ' + ', '.join(self.unshared))
    unused = self.unused_text()
    if unused:
      lines.append('unused rules:\n' + unused)
    return '\n'.join(lines)
