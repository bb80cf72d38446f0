"""The engine's per-platform lowering (`aqtr.core.lowering`).

One traced function holds a CPU form and a GPU form. Exported for CUDA
from this CPU machine (`jax.export`, `platforms=('cuda',)`), the StableHLO
of an int8 / fp8 fwd+VJP must be what cuBLASLt runs fast: no fence,
every low-precision dot with both operands contracting their minor axis,
nothing between a quantization and its GEMM, only 1-byte arrays
transposed, no operand-sized mask or copy made by the non-finite guard.
The GPU form is also run on CPU (each module's `per_platform` made to
take it) and must compute what the CPU form computes.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import presets
from aqtr.calibrations import absmax
from aqtr.core import boundary, lowering, passes
from aqtr.tilings.subchannel import SubChannel

MK_KN = (((1,), (0,)), ((), ()))
MK_NK = (((1,), (1,)), ((), ()))
M, K, N = 64, 128, 32
LOW = ('i8', 'f8E4M3FN', 'f8E5M2')


def _vjp(cfg, dn):
  def f(a, b, g):
    out, pull = jax.vjp(lambda a, b: aqtr.dot_general(a, b, dn, cfg), a, b)
    return out, pull(g)

  return f


def _structs(dn, dtype=jnp.bfloat16):
  rhs = (K, N) if dn == MK_KN else (N, K)
  return tuple(jax.ShapeDtypeStruct(s, dtype) for s in ((M, K), rhs, (M, N)))


def _stablehlo(cfg, dn, platforms=('cuda',)) -> str:
  exp = jax.export.export(jax.jit(_vjp(cfg, dn)), platforms=platforms)
  return exp(*_structs(dn)).mlir_module()


_TYPE = r'tensor<([0-9x]+)x([a-zA-Z0-9]+)>'


def _low_barriers(text: str) -> list[str]:
  """The `optimization_barrier`s holding a 1-byte array: the CPU form's
  (its fences carry the forward lhs's codes, its dots' operands are
  pinned); the GPU form has none."""
  return [
    line
    for line in text.splitlines()
    if 'optimization_barrier' in line and any(f'x{t}>' in line for t in LOW)
  ]


def _dots(text: str) -> list[tuple[str, str, str, str]]:
  """(lhs type, rhs type, contracting dims) of every dot_general."""
  out = []
  for line in text.splitlines():
    if 'stablehlo.dot_general' not in line:
      continue
    dims = re.search(r'contracting_dims = \[(\d+)\] x \[(\d+)\]', line)
    (ls, lt), (rs, rt) = re.findall(_TYPE, line.split(':', 1)[1])[:2]
    out.append((lt, rt, dims.groups(), (ls, rs)))
  return out


@pytest.mark.parametrize('name', ['int8', 'fp8'])
@pytest.mark.parametrize('dn', [MK_KN, MK_NK], ids=['mk_kn', 'mk_nk'])
def test_cuda_export_is_three_tn_gemms_with_no_fence(name, dn):
  text = _stablehlo(getattr(presets, name)(), dn)
  assert not _low_barriers(text)
  dots = _dots(text)
  assert len(dots) == 3, dots
  for lt, rt, (lc, rc), (ls, rs) in dots:
    assert lt in LOW and rt in LOW, (lt, rt)
    # Both contract their minor (last) axis: "TN" for cuBLASLt.
    assert int(lc) == ls.count('x') and int(rc) == rs.count('x'), dots


@pytest.mark.parametrize('name', ['int8', 'fp8'])
def test_cuda_export_has_nothing_between_quantize_and_gemm(name):
  text = _stablehlo(getattr(presets, name)(), MK_KN)
  operand = min(M * K, K * N, M * N)
  for line in text.splitlines():
    types = re.findall(_TYPE, line.split(':', 1)[-1]) if ':' in line else []
    sizes = [
      (int(np.prod([int(d) for d in s.split('x')])), t) for s, t in types
    ]
    if 'optimization_barrier' in line:  # Scales only, never the values.
      assert all(t not in LOW for _, t in sizes), line
      assert all(n < operand for n, _ in sizes), line
    if 'stablehlo.transpose' in line:  # 1-byte arrays, or small ones.
      assert all(t in LOW or n < operand for n, t in sizes), line
    if 'stablehlo.select' in line:  # No operand-sized guard mask.
      assert all(n < operand for n, _ in sizes), line
  # One absmax reduction per quantization (x, w, g twice): the non-finite
  # guard reads NaN off the max (XLA:GPU's max propagates it).
  assert text.count('stablehlo.reduce(') == 4, text.count('stablehlo.reduce(')


def test_one_function_serves_cpu_and_cuda():
  text = _stablehlo(presets.int8(), MK_KN, platforms=('cpu', 'cuda'))
  assert _low_barriers(text)  # The CPU form's fences are kept too.
  cpu = _stablehlo(presets.int8(), MK_KN, platforms=('cpu',))
  assert _low_barriers(cpu)
  # XLA:CPU keeps the forward's fence (a conditional it cannot fold).
  f = jax.jit(_vjp(presets.int8(), MK_KN))
  assert ' conditional(' in f.lower(*_structs(MK_KN)).compile().as_text()
  # The CPU form: lhs contracts its last axis, a [K, N] rhs its first.
  assert ('i8', 'i8', ('2', '1')) in [d[:3] for d in _dots(cpu)]


def _int8_tiles(tile: int = 32):
  """int8 with scales per tile of `tile` along every contraction."""
  cfg = presets.int8()
  t = SubChannel(tile_size=tile, tile_count=0)

  def tiled(raw):
    return dataclasses.replace(
      raw,
      lhs=dataclasses.replace(raw.lhs, tiling=t),
      rhs=dataclasses.replace(raw.rhs, tiling=t),
    )

  return dataclasses.replace(
    cfg, fwd=tiled(cfg.fwd), dlhs=tiled(cfg.dlhs), drhs=tiled(cfg.drhs)
  )


def test_tiles_on_cuda_are_one_dense_dot():
  # Sub-channel scales: lowered for GPU the forward is one dot of the
  # dequantized operands (no per-tile dots and tile sums); for CPU, one
  # native int8 dot per tile of 32.
  fwd = _dots(_stablehlo(_int8_tiles(), MK_KN))[0]
  assert fwd[:2] == ('f32', 'f32') and fwd[3] == ('1x64x128', '1x128x32')
  fwd = _dots(_stablehlo(_int8_tiles(), MK_KN, platforms=('cpu',)))[0]
  assert fwd[:2] == ('i8', 'i8') and fwd[3][0] == '4x64x32'


def test_mx_blocks_are_one_dense_dot_on_every_platform():
  # Emulated fp8 blocks: dense for CPU too (XLA:CPU emulates fp8 dots).
  for platforms in (('cpu',), ('cuda',)):
    fwd = _dots(_stablehlo(presets.mxfp8(), MK_KN, platforms))[0]
    assert fwd[:2] == ('f32', 'f32') and fwd[3][0] == '1x64x128', fwd


@pytest.fixture
def gpu_form(monkeypatch):
  """Every `per_platform` takes its GPU form, also on CPU."""

  def gpu_only(*args, cpu, gpu):
    del cpu
    return gpu(*args)

  for module in (lowering, boundary, passes, absmax):
    monkeypatch.setattr(module, 'per_platform', gpu_only)


def _run(cfg, dn, seed=0):
  a, b, g = (
    jax.random.normal(k, s.shape)
    for k, s in zip(
      jax.random.split(jax.random.key(seed), 3),
      _structs(dn, jnp.float32),
      strict=True,
    )
  )
  return jax.jit(_vjp(cfg, dn))(a, b, g)


@pytest.mark.parametrize(
  'name, dn',
  [
    ('int8', MK_KN),
    ('int8', MK_NK),
    ('fp8', MK_KN),
    ('mxfp8', MK_KN),
    ('nvfp4', MK_NK),
    ('int4_weight_only', MK_KN),
    ('tiles', MK_NK),
  ],
)
def test_the_gpu_form_computes_what_the_cpu_form_computes(name, dn, request):
  cfg = _int8_tiles() if name == 'tiles' else getattr(presets, name)()
  want = jax.tree.leaves(_run(cfg, dn))
  request.getfixturevalue('gpu_form')
  got = jax.tree.leaves(_run(cfg, dn))
  for w, x in zip(want, got, strict=True):
    # Integer dots are exact; only the f32 rescale and tile sums may
    # round in another order.
    np.testing.assert_allclose(x, w, rtol=2e-6, atol=2e-6)


def test_the_gpu_form_keeps_non_finite_rows(gpu_form):
  del gpu_form
  a = jnp.ones((4, 16)).at[1, 3].set(jnp.nan)
  b = jnp.ones((16, 8))
  out = aqtr.dot_general(a, b, MK_KN, presets.int8())
  want = jax.lax.dot_general(a, b, MK_KN)
  np.testing.assert_array_equal(jnp.isnan(out), jnp.isnan(want))
