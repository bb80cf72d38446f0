"""Test setup: 8 host CPU devices, fast compiles, strict rank promotion."""

import os

# Tests compile many tiny programs: XLA's backend optimizations (LLVM passes)
# cost more than they save there, and they do not change what a program
# computes (no fast-math). Subprocesses that want one device use
# AQTR_TEST_XLA_FLAGS. Set either variable yourself to override it.
os.environ.setdefault(
  'AQTR_TEST_XLA_FLAGS',
  '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true',
)
os.environ.setdefault(
  'XLA_FLAGS',
  '--xla_force_host_platform_device_count=8 '
  + os.environ['AQTR_TEST_XLA_FLAGS'],
)

import hypothesis
import jax
import pytest

jax.config.update('jax_numpy_rank_promotion', 'raise')

# CI runs the property tests on a fixed set of examples (reproducible);
# locally hypothesis explores new ones each run.
hypothesis.settings.register_profile('ci', derandomize=True, database=None)
if os.environ.get('CI'):
  hypothesis.settings.load_profile('ci')


# With `-n N`, each module here runs whole on one worker, and these modules
# start first (most tests first): each builds a module-scoped fixture (a
# training run) once instead of once per worker, or holds a long test that
# would otherwise end the run on one worker while the other idles. Every
# other test goes to whichever worker is free, one at a time.
WHOLE_MODULES = (
  'tests/train/test_main.py',
  'tests/train/test_mesh.py',
  'tests/train/test_cli.py',
  'tests/papers/test_int8_training_matches_float.py',
  'tests/papers/test_four_bit_pareto.py',
  'tests/papers/test_fp8_formats_and_scaling.py',
  'tests/data/test_stdlib.py',
)
_GROUPED = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """`-n N` without `--dist` schedules as WHOLE_MODULES says."""
  if getattr(config.option, 'numprocesses', None) and (
    config.option.dist == 'no'
  ):
    config.stash[_GROUPED] = True


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  if not config.stash.get(_GROUPED, False):
    return None
  from xdist.scheduler import LoadScopeScheduling

  class Scheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      module = nodeid.split('::', 1)[0]
      return module if module in WHOLE_MODULES else nodeid

  return Scheduling(config, log)
