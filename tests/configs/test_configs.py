"""Every config under configs/ builds and runs one quantized step.

configs/*.py: a script (it has a `__main__` block) runs with a preset from
the command line; any other file is imported and each of its public
zero-argument functions returning `fdl.Config` is a config. configs/gin/:
each .gin file builds a DotGeneralConfig.
"""

import inspect
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import aqtr
from aqtr import flags as aqtr_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / 'configs'
PY = sorted(CONFIGS.glob('*.py'))
SCRIPTS = [p for p in PY if "__name__ == '__main__'" in p.read_text()]
MODULES = [p for p in PY if p not in SCRIPTS]
GIN = sorted((CONFIGS / 'gin').glob('*.gin'))
STEMS = {p.stem for p in PY}


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


def _config_functions(path):
  module = aqtr_flags.import_modules([str(path)])[0]
  found = {}
  for name, fn in vars(module).items():
    if name.startswith('_') or not inspect.isfunction(fn):
      continue
    if fn.__module__ != module.__name__:
      continue
    sig = inspect.signature(fn)
    required = [
      p for p in sig.parameters.values() if p.default is inspect.Parameter.empty
    ]
    if not required and 'Config' in str(sig.return_annotation):
      found[name] = fn
  return found


def _one_step(config: aqtr.DotGeneralConfig):
  """Output and both gradients of a small quantized x . w, all finite."""
  assert not config.is_float
  dn = (((1,), (0,)), ((), ()))
  kx, kw, kn = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (32, 64))  # M = 32: MX blocks fit drhs.
  w = jax.random.normal(kw, (64, 32))

  @jax.jit
  def loss(x, w):
    return jnp.sum(aqtr.dot_general(x, w, dn, config, key=kn) ** 2)

  value, grads = jax.value_and_grad(loss, (0, 1))(x, w)
  for a in (value, *grads):
    assert bool(jnp.all(jnp.isfinite(a)))


def test_configs_exist():
  assert MODULES and SCRIPTS and GIN


@pytest.mark.parametrize('path', MODULES, ids=lambda p: p.name)
def test_python_configs_build_and_run(path, scratch_registries):
  functions = _config_functions(path)
  assert functions, f'{path.name} defines no config function'
  for fn in functions.values():
    _one_step(aqtr.fiddle.build(fn()))


@pytest.mark.parametrize('path', GIN, ids=lambda p: p.name)
def test_gin_configs_build_and_run(path):
  gin = pytest.importorskip('gin')
  import aqtr.gin

  gin.clear_config()
  try:
    config = aqtr.gin.config_from_gin(str(path))
  finally:
    gin.clear_config()
  preset = getattr(aqtr.presets, path.stem, None)
  if preset is not None:
    assert config == preset()
  _one_step(config)


@pytest.mark.parametrize('path', SCRIPTS, ids=lambda p: p.name)
def test_scripts_run_a_preset(path):
  cmd = [sys.executable, str(path), '--config=config:fp8', '--shape=8,32,16']
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "fwd.lhs.numerics.dtype_name = 'float8_e4m3fn'" in out.stdout
