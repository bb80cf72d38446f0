"""The tile sum of the sub-channel dots (`aqtr.core.lowering.tile_sum`) and
the one dot of dequantized operands that replaces it for float dots."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.core import lowering
from aqtr.core.lowering import sub_jaxprs
from aqtr.tilings.subchannel import SubChannel


@pytest.mark.parametrize('n', [1, 2, 7, 32, 33, 70])
def test_tile_sum_is_the_sum_over_tiles(n):
  x = jax.random.normal(jax.random.key(n), (2, n, 5, 3))
  got = jax.jit(lowering.tile_sum)(x)
  assert got.shape == (2, 5, 3)
  np.testing.assert_allclose(got, x.sum(axis=1), rtol=1e-5, atol=1e-5)
  ints = jnp.arange(2 * n * 15).reshape(2, n, 5, 3)
  np.testing.assert_array_equal(lowering.tile_sum(ints), ints.sum(axis=1))


@pytest.mark.skipif(jax.device_count() < 2, reason='needs 2 host devices')
def test_under_a_mesh_it_is_sum_itself():
  x = jax.random.normal(jax.random.key(0), (1, 40, 4, 4))
  mesh = jax.make_mesh((2,), ('k',))
  with jax.set_mesh(mesh):
    got = jax.jit(lowering.tile_sum)(x)
  np.testing.assert_array_equal(got, jax.jit(lambda x: x.sum(axis=1))(x))


def _hlo_dots(f, *args) -> list[str]:
  text = jax.jit(f).lower(*args).compile().as_text()
  return [line for line in text.splitlines() if ' dot(' in line]


def test_a_one_row_int8_dot_runs_as_two_rows_and_is_exact():
  # Decoding at batch 1: XLA:CPU would emit the one-row integer dot as a
  # slow loop; the engine adds a zero row. Integer sums: exact.
  import aqtr

  cfg = aqtr.presets.int8()
  dn = (((1,), (0,)), ((), ()))
  w = jax.random.normal(jax.random.key(0), (64, 48))
  q = aqtr.quantize_operand(w, dn, cfg, operand='rhs')
  x = jax.random.normal(jax.random.key(1), (3, 64))
  got = jax.jit(lambda x, q: aqtr.dot_general(x, q, dn, cfg))(x[:1], q)
  rows = jax.jit(lambda x, q: aqtr.dot_general(x, q, dn, cfg))(x, q)
  np.testing.assert_array_equal(got, rows[:1])
  if jax.default_backend() == 'cpu':
    dots = _hlo_dots(lambda x, q: aqtr.dot_general(x, q, dn, cfg), x[:1], q)
    assert dots and all('s32[2,48]' in d for d in dots), dots


def _weight_only_int4(tile: int):
  """int4 weights in tiles of `tile` inputs, float activations: a float dot."""
  cfg = aqtr.presets.int4_weight_only()
  w = dataclasses.replace(
    cfg.fwd.rhs, tiling=SubChannel(tile_size=tile, tile_count=0)
  )
  return dataclasses.replace(
    cfg,
    fwd=dataclasses.replace(cfg.fwd, rhs=w),
    dlhs=dataclasses.replace(cfg.dlhs, rhs=w),
  )


def _dots(jaxpr) -> list:
  """The dot_general equations of `jaxpr` and its sub-jaxprs."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      out.append(eqn)
    for sub in sub_jaxprs(eqn):
      out += _dots(sub)
  return out


def test_float_dot_over_tiles_is_one_dot_of_dequantized_operands():
  # 4 tiles of 8 inputs: one dot over all 32 (no per-tile batch), equal
  # to the dot of the dequantized weight; its gradient likewise.
  cfg = _weight_only_int4(8)
  x = jax.random.normal(jax.random.key(0), (6, 32))
  w = jax.random.normal(jax.random.key(1), (32, 5))
  g = jax.random.normal(jax.random.key(2), (6, 5))
  dn = (((1,), (0,)), ((), ()))

  def vjp(x, w):
    out, pull = jax.vjp(lambda a, b: aqtr.dot_general(a, b, dn, cfg), x, w)
    return (out, *pull(g))

  dots = _dots(jax.make_jaxpr(vjp)(x, w).jaxpr)
  assert dots, 'no dot_general traced'
  for eqn in dots:  # [B=1, M, K] . [1, K, N]: no tile in the batch.
    assert all(v.aval.shape[0] == 1 for v in eqn.invars if v.aval.ndim == 3)
    assert all(v.aval.shape[-1] != 8 for v in eqn.invars), eqn
  wq = aqtr.fake_quant(w, cfg.fwd.rhs, contracting_axes=(0,))
  out, dx, _ = jax.jit(vjp)(x, w)
  np.testing.assert_allclose(out, x @ wq, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, g @ wq.T, rtol=1e-5, atol=1e-5)


def _w4a8() -> aqtr.DotGeneralConfig:
  """int8 activations x int4 weights (the int4 weight-only preset with
  the int8 preset's activations)."""
  w4 = aqtr.presets.int4_weight_only()
  a8 = aqtr.presets.int8().fwd.lhs
  return dataclasses.replace(w4, fwd=dataclasses.replace(w4.fwd, lhs=a8))


@pytest.mark.parametrize('rows', [1, 3])
def test_int4_weights_against_int8_activations_serve_what_they_train(rows):
  cfg, dn = _w4a8(), (((1,), (0,)), ((), ()))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)

  @jax.jit
  def f(x, w):
    qw = aqtr.quantize_operand(w, dn, cfg, operand='rhs')
    return aqtr.dot_general(x, w, dn, cfg), aqtr.dot_general(x, qw, dn, cfg)

  train, serve = f(x, w)
  np.testing.assert_array_equal(serve, train)


def test_a_stored_int4_weight_is_widened_outside_a_decode_loop():
  # The int4 -> int8 widening of a loop-invariant stored weight happens
  # before the operands are pinned, so XLA hoists it out of the loop (it
  # was a plain int4 conversion at every step: 0.27x float decoding).
  cfg, dn = _w4a8(), (((1,), (0,)), ((), ()))
  w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)))
  qw = aqtr.quantize_operand(w.astype(jnp.float32), dn, cfg, operand='rhs')

  def loop(x, qw):
    def body(_, x):
      return jnp.tanh(aqtr.dot_general(x, qw, dn, cfg))[:, :16].repeat(4, 1)

    return jax.lax.fori_loop(0, jnp.int32(x[0, 0] > 9) + 4, body, x)

  text = jax.jit(loop).lower(jnp.ones((1, 64)), qw).compile().as_text()
  entry = text[text.index('\nENTRY') :]
  assert 's4[' in entry  # Widened before the loop.
  name = entry.split('body=%')[1].split(',')[0]
  body = text[text.index(f'%{name} ') :].split('\n}\n')[0]
  assert 's4[' not in body, body


def _fp_tiles(exponent_bits: int, mantissa_bits: int, tile: int = 8):
  """Both operands of every pass in the small float eXmY, tiles of `tile`."""
  t = dataclasses.replace(
    aqtr.presets.fp8().fwd.lhs,
    numerics=aqtr.numerics.Fp(
      exponent_bits=exponent_bits, mantissa_bits=mantissa_bits
    ),
    tiling=SubChannel(tile_size=tile, tile_count=0),
  )
  raw = aqtr.DotGeneralRaw(lhs=t, rhs=t, use_fwd_quant=True)
  return aqtr.DotGeneralConfig(
    fwd=dataclasses.replace(raw, use_fwd_quant=False), dlhs=raw, drhs=raw
  )


def test_emulated_fp4_tiles_are_one_f32_dot_and_serve_what_they_train():
  # fp4 held in float8_e4m3fn: XLA:CPU emulates the fp8 dot, so the
  # forward over 4 tiles is one f32 dot of the dequantized operands, for
  # the stored weight too (serve == train, bit for bit).
  cfg, dn = _fp_tiles(2, 1), (((1,), (0,)), ((), ()))
  assert cfg.fwd.lhs.numerics.emulated
  x = jax.random.normal(jax.random.key(0), (6, 32))
  w = jax.random.normal(jax.random.key(1), (32, 5))

  def f(x, w):
    qw = aqtr.quantize_operand(w, dn, cfg, operand='rhs')
    return aqtr.dot_general(x, w, dn, cfg), aqtr.dot_general(x, qw, dn, cfg)

  fwd = _dots(jax.make_jaxpr(lambda x, w: f(x, w)[0])(x, w).jaxpr)
  assert fwd, 'no dot_general traced'
  for eqn in fwd:  # Each platform's form: [1, 6, 32] f32, no tile batch.
    assert eqn.invars[0].aval.dtype == jnp.float32, eqn
    assert eqn.invars[0].aval.shape == (1, 6, 32), eqn
  train, serve = jax.jit(f)(x, w)
  np.testing.assert_array_equal(serve, train)
  xq = aqtr.fake_quant(x, cfg.fwd.lhs, contracting_axes=(1,))
  wq = aqtr.fake_quant(w, cfg.fwd.rhs, contracting_axes=(0,))
  np.testing.assert_allclose(train, xq @ wq, rtol=1e-5, atol=1e-5)


def test_native_fp8_tiles_keep_one_fp8_dot_per_tile_on_cpu():
  # e4m3 is stored in its own dtype (a recipe may mean its per-tile
  # accumulation, as DeepSeek-V3's): not emulated, per-tile fp8 dots.
  cfg, dn = _fp_tiles(4, 3), (((1,), (0,)), ((), ()))
  assert not cfg.fwd.lhs.numerics.emulated
  x, w = jnp.ones((6, 32)), jnp.ones((32, 5))
  fwd = _dots(
    jax.make_jaxpr(lambda x, w: aqtr.dot_general(x, w, dn, cfg))(x, w).jaxpr
  )
  if jax.default_backend() == 'cpu':
    cpu = [e for e in fwd if e.invars[0].aval.dtype == jnp.float8_e4m3fn]
    assert cpu and cpu[0].invars[0].aval.shape == (4, 6, 8), fwd
