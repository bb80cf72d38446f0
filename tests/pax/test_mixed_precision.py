"""MaxText-style mixed precision JSON -> per-layer bits, scales and tiles."""

import json

import fiddle as fdl
import pytest

import aqtr
from aqtr.pax import inject, mixed_precision, mixed_precision_rules

from .helpers import dot_dtypes, grad_jaxpr, int8_dots, tiny_lm

SPEC = {
  '__default__': {'w_bits': 8, 'a_bits': 8},
  r'layers\.0\..*': {'w_bits': 4, 'w_scale': 0.9, 'tile_size': 16},
  r'layers\.1\.ffn': {'a_bits': None, 'a_scale': 0.5},
}


def _built_op(model, path):
  node = model
  for part in path.replace('[', '.').replace(']', '').split('.'):
    node = node[int(part)] if part.isdigit() else getattr(node, part)
  return node.config


def test_bits_scales_and_tiles_per_layer(tmp_path):
  f = tmp_path / 'mp.json'
  f.write_text(json.dumps(SPEC))
  new, report = inject(tiny_lm(), mixed_precision_rules(f), strict=True)
  model = fdl.build(new)
  for path, entry in report.configs().items():
    cfg = _built_op(model, path)
    assert cfg == entry
    if path.endswith(('qk_einsum', 'pv_einsum')):
      assert cfg is None  # only WeightOp ops are touched
      continue
    lhs, rhs = cfg.fwd.lhs, cfg.fwd.rhs
    if path.startswith('layers[0]'):
      assert (lhs.numerics.bits, rhs.numerics.bits) == (8, 4)
      assert rhs.calibration.clip_scale == 0.9
      assert lhs.calibration.clip_scale == 1.0
      assert lhs.tiling == rhs.tiling == aqtr.tilings.SubChannel(tile_size=16)
    elif path.startswith('layers[1].ffn'):
      assert not lhs.quantized and rhs.numerics.bits == 8
    else:
      assert (lhs.numerics.bits, rhs.numerics.bits) == (8, 8)
      assert rhs.tiling == aqtr.tilings.PerChannel()
    assert not cfg.dlhs.lhs.quantized and not cfg.drhs.lhs.quantized


def test_dots_in_the_jaxpr():
  new, _ = inject(tiny_lm(), mixed_precision_rules(SPEC))
  dots = dot_dtypes(grad_jaxpr(new))
  # Forward-only quantization: layer 0 (6 ops, 4-bit weights stored as
  # int8), layer 1 attention (4 ops) and the tied logits run int8 x int8;
  # layer 1's ffn has float activations, so its dots stay float.
  assert dots[('int8', 'int8')] == 6 + 4 + 1
  assert int8_dots(grad_jaxpr(tiny_lm())) == 0


def test_last_regex_wins_like_maxtext():
  spec = {'.*ffn.*': {'w_bits': 4, 'a_bits': 4}, '.*wo': {'w_bits': 2}}
  _, report = inject(tiny_lm(), mixed_precision_rules(spec))
  c = report.configs()
  assert c['layers[0].ffn.wo.einsum'].fwd.rhs.numerics.bits == 2
  assert not c['layers[0].ffn.wo.einsum'].fwd.lhs.quantized
  assert c['layers[0].ffn.wi.einsum'].fwd.rhs.numerics.bits == 4
  assert c['layers[0].attention.q_proj.einsum'] is None


def test_json_text_and_all_ops():
  text = json.dumps({'__default__': {'a_bits': 8, 'w_bits': 8}})
  _, report = inject(tiny_lm(), mixed_precision_rules(text, tag=None))
  assert len(report.quantized_paths()) == 17


@pytest.mark.parametrize(
  'entry, match',
  [
    ({'w_bit': 8}, 'unknown key'),
    ({'w_bits': 9}, 'w_bits must be 1..8'),
    ({'a_scale': 0}, 'a_scale must be a number > 0'),
    ({'tile_size': 0}, 'tile_size must be -1'),
  ],
)
def test_bad_entries(entry, match):
  with pytest.raises(ValueError, match=match):
    mixed_precision_rules({'x': entry})


def test_float_entry_and_config():
  assert mixed_precision.mixed_precision_config() is None
  (rule,) = mixed_precision_rules({'.*': {}})
  assert rule.config is None
