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

import ctypes
import ctypes.util
import gc

import hypothesis
import jax
import pytest

jax.config.update('jax_numpy_rank_promotion', 'raise')

# CI runs the property tests on a fixed set of examples (reproducible);
# locally hypothesis explores new ones each run.
hypothesis.settings.register_profile('ci', derandomize=True, database=None)
if os.environ.get('CI'):
  hypothesis.settings.load_profile('ci')


# With `-n N`, the modules of a group here run on one worker, and groups
# start first (most tests first): a module-scoped fixture (a training run)
# or a functools.cache shared by the modules (tests/qt/digits_mlp.py,
# tests/pax/helpers.py) is built once instead of once per worker, and a
# long test does not end the run on one worker while the other idles.
# Each tests/papers/ module is a group of its own. Every other test goes to
# whichever worker is free, one at a time.
GROUPS = {
  'tests/train/test_main.py': 'train_main',
  'tests/train/test_mesh.py': 'train_mesh',
  'tests/train/test_cli.py': 'train_cli',
  'tests/data/test_stdlib.py': 'stdlib',
  'tests/qt/test_training.py': 'digits_mlp',
  'tests/qt/test_adam.py': 'digits_mlp',
  'tests/pax/test_inject.py': 'pax_float_lm',
  'tests/pax/test_transformer.py': 'pax_float_lm',
  'tests/pax/test_decode.py': 'pax_decode',
  'tests/train/test_generate.py': 'train_generate',
}
_GROUPED = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """`-n N` without `--dist` schedules as GROUPS says."""
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
      if module.startswith('tests/papers/'):  # A claim's run per module.
        return GROUPS.get(module, module)
      return GROUPS.get(module, nodeid)

  return Scheduling(config, log)


# Memory. Every jit compile keeps its executable (several MB on XLA:CPU)
# in JAX's caches for the life of the process, so a worker running
# hundreds of test modules grew past 5 GB. After each module (and after
# any test that leaves the process above RSS_LIMIT_MB) the caches are
# cleared, cycles collected and freed pages handed back to the OS. A later
# module that calls a function compiled before recompiles it (a module's
# own tests, fixtures and shared caches within it are not affected).
RSS_LIMIT_MB = 2048
_LIBC = ctypes.util.find_library('c')
_TRIM = getattr(ctypes.CDLL(_LIBC), 'malloc_trim', None) if _LIBC else None


def rss_mb() -> float:
  """This process's resident memory in MiB (0 where /proc is missing)."""
  try:
    with open('/proc/self/statm') as f:
      pages = int(f.read().split()[1])
  except (OSError, IndexError, ValueError):
    return 0.0
  return pages * os.sysconf('SC_PAGE_SIZE') / 2**20


def release_memory() -> None:
  """Drops JAX's compilation caches and returns freed memory to the OS."""
  jax.clear_caches()
  gc.collect()
  if _TRIM is not None:
    _TRIM(0)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  """After the module's fixtures are torn down: release memory."""
  next_module = None if nextitem is None else nextitem.nodeid.split('::')[0]
  if next_module != item.nodeid.split('::')[0] or rss_mb() > RSS_LIMIT_MB:
    release_memory()
