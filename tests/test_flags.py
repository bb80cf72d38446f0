"""aqtr.flags: --config directives end to end, and the docs' walkthrough."""

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip('etils.epath')  # fiddle[flags]

import fiddle as fdl
from absl import flags

import aqtr
from aqtr import flags as aqtr_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
MY_CALIBRATION = str(ROOT / 'configs' / 'my_calibration.py')
STEMS = {p.stem for p in (ROOT / 'configs').glob('*.py')}


@pytest.fixture
def scratch_registries(monkeypatch):
  """Registrations made by configs/ files are undone after the test."""
  for family in (aqtr.calibrations, aqtr.numerics, aqtr.tilings):
    monkeypatch.setattr(
      family.registry, '_classes', dict(family.registry._classes)
    )
  before = set(sys.modules)
  yield
  for name in set(sys.modules) - before:
    if name in STEMS:
      del sys.modules[name]


def _parse(*args):
  fv = flags.FlagValues()
  config = aqtr_flags.DEFINE_config(flag_values=fv)
  imports = aqtr_flags.DEFINE_imports(flag_values=fv)
  fv(['prog', *args])
  aqtr_flags.import_modules(imports.value)
  return config.value


def test_config_set_and_fiddler_directives_apply_in_order():
  cfg = _parse(
    '--config=config:int8',
    '--config=set:fwd.lhs.numerics.bits=4',
    "--config=fiddler:use_calibration(r'fwd\\..*', 'constant', bound=3.0)",
    "--config=fiddler:set_tag('BwdBits', 6)",
  )
  built = aqtr.fiddle.build(cfg)
  assert built.fwd.lhs.numerics.bits == 4
  assert built.fwd.rhs.numerics.bits == 8
  assert built.fwd.lhs.calibration == aqtr.calibrations.Constant(bound=3.0)
  assert built.dlhs.lhs.calibration == aqtr.calibrations.AbsMax()
  assert built.drhs.lhs.numerics.bits == 6


def test_preset_arguments_and_no_flag():
  cfg = _parse('--config=config:fully_quantized(fwd_bits=4, bwd_bits=None)')
  assert fdl.build(cfg) == aqtr.presets.fully_quantized(4, None)
  assert _parse() is None


def test_user_file_import_and_dotted_config(scratch_registries):
  cfg = _parse(
    f'--import={MY_CALIBRATION}',
    '--config=config:my_calibration.int8_percentile_gradients',
  )
  assert fdl.build(cfg).dlhs.lhs.calibration.q == 99.0
  cfg = _parse(
    f'--import={MY_CALIBRATION}',
    '--config=config:int8',
    "--config=fiddler:use_calibration('drhs.lhs', 'my_percentile', q=98.0)",
  )
  assert type(fdl.build(cfg).drhs.lhs.calibration).__name__ == 'Percentile'


def test_user_registrations_do_not_leak():
  assert 'my_percentile' not in aqtr.calibrations.names()


def test_config_file_round_trip(tmp_path):
  cfg = aqtr.fiddle.config('fp8')
  aqtr.fiddlers.use_rounding(cfg, r'dlhs\.lhs', 'nearest_even')
  path = tmp_path / 'run.json'
  path.write_text(aqtr.fiddle.dumps(cfg))
  again = _parse(
    f'--config=config_file:{path}', '--config=set:fwd.accumulator="float32"'
  )
  assert fdl.build(again).fwd.accumulator == 'float32'
  assert fdl.build(again).dlhs == aqtr.presets.fp8().dlhs


def test_errors():
  with pytest.raises(ValueError, match='First flag command'):
    _parse('--config=set:fwd.lhs.numerics.bits=4')
  with pytest.raises(aqtr.UnknownNameError, match='absmax, constant'):
    _parse(
      '--config=config:int8',
      "--config=fiddler:use_calibration('fwd.lhs', 'pct')",
    )
  names = 'available names: aqt_v4, deepseek_v3_fp8, float, fp8'
  with pytest.raises(ValueError, match=names):
    _parse('--config=config:int9')


def _readme_walkthrough():
  # Found by its marker comment, wherever the page puts it.
  text = (ROOT / 'docs' / 'configuring.md').read_text()
  tail = text.split(
    '<!-- walkthrough: run verbatim by tests/test_flags.py -->'
  )[1]
  command, output = re.findall(r'```(?:bash|text)\n(.*?)```', tail, re.S)[:2]
  command = command.replace('\\\n', ' ')
  runs = [c for c in command.splitlines() if c.startswith('python ')]
  assert len(runs) == 1
  return shlex.split(runs[0]), output.splitlines()


def test_readme_walkthrough_runs_verbatim():
  argv, expected = _readme_walkthrough()
  assert argv[:2] == ['python', 'configs/sweep.py']
  out = subprocess.run(
    [sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True
  )
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  start = lines.index(expected[0])
  assert lines[start : start + len(expected)] == expected
  assert 'drhs.lhs.numerics.bits = 8' in lines
  assert 'drhs.lhs.calibration: AbsMax' in lines
  assert 'drhs.lhs.rounding: NearestEven' in lines
  assert 'fwd.lhs.numerics.bits = 8' in lines
  assert re.match(r'out [\d.]+  dlhs [\d.]+  drhs [\d.]+$', lines[-1])


def test_sweep_reports_a_tile_that_does_not_divide_in_one_line():
  out = subprocess.run(
    [
      sys.executable,
      'configs/sweep.py',
      '--config=config:int8',
      "--config=fiddler:use_tiling('fwd.lhs', 'subchannel', tile_size=48)",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert out.returncode == 1 and out.stdout == ''
  (line,) = out.stderr.strip().splitlines()
  assert line.startswith('config error: fwd.lhs.tiling: ')
  assert 'tile_size=48 does not divide' in line and '128' in line
