"""The native few-row integer dot: XLA's dot's bits, and where it is used."""

import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aqtr.core import codecs, lowering, native_dot

# Where the host can build the kernel, it must: a broken build would
# otherwise only show as a skip.
CAN_BUILD = native_dot.form() is not None and bool(native_dot._compiler())
needs_kernel = pytest.mark.skipif(
  not CAN_BUILD, reason='no AVX-512 VNNI / AVX2 or no C++ compiler here'
)


def _codes(seed, shape, dtype):
  lo = -8 if dtype == jnp.int4 else -128
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(lo, -lo, shape), dtype)


@needs_kernel
def test_builds_and_checks_where_the_host_can():
  assert native_dot.ready()


@needs_kernel
@pytest.mark.parametrize('dtype', [jnp.int8, jnp.int4])
@pytest.mark.parametrize('m', [1, 2, 3, 8, 9, 16])
@pytest.mark.parametrize('k', [2, 64, 66, 128, 130, 258])
def test_equals_xla_dot(dtype, m, k):
  a = _codes(m * k, (2, m, k), jnp.int8)
  w = _codes(k, (2, 37, k), dtype)
  got = jax.jit(native_dot.rows_dot)(a, w)
  want = jax.jit(native_dot.xla_rows_dot)(a, w)
  np.testing.assert_array_equal(got, want)


@needs_kernel
@pytest.mark.parametrize('dtype', [jnp.int8, jnp.int4])
def test_extreme_codes_and_large_weights_threaded(dtype):
  # -128 activations (a ^ 0x80 == 0) and the most negative weight code;
  # 2 MiB of weights: split between threads.
  k = 2048
  a = jnp.full((1, 3, k), -128, jnp.int8).at[0, 1].set(127)
  w = (
    _codes(1, (1, 1024, k), dtype)
    .at[0, :7]
    .set(-8 if dtype == jnp.int4 else -128)
  )
  got = jax.jit(native_dot.rows_dot)(a, w)
  np.testing.assert_array_equal(got, jax.jit(native_dot.xla_rows_dot)(a, w))


@needs_kernel
def test_wraps_modulo_2_32_as_xla_does():
  k = 140_000  # 127 * 127 * k > 2^31.
  a, w = jnp.full((1, 1, k), 127, jnp.int8), jnp.full((1, 2, k), 127, jnp.int8)
  got = np.asarray(jax.jit(native_dot.rows_dot)(a, w))
  want = np.int64(127 * 127 * k)
  assert got[0, 0, 0] == np.int32(((want + 2**31) % 2**32) - 2**31)
  np.testing.assert_array_equal(got, jax.jit(native_dot.xla_rows_dot)(a, w))


@needs_kernel
def test_vmap_and_concurrent_calls():
  a = _codes(0, (4, 1, 2, 512), jnp.int8)
  ws = _codes(1, (4, 1, 1024, 512), jnp.int8)
  got = jax.jit(jax.vmap(native_dot.rows_dot))(a, ws)
  np.testing.assert_array_equal(got, native_dot.xla_rows_dot(a, ws))

  def four(a, ws):  # Independent calls XLA may run at once on its pool.
    return [native_dot.rows_dot(a[i], ws[i]) for i in range(4)]

  for i, out in enumerate(jax.jit(four)(a, ws)):
    np.testing.assert_array_equal(out, native_dot.xla_rows_dot(a[i], ws[i]))


def _packed(codes):
  """int4 codes as aqtr's `int4` codec stores them: uint8, two a byte."""
  return codecs.get('int4')().encode(codes)['int4']


@needs_kernel
@pytest.mark.parametrize('m', [1, 2, 5, 16])
@pytest.mark.parametrize('k', [64, 130, 258, 2048])
def test_packed_int4_bytes_equal_xla_dot_over_the_codes(m, k):
  # The stored bytes of a served int4 weight, read without decoding.
  a = _codes(m + k, (2, m, k), jnp.int8)
  codes = _codes(k + 1, (2, 300, k), jnp.int4).astype(jnp.int8)
  w = _packed(codes)
  assert w.dtype == jnp.uint8 and w.shape == (2, 300, k // 2)
  want = jax.jit(native_dot.xla_rows_dot)(a, codes)
  np.testing.assert_array_equal(jax.jit(native_dot.rows_dot)(a, w), want)
  np.testing.assert_array_equal(jax.jit(native_dot.xla_rows_dot)(a, w), want)


def test_packed_exports_as_xla_dot_over_the_unpacked_codes():
  a = _codes(0, (1, 2, 128), jnp.int8)
  codes = _codes(1, (1, 8, 128), jnp.int4).astype(jnp.int8)
  exp = jax.export.export(jax.jit(native_dot.rows_dot), platforms=('cpu',))
  got = exp(a, _packed(codes))
  assert 'stablehlo.custom_call' not in got.mlir_module()
  np.testing.assert_array_equal(
    got.call(a, _packed(codes)), native_dot.xla_rows_dot(a, codes)
  )


def test_usable_only_for_its_contract(monkeypatch):
  a, w = jnp.zeros((1, 2, 64), jnp.int8), jnp.zeros((1, 5, 64), jnp.int8)
  assert native_dot.usable(a, w) == native_dot.ready()
  many = jnp.zeros((1, native_dot.max_rows() + 1, 64), jnp.int8)
  assert not native_dot.usable(many, w)
  assert not native_dot.usable(a.astype(jnp.int16), w)
  assert not native_dot.usable(a, w.astype(jnp.float32))
  assert not native_dot.usable(a, jnp.zeros((1, 5, 63), jnp.int8))
  assert not native_dot.usable(a[..., :63], jnp.zeros((1, 5, 63), jnp.int4))
  assert not native_dot.usable(a, jnp.zeros((2, 5, 64), jnp.int8))
  packed = jnp.zeros((1, 5, 32), jnp.uint8)  # int4 codes, two a byte
  assert native_dot.usable(a, packed) == native_dot.ready()
  assert not native_dot.usable(a, jnp.zeros((1, 5, 64), jnp.uint8))
  assert not native_dot.usable(a, jnp.zeros((1, 5, 31), jnp.uint8))
  short = jnp.zeros((1, 3, 64), jnp.int8)  # 3 rows, a tile of 64.
  assert not native_dot.usable(short, jnp.zeros((1, 5, 64), jnp.int8))
  assert not native_dot.usable(a[..., :16], jnp.zeros((1, 5, 16), jnp.int8))
  monkeypatch.setenv('AQTR_NATIVE_DOT', '0')
  assert not native_dot.usable(a, w)


def test_not_used_under_a_mesh():
  mesh = jax.make_mesh((1,), ('x',))
  a, w = jnp.zeros((1, 2, 64), jnp.int8), jnp.zeros((1, 5, 64), jnp.int8)
  with jax.set_mesh(mesh):
    assert not native_dot.usable(a, w)


@needs_kernel
def test_build_is_cached_and_a_broken_source_names_the_error(
  tmp_path, monkeypatch
):
  monkeypatch.setenv('AQTR_KERNEL_CACHE', str(tmp_path / 'cache'))
  compiler = native_dot._compiler()
  small = tmp_path / 'small.cc'  # The build logic, not the kernel: fast.
  small.write_text('extern "C" int aqtr_small() { return 1; }\n')
  monkeypatch.setattr(native_dot, '_SOURCE', small)
  first = native_dot._build(compiler)
  stamp = first.stat().st_mtime_ns
  assert native_dot._build(compiler) == first  # Cached: not rebuilt.
  assert first.stat().st_mtime_ns == stamp
  broken = tmp_path / 'native_dot.cc'
  broken.write_text('int main( {\n')
  monkeypatch.setattr(native_dot, '_SOURCE', broken)
  with pytest.raises(RuntimeError, match='error'):
    native_dot._build(compiler)
  assert not list((tmp_path / 'cache').glob('tmp*'))  # No leftovers.


def test_an_unwritable_cache_falls_back_to_the_temp_dir(tmp_path, monkeypatch):
  if not CAN_BUILD:
    pytest.skip('no AVX-512 VNNI / AVX2 or no C++ compiler here')
  if os.geteuid() == 0:  # Root writes anywhere: a file stands in the way.
    blocked = tmp_path / 'file'
    blocked.write_text('')
    monkeypatch.setenv('AQTR_KERNEL_CACHE', str(blocked / 'cache'))
  else:
    ro = tmp_path / 'ro'
    ro.mkdir(mode=0o500)
    monkeypatch.setenv('AQTR_KERNEL_CACHE', str(ro / 'cache'))
  small = tmp_path / 'small.cc'
  small.write_text(f'extern "C" int aqtr_small() {{ return {os.getpid()}; }}\n')
  monkeypatch.setattr(native_dot, '_SOURCE', small)
  path = native_dot._build(native_dot._compiler())
  assert pathlib.Path(path).exists()
  assert path.parent == native_dot._temp_cache()
  assert path.parent.name != 'aqtr'  # Would shadow the package from /tmp.
  path.unlink()


def test_no_compiler_warns_once_and_leaves_xla(monkeypatch):
  if native_dot.form() is None:
    pytest.skip('no AVX-512 VNNI / AVX2: the kernel is never tried')
  monkeypatch.setattr(shutil, 'which', lambda name: None)
  native_dot.ready.cache_clear()
  try:
    with pytest.warns(UserWarning, match='no C\\+\\+ compiler'):
      assert not native_dot.ready()
  finally:
    native_dot.ready.cache_clear()


def test_exported_programs_hold_xla_dots_not_the_custom_call():
  a, w = _codes(0, (1, 1, 128), jnp.int8), _codes(1, (1, 8, 128), jnp.int8)
  exp = jax.export.export(jax.jit(native_dot.rows_dot), platforms=('cpu',))
  text = exp(a, w).mlir_module()
  assert 'stablehlo.custom_call' not in text
  assert 'stablehlo.dot_general' in text
  np.testing.assert_array_equal(
    exp(a, w).call(a, w), native_dot.xla_rows_dot(a, w)
  )
  served = jax.jit(native_dot.rows_dot).lower(a, w).as_text()
  assert (native_dot.TARGET in served) == native_dot.ready()


def test_eager_call_and_is_dot():
  a, w = _codes(0, (2, 3, 64), jnp.int8), _codes(1, (2, 5, 64), jnp.int4)
  np.testing.assert_array_equal(
    native_dot.rows_dot(a, w), native_dot.xla_rows_dot(a, w)
  )
  (eqn,) = jax.make_jaxpr(native_dot.rows_dot)(a, w).eqns
  assert lowering.is_dot(eqn)


_OTHER_FORM = """
import jax, jax.numpy as jnp, numpy as np
from aqtr.core import native_dot
assert native_dot.form()[0] == 'avx2' and native_dot.ready()
rng = np.random.default_rng(0)
for m, k, dtype in [(1, 4096, jnp.int8), (3, 130, jnp.int8), (16, 64, jnp.int8),
                    (1, 4096, jnp.int4), (5, 258, jnp.int4), (9, 62, jnp.int4)]:
  lo = -8 if dtype == jnp.int4 else -128
  a = jnp.asarray(rng.integers(-128, 128, (2, m, k)), jnp.int8)
  w = jnp.asarray(rng.integers(lo, -lo, (2, 300, k)), dtype)
  got = jax.jit(native_dot.rows_dot)(a, w)
  np.testing.assert_array_equal(got, native_dot.xla_rows_dot(a, w))
print('ok')
"""


@pytest.mark.skipif(
  'avx2' not in native_dot.cpu_flags() or not native_dot._compiler(),
  reason='no AVX2 or no C++ compiler here',
)
def test_the_avx2_form_equals_xla_dot():
  # A process of its own: one form is registered per process.
  env = {**os.environ, 'AQTR_NATIVE_ISA': 'avx2', 'JAX_PLATFORMS': 'cpu'}
  done = subprocess.run(
    [sys.executable, '-c', _OTHER_FORM],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0 and done.stdout.strip() == 'ok', done.stderr
