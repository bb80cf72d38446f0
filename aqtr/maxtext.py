"""MaxText-shaped shorthand: its `quantization=` names and Qwix-style rules.

`rules('int8')` gives the `aqtr.rules.Rule`s that quantize a model the way
MaxText's `quantization='int8'` does; `qt_rules(weight=..., activation=...,
backward=...)` the way a Qwix `QtRule(weight_qtype, act_qtype, bwd_qtype)`
does. Both take the same rule criteria (`path`, `op`) and feed
`aqtr.flax.quantize` or `aqtr.pax.inject`. The names:

  int8       int8 weights and activations, fwd and both gradients (`int8`)
  int8w      int8 weights only (`int8_weight_only`)
  int4w      int4 weights only (`int4_weight_only`)
  intmp      per-layer bits: `mixed_precision` = {regex: {'w_bits',
             'a_bits', 'w_scale', 'a_scale', 'tile_size'}, '__default__':
             {...}}, forward only (MaxText's quant_cfg JSON, or its path)
  fp8        e4m3 forward, e5m2 gradients (`fp8`)
  fp8_full   every operand fp8, per tensor, optional 6 static bounds in
             `constant_bound_config` (`fp8_full`)
  fp8_nanoo  AMD fnuz fp8 (`fp8_nanoo`); `nanoo_fp8` is the same

Example:
  >>> from aqtr import maxtext
  >>> maxtext.rules('int8w', path='decoder/.*layers.*')[0].label()
  "Rule('int8_weight_only', path='decoder/.*layers.*', weight=True)"
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp

from aqtr import calibrations, presets
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.rounding import NearestEven
from aqtr.freezers.base import NoFreezer
from aqtr.numerics.fp8 import Fp8
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.none import NoNumerics
from aqtr.rules import Rule
from aqtr.sparsity.none import NoSparsity
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.subchannel import SubChannel
from aqtr.transforms.none import NoTransform

__all__ = ['NAMES', 'config', 'dot_config', 'qt_rules', 'rules']

NAMES = ('int8', 'int8w', 'int4w', 'intmp', 'fp8', 'fp8_full', 'fp8_nanoo')
# name -> (preset, quantizes activations).
_PRESET = {
  'int8': ('int8', True),
  'int8w': ('int8_weight_only', False),
  'int4w': ('int4_weight_only', False),
  'fp8': ('fp8', True),
  'fp8_full': ('fp8_full', True),
  'fp8_nanoo': ('fp8_nanoo', True),
  'nanoo_fp8': ('fp8_nanoo', True),
}
_FP8 = {
  'e4m3': 'float8_e4m3fn',
  'e5m2': 'float8_e5m2',
  'e4m3fnuz': 'float8_e4m3fnuz',
  'e5m2fnuz': 'float8_e5m2fnuz',
}
_MP_KEYS = ('w_bits', 'a_bits', 'w_scale', 'a_scale', 'tile_size')
# dot_config's argument -> the intmp key it comes from (clips first).
_MP_FIELDS = (
  ('weight_clip', 'w_scale'),
  ('activation_clip', 'a_scale'),
  ('weight', 'w_bits'),
  ('activation', 'a_bits'),
)


def _name(quantization: Any, who: str) -> str:
  if quantization not in (*NAMES, 'nanoo_fp8'):
    raise ValueError(
      f'maxtext.{who}: quantization must be one of {", ".join(NAMES)}, '
      f'got {quantization!r}.'
    )
  return quantization


def config(
  quantization: str, *, constant_bound_config: Any = None
) -> DotGeneralConfig:
  """The op config MaxText's `quantization=` name means (not 'intmp').

  Args:
    quantization: one of `NAMES` but 'intmp' (a config per layer: use
      `rules`).
    constant_bound_config: fp8_full's 6 static bounds (or None).

  Returns:
    The preset's DotGeneralConfig.

  Example:
    >>> config('int8') == presets.int8()
    True
  """
  name = _name(quantization, 'config')
  if name == 'intmp':
    raise ValueError(
      "maxtext.config: quantization='intmp' sets a config per layer; use "
      'maxtext.rules(quantization, mixed_precision=...).'
    )
  if constant_bound_config is not None and name != 'fp8_full':
    raise ValueError(
      'maxtext: constant_bound_config is only for '
      f"quantization='fp8_full', got quantization={name!r}."
    )
  if name == 'fp8_full':
    return presets.fp8_full(constant_bounds=constant_bound_config)
  return getattr(presets, _PRESET[name][0])()


def rules(
  quantization: str,
  *,
  path: str | None = None,
  op: Any = None,
  weight: bool | None = True,
  constant_bound_config: Any = None,
  mixed_precision: dict[str, Any] | str | None = None,
) -> tuple[Rule, ...]:
  """The rules for MaxText's `quantization=` name.

  Like MaxText, the weight contractions are quantized (`weight=True`;
  None also quantizes activation x activation ops such as attention's,
  for names that quantize activations). intmp: one rule per layer regex
  (MaxText's last matching regex wins, so they come in reverse), then the
  '__default__' entry under `path`; a layer without bits stays float.

  Args:
    quantization: one of `NAMES`.
    path: the rules' module path regex (MaxText: 'decoder/.*layers.*').
    op: op kind(s) the rules select (None: every kind).
    weight: True: ops with a parameter operand; None: every op.
    constant_bound_config: fp8_full's 6 static bounds (or None).
    mixed_precision: intmp's per-layer dict, or the path of its JSON.

  Returns:
    A tuple of `Rule`s, first match wins.
  """
  name = _name(quantization, 'rules')
  if weight is not True and weight is not None:
    raise ValueError(
      f'maxtext.rules: weight must be True or None, got {weight!r}.'
    )
  if (mixed_precision is None) == (name == 'intmp'):
    raise ValueError(
      'maxtext.rules: mixed_precision is needed by, and only by, '
      f"quantization='intmp', got quantization={name!r}."
    )
  if name != 'intmp':
    cfg = config(name, constant_bound_config=constant_bound_config)
    sel = weight if _PRESET[name][1] else True
    label = _PRESET[name][0]
    return (
      Rule(
        label if cfg == _preset(label) else cfg, path=path, op=op, weight=sel
      ),
    )
  return _intmp(mixed_precision, path, op)


def _preset(label: str) -> DotGeneralConfig:
  return getattr(presets, label)()


def _intmp(mp: Any, path: str | None, op: Any) -> tuple[Rule, ...]:
  if isinstance(mp, str | os.PathLike):
    try:
      with open(mp, encoding='utf-8') as f:
        mp = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
      raise ValueError(
        f'maxtext.rules: mixed_precision file {os.fspath(mp)!r} cannot be '
        f'read as JSON ({type(e).__name__}: {e}); give a JSON file of '
        '{regex: {w_bits, a_bits, w_scale, a_scale, tile_size}}.'
      ) from None
  if not isinstance(mp, dict) or not all(
    isinstance(v, dict) for v in mp.values()
  ):
    raise ValueError(
      'maxtext.rules: mixed_precision must be {regex: {w_bits, a_bits, '
      f'w_scale, a_scale, tile_size}} or a JSON path, got {mp!r}.'
    )
  default = {
    'w_bits': None,
    'a_bits': None,
    'w_scale': 1.0,
    'a_scale': 1.0,
    'tile_size': -1,
  }
  default.update(mp.get('__default__', {}))
  out = []
  for regex, layer in reversed(
    [(k, v) for k, v in mp.items() if k != '__default__']
  ):
    out.append(
      Rule(
        _mp_config({**default, **layer}, regex), path=regex, op=op, weight=True
      )
    )
  out.append(
    Rule(_mp_config(default, '__default__'), path=path, op=op, weight=True)
  )
  return tuple(out)


def _mp_config(entry: dict[str, Any], where: str) -> DotGeneralConfig:
  bad = set(entry) - set(_MP_KEYS)
  if bad:
    raise ValueError(
      f'maxtext.rules: mixed_precision[{where!r}] has unknown keys '
      f'{sorted(bad)}; allowed: {", ".join(_MP_KEYS)}.'
    )
  tile = entry['tile_size']
  try:
    return dot_config(
      weight=entry['w_bits'],
      activation=entry['a_bits'],
      weight_clip=entry['w_scale'],
      activation_clip=entry['a_scale'],
      tile_size=None if tile == -1 else tile,
    )
  except ValueError as e:  # Name the key the user wrote, not ours.
    msg = str(e).removeprefix('maxtext: ')
    for ours, key in _MP_FIELDS:
      if msg.startswith(ours + ' '):
        msg = key + msg[len(ours) :]
        break
    raise ValueError(
      f'maxtext.rules: mixed_precision[{where!r}]: {msg}'
    ) from None


def _numerics(spec: Any, field: str):
  """A numerics spec (None, bits, 'int8', 'e4m3', a jnp dtype) as Numerics."""
  if spec is None:
    return NoNumerics()
  name = None
  if isinstance(spec, str):
    name = spec
  elif isinstance(spec, int) and not isinstance(spec, bool):
    name = f'int{spec}'
  elif not isinstance(spec, bool):
    try:
      name = jnp.dtype(spec).name
    except TypeError:
      pass
  name = name and name.removeprefix('float8_').removesuffix('fn')
  if name in _FP8:
    return Fp8(dtype_name=_FP8[name], clip_gradient=False)
  bits = name[3:] if name and name.startswith('int') else ''
  if bits.isdigit() and 2 <= int(bits) <= 8:
    return IntSymmetric(
      bits=int(bits),
      preserve_zero=True,
      preserve_max_val=True,
      clip_gradient=False,
      storage='int4' if bits == '4' else 'int8',
    )
  raise ValueError(
    f'maxtext: {field} must be None, bits 2..8, int2..int8, e4m3, e5m2, '
    f'e4m3fnuz, e5m2fnuz or such a jnp dtype, got {spec!r}.'
  )


def _calibration(spec: Any, clip: Any, field: str):
  if isinstance(spec, calibrations.Calibration):
    cal = spec
  elif spec in calibrations.names():
    cal = calibrations.get(spec)()
  else:
    raise ValueError(
      'maxtext: calibration must be a Calibration or one of '
      f'{", ".join(calibrations.names())}, got {spec!r}.'
    )
  number = isinstance(clip, int | float) and not isinstance(clip, bool)
  if number and clip == 1.0:
    return cal
  if not isinstance(cal, calibrations.AbsMax) or not (number and 0 < clip <= 1):
    raise ValueError(
      f'maxtext: {field} must be in (0, 1] (an absmax clip scale), got '
      f'{clip!r} with {type(cal).__name__}.'
    )
  return calibrations.AbsMax(clip_scale=float(clip), po2_scale=False)


def _tensor(numerics, calibration, tiling) -> TensorConfig:
  return TensorConfig(
    numerics=numerics,
    calibration=calibration,
    tiling=tiling,
    sparsity=NoSparsity(),
    rounding=NearestEven(),
    transform=NoTransform(),
    freezer=NoFreezer(),
  )


def dot_config(
  *,
  weight: Any = None,
  activation: Any = None,
  backward: Any = None,
  calibration: Any = 'absmax',
  tile_size: int | None = None,
  weight_clip: float = 1.0,
  activation_clip: float = 1.0,
) -> DotGeneralConfig:
  """One op config from per-operand numerics (a Qwix `QtRule`'s qtypes).

  fwd: activation x weight; dlhs: gradient (`backward`) x the forward
  weight, drhs: gradient x the forward activation (both reuse the forward
  quantization). A numerics is None (float), bits (2..8: int), 'int8',
  'int4', 'e4m3', 'e5m2', 'e4m3fnuz', 'e5m2fnuz' or such a jnp dtype.

  Args:
    weight: the weight's numerics.
    activation: the activation's numerics.
    backward: the gradient's numerics (None: float gradients of the
      quantized forward, straight-through).
    calibration: a Calibration or registered name, for every operand.
    tile_size: sub-channel tiles along the contraction (None: per channel).
    weight_clip: absmax clip scale of the weight (MaxText's w_scale).
    activation_clip: absmax clip scale of the activation (a_scale).

  Returns:
    The DotGeneralConfig.

  Example:
    >>> dot_config(weight='int8', activation='int8', backward='int8') == (
    ...   presets.int8())
    True
  """
  if tile_size is not None and (
    not isinstance(tile_size, int)
    or isinstance(tile_size, bool)
    or tile_size < 1
  ):
    raise ValueError(
      f'maxtext: tile_size must be None or an int >= 1, got {tile_size!r}.'
    )
  tiling = (
    PerChannel()
    if tile_size is None
    else SubChannel(tile_size=tile_size, tile_count=0)
  )
  none = _tensor(NoNumerics(), calibrations.AbsMax(), PerChannel())

  def t(spec, field, clip=1.0):
    n = _numerics(spec, field)
    cal = _calibration(calibration, clip, f'{field}_clip')  # checked always
    return _tensor(n, cal, tiling) if n.quantizes else none

  w = t(weight, 'weight', weight_clip)
  a = t(activation, 'activation', activation_clip)
  g = t(backward, 'backward')
  raw = DotGeneralRaw
  return DotGeneralConfig(
    fwd=raw(lhs=a, rhs=w, use_fwd_quant=False, accumulator='auto'),
    dlhs=raw(lhs=g, rhs=w, use_fwd_quant=True, accumulator='auto'),
    drhs=raw(lhs=g, rhs=a, use_fwd_quant=True, accumulator='auto'),
  )


def qt_rules(
  *,
  weight: Any = None,
  activation: Any = None,
  backward: Any = None,
  calibration: Any = 'absmax',
  tile_size: int | None = None,
  path: str | None = None,
  op: Any = None,
) -> tuple[Rule, ...]:
  """Rules from per-operand numerics, as a Qwix `QtRule` sets them.

  Ops with a weight get `dot_config(weight, activation, backward, ...)`;
  activation x activation ops (attention) get `activation` on both
  operands, or stay unmatched when `activation` is None (weight-only).

  Args:
    weight, activation, backward, calibration, tile_size: as `dot_config`.
    path: the rules' module path regex.
    op: op kind(s) the rules select (None: every kind).

  Returns:
    One rule (weight-only, or the same numerics for weights and
    activations) or two (weight ops, then activation x activation ops).

  Example:
    >>> len(qt_rules(weight='int4', activation='int8', backward='int8'))
    2
  """
  kw = dict(backward=backward, calibration=calibration, tile_size=tile_size)
  cfg = dot_config(weight=weight, activation=activation, **kw)
  if _numerics(activation, 'activation') == NoNumerics():
    return (Rule(cfg, path=path, op=op, weight=True),)
  if _numerics(weight, 'weight') == _numerics(activation, 'activation'):
    return (Rule(cfg, path=path, op=op),)
  both = dot_config(weight=activation, activation=activation, **kw)
  return (
    Rule(cfg, path=path, op=op, weight=True),
    Rule(both, path=path, op=op, weight=False),
  )
