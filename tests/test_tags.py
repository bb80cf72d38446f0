"""aqtr.tags: field tags from Annotated, role tags by position."""

import copy

import fiddle as fdl
import pytest

import aqtr
from aqtr import numerics, tags


def _leaves(cfg):
  """path -> value of every non-Buildable node."""
  return {
    p: v
    for p, v in aqtr.selectors.paths(cfg).items()
    if not isinstance(v, fdl.Buildable)
  }


def _changed(before, after):
  a, b = _leaves(before), _leaves(after)
  return {p for p in a.keys() | b.keys() if a.get(p, 'x') != b.get(p, 'y')}


def test_field_tags_come_from_annotations():
  t = fdl.Config(aqtr.TensorConfig)
  assert fdl.get_tags(t, 'numerics') == {tags.Numerics}
  assert fdl.get_tags(t, 'calibration') == {tags.Calibration}
  assert fdl.get_tags(t, 'tiling') == {tags.Tiling}
  assert fdl.get_tags(t, 'sparsity') == {tags.Sparsity}
  assert fdl.get_tags(t, 'rounding') == {tags.Rounding}
  n = fdl.Config(numerics.IntSymmetric)
  assert fdl.get_tags(n, 'bits') == {tags.Bits}
  assert fdl.get_tags(n, 'clip_gradient') == {tags.ClipGradient}
  assert fdl.get_tags(fdl.Config(numerics.Fp8), 'clip_gradient') == {
    tags.ClipGradient
  }
  c = fdl.Config(aqtr.calibrations.Constant)  # inherited from the base
  assert fdl.get_tags(c, 'po2_scale') == {tags.Po2Scale}
  r = fdl.Config(aqtr.DotGeneralRaw)
  assert fdl.get_tags(r, 'use_fwd_quant') == {tags.UseFwdQuant}
  assert fdl.get_tags(r, 'accumulator') == {tags.Accumulator}


@pytest.mark.parametrize(
  'tag, expected',
  [
    (tags.BwdBits, [f'{p}.{s}' for p in ('dlhs', 'drhs') for s in 'lr']),
    (tags.FwdBits, ['fwd.l', 'fwd.r']),
    (tags.Bits, [f'{p}.{s}' for p in ('fwd', 'dlhs', 'drhs') for s in 'lr']),
  ],
)
def test_set_tagged_bits_changes_exactly_the_tagged_leaves(tag, expected):
  cfg = aqtr.fiddle.config('int8')
  before = copy.deepcopy(cfg)
  fdl.set_tagged(cfg, tag=tag, value=4)
  want = {f'{e}hs.numerics.bits' for e in expected}
  assert _changed(before, cfg) == want
  assert aqtr.fiddle.build(cfg).dlhs.lhs.numerics.bits == (
    4 if tag is not tags.FwdBits else 8
  )


@pytest.mark.parametrize(
  'tag, operands',
  [
    (tags.ActivationNumerics, ['fwd.lhs', 'drhs.rhs']),
    (tags.WeightNumerics, ['fwd.rhs', 'dlhs.rhs']),
    (tags.GradientNumerics, ['dlhs.lhs', 'drhs.lhs']),
  ],
)
def test_role_numerics_tags_sit_on_their_operands(tag, operands):
  cfg = aqtr.fiddle.config('int8')
  before = copy.deepcopy(cfg)
  fp8 = aqtr.fiddle.as_config(numerics.Fp8(dtype_name='float8_e5m2'))
  fdl.set_tagged(cfg, tag=tag, value=fp8)
  changed = {p.rsplit('.', 2)[0] for p in _changed(before, cfg)}
  assert changed == set(operands)
  built = aqtr.fiddle.build(cfg)
  for op in operands:
    pass_, side = op.split('.')
    assert getattr(getattr(built, pass_), side).numerics == numerics.Fp8(
      dtype_name='float8_e5m2'
    )


def test_gradient_rounding_turns_on_stochastic_rounding():
  cfg = aqtr.fiddle.config('int8')
  fdl.set_tagged(
    cfg, tag=tags.GradientRounding, value=fdl.Config(aqtr.Stochastic)
  )
  assert aqtr.fiddle.build(cfg) == aqtr.presets.fully_quantized(
    8, 8, stochastic_rounding=True
  )


def test_replaced_subconfigs_get_role_tags_after_tag_roles():
  cfg = aqtr.fiddle.config('fp8')
  fdl.set_tagged(
    cfg, tag=tags.GradientNumerics, value=fdl.Config(numerics.IntSymmetric)
  )
  assert tags.BwdBits not in fdl.get_tags(cfg.dlhs.lhs.numerics, 'bits')
  tags.tag_roles(cfg)
  tags.tag_roles(cfg)  # idempotent
  assert fdl.get_tags(cfg.dlhs.lhs.numerics, 'bits') == {
    tags.Bits,
    tags.BwdBits,
  }
  fdl.set_tagged(cfg, tag=tags.BwdBits, value=3)
  assert aqtr.fiddle.build(cfg).drhs.lhs.numerics.bits == 3


def test_tag_roles_removes_stale_role_tags_from_copies():
  cfg = aqtr.fiddle.config('int8')
  cfg.dlhs.lhs = copy.deepcopy(cfg.fwd.lhs)  # carries fwd.lhs's role tags
  assert tags.ActivationNumerics in fdl.get_tags(cfg.dlhs.lhs, 'numerics')
  tags.tag_roles(cfg)
  assert fdl.get_tags(cfg.dlhs.lhs, 'numerics') == {
    tags.Numerics,
    tags.GradientNumerics,
  }
  assert fdl.get_tags(cfg.dlhs.lhs, 'rounding') == {
    tags.Rounding,
    tags.GradientRounding,
  }
  assert tags.FwdBits not in fdl.get_tags(cfg.dlhs.lhs.numerics, 'bits')


def test_tag_roles_finds_every_dot_config_in_a_model_tree():
  model = {'layers': [aqtr.presets.int8(), aqtr.presets.int8_weight_only()]}
  cfg = aqtr.fiddle.as_config(model)
  fdl.set_tagged(cfg, tag=tags.FwdBits, value=6)
  built = fdl.build(cfg)
  assert built['layers'][0].fwd.lhs.numerics.bits == 6
  assert built['layers'][1].fwd.rhs.numerics.bits == 6
  assert built['layers'][1].fwd.lhs.numerics == numerics.NoNumerics()


def test_set_tag_by_name():
  cfg = aqtr.fiddle.config('int8')
  aqtr.fiddlers.set_tag(
    cfg, 'GradientNumerics', fdl.Config(numerics.IntSymmetric, bits=4)
  )
  aqtr.fiddlers.set_tag(cfg, 'BwdBits', 5)  # reaches the new sub-configs
  built = aqtr.fiddle.build(cfg)
  assert built.dlhs.lhs.numerics.bits == 5
  with pytest.raises(ValueError, match='BwdBits, Calibration'):
    aqtr.fiddlers.set_tag(cfg, 'BwBits', 4)
