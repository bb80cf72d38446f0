"""MaxText-style per-layer mixed precision JSON -> injection rules.

The JSON maps layer-path regexes to quantization settings, plus an optional
`'__default__'` entry that fills the settings an entry leaves out and
applies to every weight op that no regex matches (as in MaxText's
`quant_cfg_path` files for `quantization=intmp`):

  {"__default__": {"w_bits": 8, "a_bits": 8},
   "layers\\\\.0\\\\..*": {"w_bits": 4, "w_scale": 0.9, "tile_size": 16}}

  w_bits     weight (rhs operand) bits, 1..8, or null for float  [null]
  a_bits     activation (lhs operand) bits, 1..8, or null        [null]
  w_scale    absmax clip scale of the weights                    [1.0]
  a_scale    absmax clip scale of the activations                [1.0]
  tile_size  sub-channel tile along the contraction, -1 = per channel [-1]

As in MaxText (AQT's `dot_general_make(lhs_bits, rhs_bits)`), only the
forward pass is quantized; the gradients are float gradients of the
quantized forward (the backward dots reuse the forward-quantized residual,
`use_fwd_quant=True`). Integers of fewer than 8 bits are still stored and
multiplied as int8; the bits set the grid. Regexes are matched like any
`aqtr.pax.Rule` path (full match of the op path or an ancestor's); when
several match, the LAST one in the file wins, as in MaxText. By default the
rules only touch ops tagged `WeightOp` (attention einsums stay as they are).

Example:
  >>> import aqtr.pax
  >>> rules = mixed_precision_rules(
  ...   {'__default__': {'w_bits': 8, 'a_bits': 8}, 'wo': {'w_bits': 4}})
  >>> [r.label() for r in rules]
  ["mixed_precision['wo'] w4a8", 'mixed_precision[__default__] w8a8']
  >>> cfg = aqtr.pax.templates.feed_forward(8, 16)
  >>> _, report = aqtr.pax.inject(cfg, rules)
  >>> report.configs()['wo.einsum'].fwd.rhs.numerics.bits
  4
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from aqtr.calibrations.absmax import AbsMax
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.rounding import NearestEven
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.none import NoNumerics
from aqtr.pax import tags
from aqtr.pax.inject import Rule
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.subchannel import SubChannel

__all__ = ['DEFAULT', 'load', 'mixed_precision_config', 'mixed_precision_rules']

DEFAULT = '__default__'
_DEFAULTS = {
  'w_bits': None,
  'a_bits': None,
  'w_scale': 1.0,
  'a_scale': 1.0,
  'tile_size': -1,
}


def _check(entry: Mapping[str, Any], where: str) -> None:
  if not isinstance(entry, Mapping):
    raise TypeError(
      f'mixed precision {where}: expected an object, got {entry!r}.'
    )
  unknown = sorted(set(entry) - set(_DEFAULTS))
  if unknown:
    raise ValueError(
      f'mixed precision {where}: unknown key(s) {unknown}; valid keys: '
      f'{sorted(_DEFAULTS)}.'
    )
  for key in ('w_bits', 'a_bits'):
    b = entry.get(key)
    if b is not None and (isinstance(b, bool) or b not in range(1, 9)):
      raise ValueError(
        f'mixed precision {where}: {key} must be 1..8 or null, got {b!r}.'
      )
  for key in ('w_scale', 'a_scale'):
    s = entry.get(key, 1.0)
    if (
      isinstance(s, bool)
      or not isinstance(s, int | float)
      or not (math.isfinite(s) and s > 0)
    ):
      raise ValueError(
        f'mixed precision {where}: {key} must be a number > 0, got {s!r}.'
      )
  t = entry.get('tile_size', -1)
  if isinstance(t, bool) or not isinstance(t, int) or (t != -1 and t < 1):
    raise ValueError(
      f'mixed precision {where}: tile_size must be -1 (per channel) or a '
      f'positive int, got {t!r}.'
    )


def _side(bits: int | None, scale: float, tile_size: int) -> TensorConfig:
  if bits is None:
    return TensorConfig(
      numerics=NoNumerics(),
      calibration=AbsMax(),
      tiling=PerChannel(),
      rounding=NearestEven(),
    )
  numerics = IntSymmetric(
    bits=bits,
    preserve_zero=bits > 1,
    preserve_max_val=True,
    clip_gradient=False,
  )
  tiling = PerChannel() if tile_size == -1 else SubChannel(tile_size=tile_size)
  return TensorConfig(
    numerics=numerics,
    calibration=AbsMax(clip_scale=float(scale)),
    tiling=tiling,
    rounding=NearestEven(),
  )


def mixed_precision_config(
  *,
  w_bits: int | None = None,
  a_bits: int | None = None,
  w_scale: float = 1.0,
  a_scale: float = 1.0,
  tile_size: int = -1,
) -> DotGeneralConfig | None:
  """The DotGeneralConfig of one mixed-precision entry (None: float).

  Args:
    w_bits: rhs (weight) bits, or None for float.
    a_bits: lhs (activation) bits, or None for float.
    w_scale: absmax clip scale of the weights.
    a_scale: absmax clip scale of the activations.
    tile_size: sub-channel tile size, or -1 for per-channel scales.

  Returns:
    Forward-only quantization (float gradients of the quantized forward),
    or None when both bit widths are None.

  Example:
    >>> cfg = mixed_precision_config(w_bits=4, a_bits=8, w_scale=0.9)
    >>> cfg.fwd.rhs.numerics.bits, cfg.fwd.rhs.calibration.clip_scale
    (4, 0.9)
  """
  entry = dict(
    w_bits=w_bits,
    a_bits=a_bits,
    w_scale=w_scale,
    a_scale=a_scale,
    tile_size=tile_size,
  )
  _check(entry, 'entry')
  if w_bits is None and a_bits is None:
    return None
  g = _side(None, 1.0, -1)
  return DotGeneralConfig(
    fwd=DotGeneralRaw(
      lhs=_side(a_bits, a_scale, tile_size),
      rhs=_side(w_bits, w_scale, tile_size),
    ),
    dlhs=DotGeneralRaw(lhs=g, rhs=g, use_fwd_quant=w_bits is not None),
    drhs=DotGeneralRaw(lhs=g, rhs=g, use_fwd_quant=a_bits is not None),
  )


def load(spec: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
  """The mixed-precision mapping from a dict, JSON text, or JSON file path.

  Example:
    >>> load('{"__default__": {"w_bits": 8}}')
    {'__default__': {'w_bits': 8}}
  """
  if isinstance(spec, Mapping):
    return dict(spec)
  if isinstance(spec, str) and spec.lstrip().startswith('{'):
    data = json.loads(spec)
  else:
    data = json.loads(pathlib.Path(spec).read_text())
  if not isinstance(data, dict):
    raise TypeError(f'mixed precision JSON must be an object, got {data!r}.')
  return data


def _summary(entry: Mapping[str, Any]) -> str:
  def bits(b):
    return 'f' if b is None else str(b)

  s = f'w{bits(entry["w_bits"])}a{bits(entry["a_bits"])}'
  if entry['w_scale'] != 1.0 or entry['a_scale'] != 1.0:
    s += f' scale w{entry["w_scale"]:g}/a{entry["a_scale"]:g}'
  if entry['tile_size'] != -1:
    s += f' tile {entry["tile_size"]}'
  return s


def mixed_precision_rules(
  spec: Mapping[str, Any] | str | os.PathLike,
  *,
  tag: Any = tags.WeightOp,
) -> list[Rule]:
  """Injection rules from a MaxText-style mixed-precision spec.

  Args:
    spec: the mapping, JSON text, or a path to a JSON file.
    tag: restrict every rule to ops with this tag (default `WeightOp`);
      None for all ops.

  Returns:
    One rule per regex, last file entry first (so the last match wins, as
    in MaxText), then the `__default__` rule (matching every remaining op)
    if the spec has one.
  """
  data = load(spec)
  default = dict(_DEFAULTS)
  if DEFAULT in data:
    _check(data[DEFAULT], repr(DEFAULT))
    default.update(data[DEFAULT])
  rules = []
  for regex, entry in reversed(list(data.items())):
    if regex == DEFAULT:
      continue
    _check(entry, repr(regex))
    merged = {**default, **entry}
    rules.append(
      Rule(
        mixed_precision_config(**merged),
        path=regex,
        tag=tag,
        name=f'mixed_precision[{regex!r}] {_summary(merged)}',
      )
    )
  if DEFAULT in data:
    rules.append(
      Rule(
        mixed_precision_config(**default),
        tag=tag,
        name=f'mixed_precision[{DEFAULT}] {_summary(default)}',
      )
    )
  return rules
