"""aqtr.fiddle: expanded preset configs, build errors, text, JSON."""

import inspect

import fiddle as fdl
import pytest
from fiddle import daglish, selectors

import aqtr
from aqtr import calibrations, numerics

PRESETS = aqtr.presets.__all__
OPERANDS = (
  'fwd.lhs',
  'fwd.rhs',
  'dlhs.lhs',
  'dlhs.rhs',
  'drhs.lhs',
  'drhs.rhs',
)


def _buildables(cfg):
  return [
    (aqtr.fiddle.path_str(p), v)
    for v, p in daglish.iterate(cfg, memoized=False)
    if isinstance(v, fdl.Buildable)
  ]


@pytest.mark.parametrize('name', PRESETS)
def test_preset_config_builds_the_preset(name):
  cfg = aqtr.fiddle.config(name)
  built = fdl.build(cfg)
  assert isinstance(built, aqtr.DotGeneralConfig)
  assert built == getattr(aqtr.presets, name)()
  assert aqtr.fiddle.build(cfg) == built


@pytest.mark.parametrize('name', PRESETS)
def test_preset_config_is_fully_expanded_and_unshared(name):
  nodes = _buildables(aqtr.fiddle.config(name))
  for path, node in nodes:
    params = inspect.signature(fdl.get_callable(node)).parameters
    assert set(node.__arguments__) == set(params), path
  assert len({id(n) for _, n in nodes}) == len(nodes)
  paths = {p for p, _ in nodes}
  for op in OPERANDS:
    for leaf in ('numerics', 'calibration', 'tiling', 'rounding'):
      assert f'{op}.{leaf}' in paths


def test_select_by_class_reaches_all_six_quantizers():
  cfg = aqtr.fiddle.config('int8')
  sel = selectors.select(cfg, calibrations.AbsMax)
  assert len(list(sel)) == 6
  sel.set(clip_scale=0.9)
  built = fdl.build(cfg)
  for op in OPERANDS:
    pass_, side = op.split('.')
    t = getattr(getattr(built, pass_), side)
    assert t.calibration == calibrations.AbsMax(clip_scale=0.9)
  assert built.fwd.lhs.numerics == numerics.IntSymmetric(bits=8)


def test_config_accepts_names_functions_and_instances():
  by_name = aqtr.fiddle.config('fully_quantized', 4, bwd_bits=6)
  assert by_name.fwd.rhs.numerics.bits == 4
  assert by_name.drhs.lhs.numerics.bits == 6
  by_fn = aqtr.fiddle.config(aqtr.presets.fp8)
  assert fdl.build(by_fn) == aqtr.presets.fp8()
  inst = aqtr.presets.int8_fwd()
  assert fdl.build(aqtr.fiddle.config(inst)) == inst
  with pytest.raises(ValueError, match='int8_weight_only'):
    aqtr.fiddle.config('int7')
  with pytest.raises(TypeError, match='DotGeneralConfig'):
    aqtr.fiddle.config(lambda: 3)


def test_as_config_converts_any_tree():
  tree = {'a': [aqtr.presets.int8(), (aqtr.TensorConfig(),)], 'n': 3}
  cfg = aqtr.fiddle.as_config(tree)
  assert isinstance(cfg['a'][0], fdl.Config)
  assert isinstance(cfg['a'][1], tuple)
  assert fdl.build(cfg) == tree
  assert aqtr.tags.FwdBits in fdl.get_tags(cfg['a'][0].fwd.lhs.numerics, 'bits')


def _mx_with_stochastic_rounding(c):
  c.dlhs.lhs.numerics = aqtr.fiddle.as_config(numerics.Mx())
  c.dlhs.lhs.tiling = aqtr.fiddle.as_config(
    aqtr.tilings.SubChannel(tile_size=32)
  )
  c.dlhs.lhs.rounding = fdl.Config(aqtr.Stochastic)


def _fwd_quant_on_fwd(c):
  c.fwd.use_fwd_quant = True


def _int32_accumulator_with_fp8(c):
  c.drhs.lhs.numerics = aqtr.fiddle.as_config(numerics.Fp8())
  c.drhs.accumulator = 'int32'


def _nine_bits(c):
  c.fwd.rhs.numerics.bits = 9


@pytest.mark.parametrize(
  'edit, path, words',
  [
    (_mx_with_stochastic_rounding, 'dlhs.lhs', ['stochastic', 'NearestEven']),
    (_fwd_quant_on_fwd, '', ['<root>', 'fwd.use_fwd_quant must be False']),
    (_int32_accumulator_with_fp8, 'drhs', ['drhs (DotGeneralRaw)', "'auto'"]),
    (_nine_bits, 'fwd.rhs.numerics', ['(IntSymmetric)', '1..8']),
  ],
)
def test_build_errors_name_the_path_and_fix(edit, path, words):
  cfg = aqtr.fiddle.config('int8')
  edit(cfg)
  with pytest.raises(aqtr.fiddle.BuildError) as info:
    aqtr.fiddle.build(cfg)
  assert info.value.path == path
  for w in words:
    assert w in str(info.value)
  assert 'Fiddle context' not in str(info.value)


def test_to_text_one_line_per_node_and_leaf():
  cfg = aqtr.fiddle.config('fully_quantized', stochastic_rounding=True)
  text = aqtr.fiddle.to_text(cfg)
  lines = text.splitlines()
  assert 'fwd.lhs.numerics.bits = 8' in lines
  assert 'fwd.lhs.calibration: AbsMax' in lines
  assert 'dlhs.lhs.rounding: Stochastic' in lines
  assert 'dlhs.lhs.rounding.noise_sharing_axes = ()' in lines
  assert 'dlhs.rhs: TensorConfig  # unused: use_fwd_quant=True' in lines
  assert len(lines) == len(set(lines))
  assert aqtr.fiddle.to_text(fdl.build(cfg)) == text
  tagged = aqtr.fiddle.to_text(cfg, show_tags=True).splitlines()
  assert 'dlhs.lhs.numerics.bits = 8  # Bits, BwdBits' in tagged


@pytest.mark.parametrize('name', PRESETS)
def test_json_round_trip(name):
  cfg = aqtr.fiddle.config(name)
  text = aqtr.fiddle.dumps(cfg)
  again = aqtr.fiddle.loads(text)
  assert fdl.build(again) == fdl.build(cfg)
  assert aqtr.fiddle.to_text(again, show_tags=True) == aqtr.fiddle.to_text(
    cfg, show_tags=True
  )


def test_json_round_trip_keeps_tags_usable():
  again = aqtr.fiddle.loads(aqtr.fiddle.dumps(aqtr.fiddle.config('int8')))
  fdl.set_tagged(again, tag=aqtr.tags.BwdBits, value=4)
  built = fdl.build(again)
  assert built.dlhs.lhs.numerics.bits == 4
  assert built.fwd.lhs.numerics.bits == 8


class _Holder:
  def __init__(self, fn=None, fns=(), obj=None):
    self.fn, self.fns, self.obj = fn, fns, obj


def test_to_text_names_functions_without_addresses():
  import functools

  import jax

  cfg = fdl.Config(
    _Holder,
    fn=functools.partial(jax.nn.gelu, approximate=False),
    fns=(jax.nn.relu, aqtr.fiddle.to_text),
    obj=object(),
  )
  lines = aqtr.fiddle.to_text(cfg).splitlines()
  assert lines == [
    'fn = functools.partial(jax.nn.gelu, approximate=False)',
    'fns = (jax.nn.relu, aqtr.fiddle.to_text)',
    'obj = <object object>',
  ]
