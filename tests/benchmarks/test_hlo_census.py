"""benchmarks/hlo_census.py: the GEMMs, loops and big kernels it counts."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp

import aqtr
from benchmarks import hlo_census

DN = (((1,), (0,)), ((), ()))

# The shapes of an optimized XLA:GPU module (cuBLASLt fp8 custom call split
# over lines with bare names, a Triton GEMM fusion with s8 operands, a
# loop, a transpose and a rescale that each touch two big tensors).
GPU_HLO = (pathlib.Path(__file__).parent / 'gpu_module.hlo').read_text()


def test_gpu_module_gemms_loops_and_big_kernels():
  c = hlo_census.census(GPU_HLO, 64 * 32)
  assert [(g.name, g.kind, g.types) for g in c.gemms] == [
    (
      'cublas-gemm.1',
      'custom-call __cublas$lt$matmul$f8',
      'f8e5m2 x f8e4m3fn -> f32',
    ),
    ('i', 'fusion __triton_gemm', 's8 x s8 -> s32'),
  ]
  assert [g.layout for g in c.gemms] == [
    'K minor: both; out {0,1}',
    'K minor: both',
  ]
  assert c.whiles == 1
  big = {b.name: (b.reads, b.writes) for b in c.big}
  assert big['tr'] == (('f32[64,64]',), ('f32[64,64]',))
  assert big['q'] == (('bf16[64,32]',), ('s8[64,32]',))
  assert 'cublas-gemm.1' not in big and 'i' not in big and 'g' not in big
  assert set(big) == {'q', 'f', 'e', 't2', 'tr', 'out'}
  assert c.gemm_summary() == (
    '__cublas$lt$matmul$f8: f8e5m2 x f8e4m3fn -> f32 '
    '(K minor: both; out {0,1}); '
    '__triton_gemm: s8 x s8 -> s32 (K minor: both)'
  )
  assert c.big_summary() == '6 (6 touch >1)'


def test_cpu_int8_fwd_vjp_has_three_s8_gemms():
  cfg = aqtr.presets.int8()

  def f(x, w, g):
    y, vjp = jax.vjp(lambda x, w: aqtr.dot_general(x, w, DN, cfg), x, w)
    return (y, *vjp(g))

  x = jnp.ones((32, 64), jnp.bfloat16)
  w = jnp.ones((64, 48), jnp.bfloat16)
  g = jnp.ones((32, 48), jnp.bfloat16)
  text = jax.jit(f).lower(x, w, g).compile().as_text()
  c = hlo_census.census(text, 32 * 48)
  s8 = [g for g in c.gemms if g.types.startswith('s8 x s8')]
  assert len(s8) == 3, c.gemm_summary()
  assert c.big, 'the quantizing kernels read operand-sized tensors'


def test_float_dot_gemm_is_float():
  f = jax.jit(lambda a, b: a @ b)
  a = jnp.ones((16, 8), jnp.bfloat16)
  text = f.lower(a, a.T).compile().as_text()
  c = hlo_census.census(text, 64)
  assert len(c.gemms) == 1 and 's8' not in c.gemms[0].types
  assert c.whiles == 0


def test_fusion_gemm_on_converted_operands_names_its_inputs():
  text = """\
%triton_gemm_dot (p0: s8[64,32], p1: f16[16,32]) -> f16[64,16] {
  %p0 = s8[64,32]{1,0} parameter(0)
  %c = f16[64,32]{1,0} convert(s8[64,32]{1,0} %p0)
  %p1 = f16[16,32]{1,0} parameter(1)
  ROOT %dot = f16[64,16]{1,0} dot(f16[64,32]{1,0} %c, %p1),
    lhs_contracting_dims={1}
}

ENTRY %e {
  %a = s8[64,32]{1,0} parameter(0)
  %b = f16[16,32]{1,0} parameter(1)
  ROOT %triton = f16[64,16]{1,0} fusion(s8[64,32]{1,0} %a, %b), kind=kCustom,
    calls=%triton_gemm_dot,
    backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""
  (g,) = hlo_census.census(text, 1 << 30).gemms
  assert (g.name, g.kind) == ('triton', 'fusion __triton_gemm')
  assert g.types == 'f16 x f16 -> f16 [inputs s8, f16]'


def test_layout_names_the_operands_contracting_their_minor_axis():
  text = """\
ENTRY %e (a: s8[64,32], b: s8[32,16], c: s8[16,32]) -> s32[64,16] {
  %a = s8[64,32]{1,0} parameter(0)
  %b = s8[32,16]{1,0} parameter(1)
  %c = s8[16,32]{0,1} parameter(2)
  %d1 = s32[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1},
    rhs_contracting_dims={0}
  ROOT %d2 = s32[64,16]{0,1} dot(%a, %c), lhs_contracting_dims={1},
    rhs_contracting_dims={1}
}
"""
  layouts = [g.layout for g in hlo_census.census(text, 1 << 30).gemms]
  # c is [16, 32] stored column-major: its minor axis is 0, not K.
  assert layouts == ['K minor: lhs', 'K minor: lhs; out {0,1}']


def test_dots_counts_what_xla_kept_and_each_runs_alone():
  # An int8 fwd+VJP whose input gradient is dead: XLA keeps the forward
  # and the weight-gradient dots (int8 x int8 -> int32), not dlhs.
  cfg = aqtr.presets.int8()

  def loss(w, x):
    return (aqtr.dot_general(x, w, DN, cfg) ** 2).sum()

  x, w = jnp.ones((32, 16)), jnp.ones((16, 8))
  text = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
  found = hlo_census.dots(text)
  assert sum(found.values()) == 2
  for (a, b, dn, out), _ in found.items():
    assert (a[1], b[1], out) == ('int8', 'int8', 'int32')
    lhs, rhs = jnp.ones(*a), jnp.ones(*b)
    y = jax.lax.dot_general(lhs, rhs, dn, preferred_element_type=out)
    assert y.shape in {(32, 8), (16, 8), (8, 16)}, (a, b, dn)
  float_text = jax.jit(lambda a, b: a @ b.T).lower(x, x).compile().as_text()
  ((a, b, dn, out), n), *_ = hlo_census.dots(float_text).items()
  assert (a, b, dn, out, n) == (
    ((32, 16), 'float32'),
    ((32, 16), 'float32'),
    (((1,), (1,)), ((), ())),
    'float32',
    1,
  )
