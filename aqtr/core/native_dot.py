"""A native few-row integer dot for XLA:CPU, built on first use.

XLA:CPU runs an int8 dot of one to sixteen activation rows against a
weight at about half of memory bandwidth, and has no int4 dot (it widens
int4 codes to int8 first): at batch 1 an int8 model decodes barely faster
than float32. `native_dot.cc` streams each weight row once against every
activation row (AVX-512 VNNI `vpdpbusd`, or AVX2 `vpmaddwd` where the host
has no VNNI) and reads int4 weights packed; at one or two rows it reads
weights at memory bandwidth (benchmarks/native_dot.py).

    out[b, m, n] = sum_k a[b, m, k] w[b, n, k]    (int32, wrapping)

Integer sums are exact, so the kernel's results are XLA's dot's bits: a
model serves the same bits with or without it, and serve == train holds.

The kernel is compiled on first use with the host's C++ compiler (`CXX`,
else `c++`) against jaxlib's FFI headers, cached under
`$AQTR_KERNEL_CACHE` (default `~/.cache/aqtr/kernels`, else a per-user
directory in the temp dir; keyed by source,
jaxlib version, compiler and flags), registered as an XLA FFI target, and
checked against XLA's own dot once per process. It is used only where all
of these hold; otherwise the engine runs XLA's dot, as before:

- the host has AVX-512 VNNI and BW, or AVX2 (`/proc/cpuinfo`; `form`;
  `AQTR_NATIVE_ISA=avx2` takes the AVX2 form on a VNNI host), a compiler
  builds the source, and the check passes (a failed build or check warns
  once);
- `AQTR_NATIVE_DOT` is not `0` (set it to `0` to turn the kernel off, e.g.
  before `jax.export`: an exported program that holds the custom call
  needs this target registered where it runs);
- the dot is lowered for CPU outside a mesh, with at most `max_rows()`
  activation rows (16 for the AVX-512 form, 4 for AVX2: where XLA's own
  int8 dot catches up, measured), a contraction of at least 128 (32 at
  one or two rows: shorter tiles of sub-channel formats run XLA's dot),
  int8 activations and int8 or int4 weights (int4 with an even
  contraction; or int4 codes packed two a byte in uint8 [..., N, K / 2],
  the even code in the low nibble, as aqtr's `int4` codec stores them),
  both operands contracting their minor axis.

Internal API (for `passes.py`): `usable`, `rows_dot`, `max_rows`; `form`,
`ready` and `cpu_flags` for benchmarks and tests.

Example:
  >>> a = jnp.ones((1, 1, 64), jnp.int8)
  >>> w = jnp.ones((1, 3, 64), jnp.int8)
  >>> f = rows_dot if usable(a, w) else xla_rows_dot
  >>> f(a, w).tolist()
  [[[64, 64, 64]]]
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import batching, mlir

from aqtr.core import codecs, prims
from aqtr.core.lowering import NATIVE_DOT as TARGET
from aqtr.core.lowering import loops_allowed

_SOURCE = pathlib.Path(__file__).with_name('native_dot.cc')
_FLAGS = ('-O3', '-std=c++20', '-mtune=native', '-shared', '-fPIC', '-w')
# The kernel's forms, fastest first: (name, CPU flags it needs, its flags,
# the most rows it takes: beyond them XLA's own int8 dot is as fast,
# measured on AMD Zen 4 with benchmarks/native_dot.py).
FORMS = (
  (
    'avx512_vnni',
    ('avx512f', 'avx512bw', 'avx512_vnni'),
    ('-mavx512f', '-mavx512bw', '-mavx512vnni'),
    16,
  ),
  ('avx2', ('avx2',), ('-mavx2',), 4),
)


def xla_rows_dot(a: jax.Array, w: jax.Array) -> jax.Array:
  """XLA's dot of the same contract as `rows_dot`, as the engine ran it
  before the kernel: operands pinned by a barrier (so XLA keeps the int8
  dot), a one-row dot given a zero row (XLA:CPU runs a one-row integer dot
  as a slow int32 loop; integer sums are exact: same bits)."""
  m, n = a.shape[-2], a.ndim - 2
  if w.dtype == jnp.uint8:  # Packed int4 codes.
    w = codecs.get('int4')().decode({'int4': w}, dtype=jnp.int8)
  if m == 1:
    a = jnp.concatenate([a, jnp.zeros_like(a)], axis=-2)
  a, w = lax.optimization_barrier((a, w.astype(jnp.int8)))
  dn = (((n + 1,), (n + 1,)), (tuple(range(n)), tuple(range(n))))
  out = prims.dot_general(a, w, dn, preferred_element_type=jnp.int32)
  return out[..., :m, :]


def rows_dot(a: jax.Array, w: jax.Array) -> jax.Array:
  """[..., M, K] int8 . [..., N, K] int8|int4 -> [..., M, N] int32 (or
  [..., N, K / 2] uint8: int4 codes packed two a byte, the even code in
  the low nibble, as `codecs.Int4` stores them).

  One primitive (`aqtr_int_rows_dot` in a jaxpr): lowered for CPU to the
  native kernel, and to `xla_rows_dot` elsewhere, under `jax.export` (a
  custom call is not a portable artifact) and where the kernel is not
  built. Call where `usable(a, w)`.
  """
  return rows_dot_p.bind(a, w)


def _abstract(a, w):
  return jax.core.ShapedArray(a.shape[:-1] + w.shape[-2:-1], jnp.int32)


def _batched(args, dims):
  a, w = args
  size = next(
    x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None
  )
  a, w = (
    jnp.broadcast_to(x[None], (size, *x.shape))
    if d is None
    else jnp.moveaxis(x, d, 0)
    for x, d in zip(args, dims, strict=True)
  )
  return rows_dot_p.bind(a, w), 0


_xla_lowering = mlir.lower_fun(xla_rows_dot, multiple_results=False)


def _cpu_lowering(ctx, a, w):
  if ctx.module_context.lowering_parameters.for_export or not ready():
    return _xla_lowering(ctx, a, w)
  return jax.ffi.ffi_lowering(TARGET)(ctx, a, w)


rows_dot_p = jex_core.Primitive('aqtr_int_rows_dot')
rows_dot_p.def_abstract_eval(_abstract)
_eager = jax.jit(lambda a, w: rows_dot_p.bind(a, w))  # Compiled once.
rows_dot_p.def_impl(lambda a, w: _eager(a, w))
mlir.register_lowering(rows_dot_p, _xla_lowering)
mlir.register_lowering(rows_dot_p, _cpu_lowering, platform='cpu')
batching.primitive_batchers[rows_dot_p] = _batched


def usable(a: jax.Array, w: jax.Array) -> bool:
  """Whether `rows_dot(a, w)` may replace XLA's dot (shapes, dtypes, rows,
  no mesh, the switch, and the kernel built and checked on this host)."""
  if a.ndim < 2 or a.ndim != w.ndim or a.shape[:-2] != w.shape[:-2]:
    return False
  m, k = a.shape[-2:]
  packed = w.dtype == jnp.uint8
  if k != w.shape[-1] * (1 + packed) or not 0 < m <= max_rows() or not k:
    return False
  if k < (32 if m <= 2 else 128):  # Short tiles: each output's horizontal
    return False  # sum outweighs its few steps (measured: XLA is faster).

  if a.dtype != jnp.int8 or w.dtype not in (jnp.int8, jnp.int4, jnp.uint8):
    return False
  if w.dtype == jnp.int4 and k % 2:
    return False
  if os.environ.get('AQTR_NATIVE_DOT', '1') == '0':
    return False
  if not loops_allowed(a, w):
    return False
  return ready()


@functools.cache
def cpu_flags() -> frozenset[str]:
  """The host CPU's flags (`/proc/cpuinfo`; empty where there is none).
  Read once: `usable` asks at every traced integer dot."""
  try:
    text = pathlib.Path('/proc/cpuinfo').read_text()
  except OSError:
    return frozenset()
  for line in text.splitlines():
    if line.startswith('flags'):
      return frozenset(line.split(':', 1)[1].split())
  return frozenset()


def form() -> tuple[str, tuple[str, ...]] | None:
  """(name, compiler flags) of the kernel's form for this host: the
  fastest whose CPU flags it has, or the one `AQTR_NATIVE_ISA` names (to
  compare forms on one host); None where none runs.

  Example:
    >>> form() is None or form()[0] in ('avx512_vnni', 'avx2')
    True
  """
  flags, wanted = cpu_flags(), os.environ.get('AQTR_NATIVE_ISA')
  for name, needs, cflags, _ in FORMS:
    if set(needs) <= flags and wanted in (None, name):
      return name, cflags
  return None


def max_rows() -> int:
  """The most activation rows the kernel takes on this host (0: none)."""
  chosen = form()
  return next(r for n, _, _, r in FORMS if n == chosen[0]) if chosen else 0


def _compiler() -> str | None:
  for name in (os.environ.get('CXX'), 'c++', 'g++', 'clang++'):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cache_dir() -> pathlib.Path:
  root = os.environ.get('AQTR_KERNEL_CACHE')
  if root:
    return pathlib.Path(root)
  xdg = os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache'
  return pathlib.Path(xdg) / 'aqtr' / 'kernels'


def _temp_cache() -> pathlib.Path:
  """The fallback cache: a per-user directory in the temp dir (not named
  `aqtr`, which would shadow the package for a script run from there)."""
  return pathlib.Path(tempfile.gettempdir()) / f'aqtr-kernels-{os.getuid()}'


def _build(compiler: str, cflags: tuple[str, ...] = ()) -> pathlib.Path:
  """Compiles the kernel with `cflags` (or finds it cached); returns the
  library path."""
  version = subprocess.run(
    [compiler, '--version'], capture_output=True, text=True, check=False
  ).stdout.splitlines()[:1]
  key = hashlib.sha256()
  flags = (*_FLAGS, *cflags)
  for part in (_SOURCE.read_bytes(), jax.lib.__version__, *version, *flags):
    key.update(part if isinstance(part, bytes) else part.encode())
  name = f'native_dot-{key.hexdigest()[:16]}.so'
  for root in (_cache_dir(), _temp_cache()):
    path = root / name
    if path.exists():
      return path
    try:
      root.mkdir(mode=0o700, parents=True, exist_ok=True)
      if root.stat().st_uid != os.getuid():
        continue  # Someone else's directory: never load a library from it.
      fd, tmp = tempfile.mkstemp(suffix='.so', dir=root)
      os.close(fd)
    except OSError:
      continue  # Not writable: the next place.
    cmd = [compiler, *flags, f'-I{jax.ffi.include_dir()}', str(_SOURCE)]
    done = subprocess.run([*cmd, '-o', tmp], capture_output=True, text=True)
    if done.returncode:
      os.unlink(tmp)
      lines = (done.stderr or done.stdout).strip().splitlines()
      errors = [x for x in lines if 'error' in x] or lines or ['failed']
      raise RuntimeError(f'{compiler}: {errors[0].strip()}')
    os.replace(tmp, path)  # Atomic: concurrent builders race harmlessly.
    return path
  raise RuntimeError('no writable cache directory (set AQTR_KERNEL_CACHE)')


def _ffi_rows_dot(a, w):
  out = jax.ShapeDtypeStruct(a.shape[:-1] + w.shape[-2:-1], jnp.int32)
  return jax.ffi.ffi_call(TARGET, out)(a, w)


def _check() -> None:
  """The kernel against XLA's dot on awkward shapes, both weight types."""
  rng = np.random.default_rng(0)
  for m, n, k, dtype in (
    (1, 3, 130, jnp.int8),
    (11, 70, 256, jnp.int8),
    (3, 5, 258, jnp.int4),
    (9, 66, 128, jnp.int4),
    (2, 7, 130, jnp.uint8),
  ):
    a = jnp.asarray(rng.integers(-128, 128, (2, m, k)), jnp.int8)
    lo = -128 if dtype == jnp.int8 else -8
    w = jnp.asarray(rng.integers(lo, -lo, (2, n, k)), jnp.int8)
    if dtype == jnp.uint8:  # The same codes packed, as the codec stores them
      w = codecs.get('int4')().encode(w)['int4']
    else:
      w = w.astype(dtype)
    got = jax.jit(_ffi_rows_dot)(a, w)
    want = jax.jit(xla_rows_dot)(a, w)
    if not np.array_equal(np.asarray(got), np.asarray(want)):
      raise RuntimeError(f'differs from XLA dot ({dtype.__name__} weights)')


@functools.cache
def ready() -> bool:
  """Whether the kernel is built, registered and checked on this host
  (once per process; a failure warns once and leaves XLA's dot)."""
  chosen = form()
  if chosen is None:
    return False  # Neither AVX-512 VNNI nor AVX2: XLA's dot, no warning.
  compiler = _compiler()
  if compiler is None:
    warnings.warn(
      'aqtr: no C++ compiler found (set CXX); few-row int8 dots run '
      "XLA:CPU's own, slower dot",
      stacklevel=2,
    )
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(str(_build(compiler, chosen[1])))
    jax.ffi.register_ffi_target(
      TARGET, jax.ffi.pycapsule(lib.AqtrIntRowsDot), platform='cpu'
    )
    # On a thread of its own: JAX's trace state is per thread, so the check
    # runs now even when first asked inside a trace.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      pool.submit(_check).result()
  except (OSError, RuntimeError, subprocess.SubprocessError) as e:
    warnings.warn(
      f'aqtr: native int8 dot unavailable ({e}); XLA:CPU dots run instead',
      stacklevel=2,
    )
    return False
  return True
