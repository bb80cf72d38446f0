"""aqtr.gin: every registered class is a gin configurable; gin == Fiddle."""

import pathlib
import subprocess
import sys

import pytest

gin = pytest.importorskip('gin')

import aqtr  # noqa: E402
import aqtr.gin  # noqa: E402

GIN = pathlib.Path(__file__).resolve().parents[1] / 'configs' / 'gin'
REGISTRIES = {
  'numerics': aqtr.numerics,
  'calibrations': aqtr.calibrations,
  'tilings': aqtr.tilings,
  'sparsity': aqtr.sparsity,
  'freezers': aqtr.freezers,
}


@pytest.fixture(autouse=True)
def _fresh_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.mark.parametrize('name', ['int8', 'fp8', 'mxfp8'])
def test_gin_file_equals_fiddle_config(name):
  from_gin = aqtr.gin.config_from_gin(str(GIN / f'{name}.gin'))
  from_fiddle = aqtr.fiddle.build(aqtr.fiddle.config(name))
  assert from_gin == from_fiddle
  assert aqtr.fiddle.to_text(from_gin) == aqtr.fiddle.to_text(from_fiddle)


def test_every_registered_class_is_configurable():
  names = aqtr.gin.register_all()
  for family, module in REGISTRIES.items():
    for n in module.names():
      assert f'aqtr.{family}.{n}' in names
  for cls in ('DotGeneralConfig', 'DotGeneralRaw', 'TensorConfig'):
    assert f'aqtr.{cls}' in names
  made = aqtr.gin.configurable('aqtr.calibrations.constant')(bound=2.0)
  assert type(made) is aqtr.calibrations.Constant  # not a gin subclass
  with pytest.raises(KeyError, match='aqtr.TensorConfig'):
    aqtr.gin.configurable('aqtr.nope')


def test_bindings_and_spelled_out_scopes():
  config = aqtr.gin.config_from_gin(
    str(GIN / 'int8.gin'),
    bindings=[
      'aqtr.numerics.int_symmetric.bits = 6',
      'dlhs/lhs/aqtr.numerics.int_symmetric.bits = 4',
      'dlhs/lhs/aqtr.TensorConfig.rounding = @aqtr.Stochastic()',
    ],
  )
  assert config.dlhs.lhs.numerics.bits == 4
  assert config.dlhs.lhs.rounding == aqtr.Stochastic()
  assert config.drhs.lhs.numerics.bits == 6
  assert config.drhs.lhs.rounding == aqtr.NearestEven()
  assert config.fwd.rhs.numerics.bits == 6


def test_core_imports_neither_gin_nor_flag_parsing():
  code = (
    'import sys, aqtr; '
    "print(sorted(m for m in ('gin', 'fiddle.absl_flags', 'flax') "
    'if m in sys.modules))'
  )
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == '[]'
