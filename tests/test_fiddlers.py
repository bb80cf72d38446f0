"""aqtr.fiddlers: switch algorithms by registry name, with clear errors."""

import fiddle as fdl
import pytest

import aqtr
from aqtr import calibrations, fiddlers, numerics, tags, tilings


def test_use_calibration_on_forward_operands_only():
  cfg = aqtr.fiddle.config('int8')
  fiddlers.use_calibration(cfg, r'fwd\..*', 'constant', bound=3.0)
  built = aqtr.fiddle.build(cfg)
  assert built.fwd.lhs.calibration == calibrations.Constant(bound=3.0)
  assert built.fwd.rhs.calibration == calibrations.Constant(bound=3.0)
  assert built.dlhs.lhs.calibration == calibrations.AbsMax()
  assert cfg.fwd.lhs.calibration is not cfg.fwd.rhs.calibration
  # Fully expanded: selectors see the defaults of the new class too.
  assert cfg.fwd.lhs.calibration.po2_scale is False


def test_use_numerics_tiling_rounding():
  cfg = aqtr.fiddle.config('int8')
  fiddlers.use_numerics(cfg, r'dlhs\.lhs', 'int_symmetric', bits=4)
  fiddlers.use_tiling(cfg, r'fwd\..*', 'subchannel', tile_size=32)
  fiddlers.use_rounding(cfg, r'dlhs\.lhs', 'stochastic')
  built = aqtr.fiddle.build(cfg)
  assert built.dlhs.lhs.numerics == numerics.IntSymmetric(bits=4)
  assert built.fwd.rhs.tiling == tilings.SubChannel(tile_size=32)
  assert built.dlhs.lhs.rounding == aqtr.Stochastic()
  assert built.drhs.lhs.rounding == aqtr.NearestEven()
  # The new sub-config carries its role tags.
  assert fdl.get_tags(cfg.dlhs.lhs.numerics, 'bits') == {
    tags.Bits,
    tags.BwdBits,
  }


def test_generic_use_and_set_fields():
  cfg = aqtr.fiddle.config('int8')
  fiddlers.use(cfg, '.*', 'numerics', 'fp8')
  fiddlers.set_fields(
    cfg, r'(dlhs|drhs)\.lhs\.numerics', dtype_name='float8_e5m2'
  )
  assert aqtr.fiddle.build(cfg) == aqtr.presets.fp8()


def test_unknown_name_lists_the_registered_names():
  cfg = aqtr.fiddle.config('int8')
  with pytest.raises(aqtr.UnknownNameError, match='absmax, constant'):
    fiddlers.use_calibration(cfg, 'fwd.lhs', 'percentil')
  with pytest.raises(aqtr.UnknownNameError, match='nearest_even, stochastic'):
    fiddlers.use_rounding(cfg, 'fwd.lhs', 'stochastik')
  with pytest.raises(ValueError, match="'calibration', 'freezer', 'numerics'"):
    fiddlers.use(cfg, 'fwd.lhs', 'calibrations', 'absmax')


def test_unknown_field_lists_the_valid_fields():
  cfg = aqtr.fiddle.config('int8')
  with pytest.raises(
    TypeError, match='no field bnd; valid fields: po2_scale, bound'
  ):
    fiddlers.use_calibration(cfg, 'fwd.lhs', 'constant', bnd=3.0)


def test_bad_value_names_the_paths():
  cfg = aqtr.fiddle.config('int8')
  with pytest.raises(
    ValueError, match=r'at fwd\.lhs, fwd\.rhs: .*finite and > 0'
  ):
    fiddlers.use_calibration(cfg, r'fwd\..*', 'constant', bound=-1.0)


def test_no_matching_operand_lists_operand_paths():
  cfg = aqtr.fiddle.config('int8')
  with pytest.raises(
    ValueError, match=r'operand paths: fwd\.lhs, fwd\.rhs, dlhs'
  ):
    fiddlers.use_calibration(cfg, r'fwd\.lhs\.calibration', 'constant')


def test_fiddlers_work_on_model_trees():
  model = {'attention': aqtr.presets.int8(), 'mlp': aqtr.presets.int8()}
  cfg = aqtr.fiddle.as_config(model)
  fiddlers.use_numerics(cfg, r"\['mlp'\]\.fwd\.rhs", 'int_symmetric', bits=4)
  built = fdl.build(cfg)
  assert built['mlp'].fwd.rhs.numerics.bits == 4
  assert built['attention'].fwd.rhs.numerics.bits == 8


def test_catalogue_numerics_by_name():
  cfg = aqtr.fiddle.config('int8')
  fiddlers.use_numerics(cfg, r'fwd\.rhs', 'int_asymmetric', bits=4)
  fiddlers.use_calibration(cfg, r'fwd\.rhs', 'minmax')
  fiddlers.use_numerics(cfg, r'fwd\.lhs', 'mx', element='fp4_e2m1')
  fiddlers.use_tiling(cfg, r'fwd\.lhs', 'subchannel', tile_size=32)
  fiddlers.use_numerics(
    cfg, r'dlhs\.lhs', 'fp', exponent_bits=5, mantissa_bits=2
  )
  fiddlers.use_numerics(cfg, r'drhs\.lhs', 'nvfp4')
  fiddlers.use_tiling(cfg, r'drhs\.lhs', 'subchannel', tile_size=16)
  built = aqtr.fiddle.build(cfg)
  assert built.fwd.rhs.numerics == numerics.IntAsymmetric(bits=4)
  assert built.fwd.lhs.numerics == numerics.Mx(element='fp4_e2m1')
  assert built.dlhs.lhs.numerics.max_value == 57344.0
  assert built.drhs.lhs.numerics == numerics.NvFp4()
  # A symmetric-only calibration on the asymmetric operand fails at build
  # with the path and the allowed calibrations.
  fiddlers.use_calibration(cfg, r'fwd\.rhs', 'absmax')
  with pytest.raises(ValueError, match=r'fwd\.rhs.*allowed.*minmax'):
    aqtr.fiddle.build(cfg)
