"""Tests for aqtr.ragged_dot: the quantized grouped (MoE) matmul.

Properties: float configs equal `lax.ragged_dot` bit for bit (values and
gradients, empty groups included); the quantized forward and dlhs equal
aqtr.dot_general run expert by expert (same scales: per row, per expert and
output channel); drhs (scaled per output channel over all tokens) is as
close to float as dot_general's; the jaxpr holds int8/fp8 ragged dots in
all three passes; bad input is rejected naming the field.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import aqtr
from aqtr import presets, tilings
from aqtr.core.lowering import sub_jaxprs

MK_KN = (((1,), (0,)), ((), ()))
GROUPS = [(4, 0, 6), (0, 10, 0), (3, 3, 4), (10, 0, 0)]


def operands(m=10, k=16, n=8, g=3, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(ks[0], (m, k))
  w = jax.random.normal(ks[1], (g, k, n))
  ct = jax.random.normal(ks[2], (m, n))
  return x, w, ct


def vjp(fn, x, w, ct):
  out, pull = jax.vjp(fn, x, w)
  return (out, *pull(ct))


def assert_same(a, b):
  assert a.shape == b.shape and a.dtype == b.dtype, (a, b)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def rel(a, b) -> float:
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize('sizes', GROUPS)
@pytest.mark.parametrize('config', [None, presets.float()])
def test_float_is_lax_bit_for_bit(sizes, config):
  x, w, ct = operands()
  gs = jnp.array(sizes, jnp.int32)
  got = vjp(lambda a, b: aqtr.ragged_dot(a, b, gs, config), x, w, ct)
  want = vjp(lambda a, b: lax.ragged_dot(a, b, gs), x, w, ct)
  for a, b in zip(got, want, strict=True):
    assert_same(a, b)


def per_expert(cfg, x, w, sizes, ct):
  """(out, dx, dw) of aqtr.dot_general run on each expert's rows."""
  outs, dxs, dws, start = [], [], [], 0
  for e, size in enumerate(sizes):
    rows = slice(start, start + size)
    start += size
    if size == 0:
      dws.append(jnp.zeros_like(w[e]))
      continue
    o, dx, dw = vjp(
      lambda a, b: aqtr.dot_general(a, b, MK_KN, cfg), x[rows], w[e], ct[rows]
    )
    outs.append(o), dxs.append(dx), dws.append(dw)
  return jnp.concatenate(outs), jnp.concatenate(dxs), jnp.stack(dws)


def subchannel_fwd(cfg):
  t = tilings.SubChannel(tile_size=8)
  fwd = dataclasses.replace(
    cfg.fwd,
    lhs=dataclasses.replace(cfg.fwd.lhs, tiling=t),
    rhs=dataclasses.replace(cfg.fwd.rhs, tiling=t),
  )
  return dataclasses.replace(cfg, fwd=fwd)


def requantizing(cfg):
  return dataclasses.replace(
    cfg,
    dlhs=dataclasses.replace(cfg.dlhs, use_fwd_quant=False),
    drhs=dataclasses.replace(cfg.drhs, use_fwd_quant=False),
  )


CONFIGS = {
  'int8': presets.int8(),
  'fp8': presets.fp8(),
  'int8_weight_only': presets.int8_weight_only(),
  'int8_fwd': presets.int8_fwd(),
  'subchannel': subchannel_fwd(presets.int8()),
  'requantizing': requantizing(presets.int8()),
}


@pytest.mark.parametrize(
  'name, sizes',
  [(name, (4, 0, 6)) for name in sorted(CONFIGS)]
  + [
    pytest.param(name, (3, 3, 4), marks=pytest.mark.slow)
    for name in sorted(CONFIGS)
  ],
)
def test_quantized_matches_per_expert_dot_general(name, sizes):
  cfg = CONFIGS[name]
  x, w, ct = operands()
  gs = jnp.array(sizes, jnp.int32)
  out, dx, dw = vjp(lambda a, b: aqtr.ragged_dot(a, b, gs, cfg), x, w, ct)
  ref_out, ref_dx, ref_dw = per_expert(cfg, x, w, sizes, ct)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5)
  # drhs scales g per output channel over all tokens (dot_general: over
  # the expert's tokens): as close to float as dot_general's.
  _, _, float_dw = vjp(lambda a, b: lax.ragged_dot(a, b, gs), x, w, ct)
  assert rel(dw, float_dw) < 2 * rel(ref_dw, float_dw) + 1e-6
  assert rel(out, ref_out) < 1e-5


@pytest.mark.parametrize(
  'name', ['int8', pytest.param('fp8', marks=pytest.mark.slow)]
)
def test_gradients_close_to_float(name):
  x, w, ct = operands(m=64, k=32, n=16, g=4, seed=1)
  gs = jnp.array([20, 0, 30, 14], jnp.int32)
  got = vjp(lambda a, b: aqtr.ragged_dot(a, b, gs, CONFIGS[name]), x, w, ct)
  want = vjp(lambda a, b: lax.ragged_dot(a, b, gs), x, w, ct)
  bound = 0.03 if name == 'int8' else 0.12
  for a, b in zip(got, want, strict=True):
    assert rel(a, b) < bound


def all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in sub_jaxprs(eqn):
      yield from all_eqns(sub)


def ragged_dots(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return [
    (
      tuple(str(v.aval.dtype) for v in e.invars[:2]),
      str(jnp.dtype(e.params['preferred_element_type'])),
    )
    for e in all_eqns(jaxpr)
    if e.primitive.name == 'ragged_dot_general'
  ]


@pytest.mark.parametrize(
  'name, want',
  [
    ('int8', (('int8', 'int8'), 'int32')),
    ('fp8', None),
  ],
)
def test_low_precision_dots_in_jaxpr(name, want):
  x, w, ct = operands()
  gs = jnp.array([4, 0, 6], jnp.int32)
  found = ragged_dots(
    lambda a, b, c: vjp(
      lambda p, q: aqtr.ragged_dot(p, q, gs, CONFIGS[name]), a, b, c
    ),
    x,
    w,
    ct,
  )
  assert len(found) == 3
  if want is not None:
    assert found == [want] * 3
  else:
    assert all(
      all(d.startswith('float8') for d in dts) and pref == 'float32'
      for dts, pref in found
    ), found


def test_jit_unchecked_rows_past_the_sum_are_zero():
  x, w, ct = operands()
  gs = jnp.array([3, 0, 4], jnp.int32)  # Sums to 7 < 10 rows.
  f = jax.jit(lambda a, b, s: aqtr.ragged_dot(a, b, s, presets.int8()))
  out = f(x, w, gs)
  np.testing.assert_array_equal(out[7:], 0)
  dx = jax.grad(lambda a: (f(a, w, gs) * ct).sum())(x)
  np.testing.assert_array_equal(dx[7:], 0)


def test_stochastic_rounding_needs_key_and_runs():
  cfg = presets.fully_quantized(8, 8, stochastic_rounding=True)
  x, w, ct = operands()
  gs = jnp.array([4, 0, 6], jnp.int32)
  with pytest.raises(ValueError, match='key'):
    aqtr.ragged_dot(x, w, gs, cfg)
  key = jax.random.key(1)
  _, dx, dw = vjp(
    lambda a, b: aqtr.ragged_dot(a, b, gs, cfg, key=key), x, w, ct
  )
  _, fx, fw = vjp(lambda a, b: lax.ragged_dot(a, b, gs), x, w, ct)
  assert rel(dx, fx) < 0.05 and rel(dw, fw) < 0.05


@pytest.mark.parametrize(
  'args, match',
  [
    (((10, 16), (3, 16, 8), [4, 0, 5]), 'sum to the rows'),
    (((10, 16), (3, 16, 8), [11, -1, 0]), 'non-negative'),
    (((10, 16, 1), (3, 16, 8), [4, 0, 6]), 'lhs must be 2-D'),
    (((10, 16), (16, 8), [4, 0, 6]), 'rhs must be 3-D'),
    (((10, 16), (3, 16, 8), [4, 6]), 'group_sizes must be 1-D'),
    (((10, 12), (3, 16, 8), [4, 0, 6]), 'lhs.shape\\[1\\]'),
  ],
)
def test_bad_input(args, match):
  lshape, rshape, sizes = args
  with pytest.raises(ValueError, match=match):
    aqtr.ragged_dot(
      jnp.ones(lshape), jnp.ones(rshape), jnp.array(sizes), presets.int8()
    )


def test_bad_group_sizes_dtype_and_config():
  x, w, _ = operands()
  with pytest.raises(TypeError, match='integer dtype'):
    aqtr.ragged_dot(x, w, jnp.array([4.0, 0.0, 6.0]))
  with pytest.raises(TypeError, match='DotGeneralConfig'):
    aqtr.ragged_dot(x, w, jnp.array([4, 0, 6]), config='int8')


def test_group_sizes_as_a_python_list_or_tuple():
  # A list used to fail with JAX's "Cannot determine dtype".
  x, w, _ = operands()
  want = aqtr.ragged_dot(x, w, jnp.array([4, 0, 6]), presets.int8())
  for sizes in ([4, 0, 6], (4, 0, 6)):
    got = aqtr.ragged_dot(x, w, sizes, presets.int8())
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
      aqtr.ragged_dot(x, w, sizes), lax.ragged_dot(x, w, jnp.array(sizes))
    )
  for bad in ([4.0, 0, 6], ['4', 0, 6], [[4], [0, 6]]):
    with pytest.raises(TypeError, match='group_sizes must be integers'):
      aqtr.ragged_dot(x, w, bad, presets.int8())
  with pytest.raises(ValueError, match='sum to the rows'):
    aqtr.ragged_dot(x, w, [4, 0, 5], presets.int8())


def test_token_tiling_rejected_in_drhs():
  cfg = presets.int8()
  t = tilings.SubChannel(tile_size=5)
  drhs = dataclasses.replace(
    cfg.drhs, lhs=dataclasses.replace(cfg.drhs.lhs, tiling=t)
  )
  cfg = dataclasses.replace(cfg, drhs=drhs)
  x, w, ct = operands()
  gs = jnp.array([4, 0, 6], jnp.int32)
  with pytest.raises(ValueError, match='config.drhs.lhs.tiling'):
    vjp(lambda a, b: aqtr.ragged_dot(a, b, gs, cfg), x, w, ct)
