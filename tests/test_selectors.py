"""aqtr.selectors: regex selection over dotted paths, on any config tree."""

import re

import fiddle as fdl
import pytest

import aqtr
from aqtr import numerics, tags
from aqtr.selectors import paths, select_path


def layer(name: str = '', dot: object = None, scale: float = 1.0):
  """A stand-in for a model layer holding a dot_general config."""
  return (name, dot, scale)


def _model():
  dot = aqtr.presets.int8()
  return fdl.Config(
    dict,
    layers=[
      fdl.Config(layer, name='attention', dot=aqtr.fiddle.as_config(dot)),
      fdl.Config(layer, name='mlp', dot=aqtr.fiddle.as_config(dot)),
    ],
  )


def test_paths_are_dotted_and_in_tree_order():
  p = list(paths(aqtr.fiddle.config('int8')))
  assert p[:4] == [
    'fwd',
    'fwd.lhs',
    'fwd.lhs.numerics',
    'fwd.lhs.numerics.bits',
  ]
  assert 'drhs.accumulator' in p
  assert 'layers[1].dot.fwd.rhs' in paths(_model())


def test_select_by_path_regex():
  cfg = aqtr.fiddle.config('int8')
  assert select_path(cfg, r'.*\.rhs').paths == (
    'fwd.rhs',
    'dlhs.rhs',
    'drhs.rhs',
  )
  dlhs = select_path(cfg, r'dlhs\..*').paths
  assert dlhs[:2] == ('dlhs.lhs', 'dlhs.lhs.numerics')
  assert all(p.startswith('dlhs.') for p in dlhs)
  assert len(select_path(cfg, r'.*', fn_or_cls=aqtr.TensorConfig)) == 6
  assert select_path(cfg, 'fwd').paths == ('fwd',)  # full match only


def test_set_puts_a_fresh_copy_at_every_match():
  cfg = aqtr.fiddle.config('int8')
  new = fdl.Config(numerics.IntSymmetric, bits=4)
  select_path(cfg, r'(dlhs|drhs)\.lhs').set(numerics=new)
  assert cfg.dlhs.lhs.numerics is not cfg.drhs.lhs.numerics
  assert cfg.dlhs.lhs.numerics is not new
  cfg.dlhs.lhs.numerics.bits = 3
  built = aqtr.fiddle.build(cfg)
  assert (built.dlhs.lhs.numerics.bits, built.drhs.lhs.numerics.bits) == (3, 4)
  assert tags.BwdBits in fdl.get_tags(cfg.drhs.lhs.numerics, 'bits')


def test_replace_values_and_nodes():
  cfg = aqtr.fiddle.config('int8')
  select_path(cfg, r'fwd\..*\.bits').replace(6)
  built = aqtr.fiddle.build(cfg)
  assert built.fwd.lhs.numerics.bits == built.fwd.rhs.numerics.bits == 6
  assert built.dlhs.lhs.numerics.bits == 8
  per_tensor = fdl.Config(aqtr.tilings.PerTensor)
  select_path(cfg, r'.*\.tiling').replace(per_tensor)
  assert cfg.fwd.lhs.tiling is not cfg.fwd.rhs.tiling
  assert aqtr.fiddle.build(cfg).drhs.rhs.tiling == aqtr.tilings.PerTensor()


def test_replace_nested_matches_replaces_the_outermost():
  cfg = aqtr.fiddle.config('int8')
  fp8 = aqtr.fiddle.as_config(aqtr.presets.fp8().fwd)
  select_path(cfg, r'fwd.*').replace(fp8)
  assert aqtr.fiddle.build(cfg).fwd == aqtr.presets.fp8().fwd
  assert tags.FwdBits not in fdl.get_tags(cfg.dlhs.lhs.numerics, 'bits')


def test_model_tree_selection():
  cfg = _model()
  layers = select_path(cfg, r'layers\[\d\]', fn_or_cls=layer).paths
  assert layers == ('layers[0]', 'layers[1]')
  sel = select_path(cfg, r'layers\[1\]\.dot\.(dlhs|drhs)\.lhs\.numerics')
  sel.set(bits=4)
  built = fdl.build(cfg)
  assert built['layers'][1][1].dlhs.lhs.numerics.bits == 4
  assert built['layers'][0][1].dlhs.lhs.numerics.bits == 8
  select_path(cfg, r'layers\[\d\]', fn_or_cls=layer).set(scale=0.5)
  assert list(select_path(cfg, r'layers\[\d\]').get('scale')) == [0.5, 0.5]


def test_errors():
  cfg = aqtr.fiddle.config('int8')
  with pytest.raises(
    ValueError, match=r'fully matches .*paths are: fwd, fwd\.lhs'
  ):
    select_path(cfg, r'fwd\.lhz').set(bits=4)
  with pytest.raises(TypeError, match=r'fwd\.accumulator is the value'):
    select_path(cfg, r'fwd\.accumulator').set(x=1)
  with pytest.raises(AttributeError, match='valid parameter names'):
    select_path(cfg, r'fwd\.lhs').set(bitz=4)
  cfg.dlhs.lhs.rounding = fdl.Config(aqtr.Stochastic, noise_sharing_axes=(0,))
  with pytest.raises(TypeError, match='tuple is immutable'):
    select_path(cfg, r'.*noise_sharing_axes\[0\]').replace(1)
  with pytest.raises(re.error):
    select_path(cfg, r'fwd\.(')
