"""Test setup: 8 host CPU devices, fast compiles, strict rank promotion."""

import os

# Tests compile many tiny programs: XLA's backend optimizations (LLVM passes)
# cost more than they save there, and XLA:CPU's classic emitters compile
# faster than its fusion emitters. The flags are no fast-math, but they
# change the last bits of some results against XLA's defaults (gelu, atan
# or erfinv within 1-2 ulp, some reductions' summation order): a test
# compares programs compiled with the same flags, and the tests of serve ==
# train under XLA's defaults run a subprocess without XLA_FLAGS.
# Subprocesses that want one device use AQTR_TEST_XLA_FLAGS. Set either
# variable yourself to override it.
# `-fast-isel=false` (an LLVM option) is what keeps serve == train bit-exact
# at LLVM -O0: without it one fusion got an FMA contraction in one program
# and not in another, depending on the other kernels of its LLVM module
# (benchmarks/xla_cpu_fma_contraction.md; tests/test_compile_flags.py).
# One codegen split per program saves the per-module overhead (the two
# pytest-xdist workers keep both cores busy). Measured against the fusion
# emitters at -O0 (`pytest -q -n 0`, user + sys CPU s, AMD EPYC family 25):
# tests/core 167 -> 88, flax 177 -> 114, train 98 -> 58, test_docs.py
# 213 -> 122, papers 99 -> 55, colabs 108 -> 75 (1-minute load 2-7).
os.environ.setdefault(
  'AQTR_TEST_XLA_FLAGS',
  '--xla_cpu_use_fusion_emitters=false '
  '--xla_backend_optimization_level=0 '
  '--xla_llvm_disable_expensive_passes=true '
  '--xla_backend_extra_options=-fast-isel=false '
  '--xla_cpu_parallel_codegen_split_count=1',
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


# With `-n N` (pyproject's addopts say `--dist=loadgroup`), a worker runs
# whole work units: a test module, the modules of a group here, or the tests
# marked `xdist_group(name)` (a docs page's blocks, tests/test_docs.py). A
# module-scoped fixture (a training run) or a functools.cache shared by the
# modules of a group (tests/qt/digits_mlp.py, tests/pax/helpers.py) is then
# built once instead of once per worker, and a function a module's tests
# share compiles on one worker only. Heavy units start first, then the
# others by number of tests, so that no long unit is left for the end of
# the run while the other worker idles. Each tests/papers/ module is a unit
# of its own.
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
# Units that hold long runs (a training fixture, a paper's claim, the
# notebooks): they start before the others. Ordered by their number of
# tests alone, a module holding one or two end-to-end tests of 5 to 28 s
# (wall, `pytest -n 2 --durations=120` on a loaded host, 2026-11-28) was
# among the last units handed out (tests/ptq/test_pax.py was the very
# last), and ran while the other worker idled; LONG lists them.
LONG = (
  'tests/lora/test_job.py',
  'tests/ptq/test_pax.py',
  'tests/flax/test_serving_edge_cases.py',
  'tests/pax/test_sharding.py',
  'tests/flax/test_kv_blocks.py',
  'tests/flax/test_decode.py',
  'tests/core/test_operand_edge_cases.py',
  'tests/pax/test_configs.py',
  'tests/ptq/test_awq.py',
  'tests/pax/test_moe.py',
  'tests/lora/test_mesh.py',
  'tests/flax/test_quantize.py',
  'tests/flax/test_sparse.py',
  'tests/flax/test_kv_cache.py',
  'tests/ptq/test_smoothquant.py',
  'tests/flax/test_rule_moe.py',
  'tests/ptq/test_quantize.py',
  'tests/configs/test_configs.py',
  'tests/test_extras.py',
  'tests/checkpoints/test_files.py',
)
HEAVY = (
  'tests/papers/',
  'tests/models/',
  'tests/colabs/',
  'tests/train/',
  *LONG,
)
# Modules whose tests share nothing in process (each notebook runs in a
# kernel of its own): every test is a unit, so that both workers take them.
SPLIT = ('tests/colabs/test_notebooks.py',)
_GROUPED = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """`-n N` with no `--dist` or `--dist=loadgroup` schedules by units."""
  if getattr(config.option, 'numprocesses', None) and (
    config.option.dist in ('no', 'loadgroup')
  ):
    config.stash[_GROUPED] = True


def work_unit(nodeid: str) -> str:
  """A test id's unit: its xdist_group, its module's group, its module."""
  if nodeid.rfind('@') > nodeid.rfind(']'):  # `xdist_group`, loadgroup's id
    return nodeid.rsplit('@', 1)[1]
  module = nodeid.split('::', 1)[0]
  return nodeid if module in SPLIT else GROUPS.get(module, module)


def heavy(unit: str) -> bool:
  """Whether a unit starts first: a group or a module under HEAVY."""
  return unit in GROUPS.values() or unit.startswith(HEAVY)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  if not config.stash.get(_GROUPED, False):
    return None
  from xdist.scheduler import LoadScopeScheduling

  class Scheduling(LoadScopeScheduling):
    """Whole units per worker, HEAVY ones first, then the most tests."""

    ordered = False

    def _split_scope(self, nodeid):
      return work_unit(nodeid)

    def _assign_work_unit(self, node):
      if not self.ordered:  # the queue is complete at the first call
        self.ordered = True
        units = sorted(
          self.workqueue.items(),
          key=lambda u: (not heavy(u[0]), -len(u[1])),
        )
        self.workqueue.clear()
        self.workqueue.update(units)
      super()._assign_work_unit(node)

  return Scheduling(config, log)


# Memory. Every jit compile keeps its executable (several MB on XLA:CPU)
# in JAX's caches for the life of the process, so a worker running
# hundreds of test modules grew past 5 GB. After a module or docs page
# that leaves the process above UNIT_RELEASE_MB, and after any test that
# leaves it above RSS_LIMIT_MB, the caches are cleared, cycles collected
# and freed pages handed back to the OS. A later module that calls a
# function compiled before recompiles it (a module's own tests, fixtures
# and shared caches within it are not affected). A release costs ~0.3 s
# of CPU (the collection and the trim), so small modules below
# UNIT_RELEASE_MB share one instead of paying one each.
RSS_LIMIT_MB = 2048
UNIT_RELEASE_MB = 1024
# Tracing allocates many short-lived objects: with Python's default
# thresholds (700, 10, 10) the cyclic collector ran a full collection
# every few seconds over the whole heap (jax, flax, torch), ~3 % of a
# module's CPU. A full collection still runs at every release above.
gc.set_threshold(10_000, 20, 100)
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
  next_unit = None if nextitem is None else release_unit(nextitem.nodeid)
  rss = rss_mb()
  unit_ends = next_unit != release_unit(item.nodeid)
  if rss > RSS_LIMIT_MB or (unit_ends and rss > UNIT_RELEASE_MB):
    release_memory()


def release_unit(nodeid: str) -> str:
  """A test module, or one docs page's blocks (tests/test_docs.py)."""
  module, _, rest = nodeid.partition('::')
  if rest.startswith('test_doc_block['):
    return rest.split('::', 1)[0]  # the page: `test_doc_block[docs/x.md`
  return module
