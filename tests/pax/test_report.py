"""InjectionReport and describe: one line per op, unused rules explained."""

import aqtr
import aqtr.pax
from aqtr.pax import Rule, describe, inject
from aqtr.pax.mixed_precision import mixed_precision_config
from aqtr.pax.report import OpEntry

from .helpers import tiny_lm


def test_describe_presets_and_custom():
  for name in ('int8', 'fp8', 'int8_weight_only', 'int8_fwd', 'float'):
    assert describe(getattr(aqtr.presets, name)()) == name
  assert describe(None) == 'float'
  assert describe(aqtr.presets.fully_quantized(8, 4, True)) == (
    'fwd i8xi8 | dlhs i4~srxfq | drhs i4~srxfq'
  )
  cfg = mixed_precision_config(w_bits=4, a_bits=8, w_scale=0.5, tile_size=16)
  assert describe(cfg) == 'fwd i8/t16xi4@0.5/t16 | dlhs fxfq | drhs fxfq'
  assert describe(aqtr.presets.fp8()) == 'fp8'


def test_entry_quantized():
  assert OpEntry('a', 'EinsumOp', aqtr.presets.int8(), 0).quantized
  assert not OpEntry('a', 'EinsumOp', None, None).quantized
  assert not OpEntry('a', 'EinsumOp', aqtr.presets.float(), 0).quantized


def test_report_text_lists_every_op():
  rules = [Rule('int8', layer=aqtr.pax.Linear), Rule('fp8', path='nowhere')]
  _, report = inject(tiny_lm(), rules)
  lines = str(report).splitlines()
  assert lines[0] == '12/17 ops quantized'
  assert lines[1].split() == ['embedding.einsum', 'float', '[unchanged]']
  assert lines[2].split() == [
    'layers[0].attention.q_proj.einsum',
    'int8',
    '[rule',
    '0]',
  ]
  assert lines[-2] == 'unused rules:'
  assert lines[-1] == "  rule 1 Rule('fp8', path='nowhere'): matched no op"
  assert set(report.configs()) == {e.path for e in report.ops}


def test_rule_labels():
  assert Rule(None, layer=(aqtr.pax.Linear, aqtr.pax.Conv)).label() == (
    'Rule(None, layer=Linear|Conv)'
  )
  assert Rule(aqtr.presets.int8(), tag=aqtr.pax.tags.WeightOp).label() == (
    'Rule(<int8>, tag=WeightOp)'
  )
  assert Rule(aqtr.fiddle.config('int8')).label() == (
    'Rule(<fdl.Config DotGeneralConfig>)'
  )
  assert Rule('int8', name='mine').label() == 'mine'


def test_report_is_logged(caplog):
  caplog.set_level('INFO', logger='aqtr.pax.inject')
  inject(tiny_lm(), [Rule('int8', path='softmax')])
  assert 'ops quantized' in caplog.text and 'matched no op' in caplog.text
