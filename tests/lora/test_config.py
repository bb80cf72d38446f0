"""LoraConfig: defaults, the base formats, and one clear line per bad field."""

from __future__ import annotations

import dataclasses

import pytest

import aqtr
from aqtr import lora
from aqtr.lora.config import base_config, describe_base


def test_defaults_and_scale():
  c = lora.LoraConfig()
  assert (c.rank, c.alpha, c.dropout, c.base, c.double_quant) == (
    8,
    16.0,
    0.0,
    None,
    False,
  )
  assert c.scale == 2.0
  assert lora.LoraConfig(rank=4, alpha=4.0).scale == 1.0


def test_base_formats():
  assert base_config(None) is None and base_config('float') is None
  assert base_config(aqtr.presets.float()) is None
  nf4 = base_config('nf4')
  assert nf4.fwd.rhs.numerics.registered_name == 'nf4'
  assert nf4.fwd.rhs.tiling.tile_size == 64
  assert not nf4.fwd.lhs.quantized  # weight-only
  assert lora.nf4(32).fwd.rhs.tiling.tile_size == 32
  assert base_config('int8_weight_only') == aqtr.presets.int8_weight_only()
  assert describe_base(lora.LoraConfig(base='nf4')) == 'Nf4/t64'
  assert describe_base(lora.LoraConfig()) == 'float'


@pytest.mark.parametrize(
  'kw, match',
  [
    (dict(rank=0), r'LoraConfig.rank must be an int >= 1, got 0'),
    (dict(rank=2.0), r'LoraConfig.rank must be an int'),
    (dict(alpha=0), r'LoraConfig.alpha must be > 0'),
    (dict(dropout=1.0), r'LoraConfig.dropout must be in \[0, 1\)'),
    (dict(base='nope'), r"LoraConfig.base: unknown preset 'nope'"),
    (dict(base='fp8_delayed'), r'LoraConfig.base cannot be frozen: its '),
    (dict(base='int4_lsq'), r'cannot be frozen: its calibration Lsq'),
    (dict(double_quant=True), r'double_quant .* but base is float'),
    (dict(adapter='nope'), r"LoraConfig.adapter: unknown preset 'nope'"),
  ],
)
def test_bad_fields_one_clear_line(kw, match):
  with pytest.raises(ValueError, match=match) as e:
    lora.LoraConfig(**kw)
  assert '\n' not in str(e.value)


def test_stochastic_base_cannot_be_frozen():
  cfg = aqtr.presets.int8_weight_only()
  w = dataclasses.replace(cfg.fwd.rhs, rounding=aqtr.Stochastic())
  sr = dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=w))
  with pytest.raises(ValueError, match='rounds stochastically'):
    lora.LoraConfig(base=sr)


def test_bad_types():
  with pytest.raises(TypeError, match='LoraConfig.base must be'):
    lora.LoraConfig(base=3)
  with pytest.raises(TypeError, match='double_quant must be a bool'):
    lora.LoraConfig(base='nf4', double_quant=1)
  with pytest.raises(ValueError, match='nf4: group must be an int >= 1'):
    lora.nf4(0)
