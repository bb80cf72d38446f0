"""sparse_weights: N:M weights stored compressed, served bit-exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr import sparsity
from aqtr.freezers import Mode, lifecycle
from aqtr.freezers.sparse_weights import compress, decompress, index_bits

DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize(
  'nm',
  [
    sparsity.NM(n=2, m=4),
    pytest.param(sparsity.NM(n=1, m=2), marks=pytest.mark.slow),
    sparsity.NM(n=3, m=8),
    sparsity.NM(n=1, m=4, block=2, offset=2),
  ],
  ids=['2:4', '1:2', '3:8', '1:4/block2/offset2'],
)
def test_compress_round_trip(nm):
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((3, 64)) * 4, jnp.float32)
  q = jnp.where(nm.mask(w[None], 2)[0], w, 0)
  q = q.at[0, : nm.span].set(0)  # groups with fewer than n non-zeros
  qs = [q.astype(d) for d in ('int8', 'float8_e4m3fn', 'int4')]
  for q, (values, indices, back) in zip(
    qs, jax.jit(_round_trip, static_argnums=1)(qs, nm), strict=True
  ):
    assert values.dtype == q.dtype and indices.dtype == jnp.uint8
    assert values.size == q.size * nm.n // nm.m
    bits = 3 * 64 // nm.m // nm.block * nm.n * index_bits(nm.m)
    assert indices.size == bits // 8
    np.testing.assert_array_equal(back, q)


def _round_trip(qs, nm):
  out = []
  for q in qs:
    values, indices = compress(q, nm)
    out.append((values, indices, decompress(values, indices, nm)))
  return out


def test_convert_stores_five_eighths_of_int8_and_serves_exactly():
  cfg = aqtr.freezers.configure(
    aqtr.presets.int8_sparse_2_4(), rhs='sparse_weights'
  )
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
  convert = jax.jit(
    lambda x, w: lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.CONVERT)
  )
  r = convert(x, w)
  part = r.frozen['rhs']
  # 2:4 int8: 0.5 byte of values + 2 x 2 bits of indices per 4 weights.
  assert lifecycle.nbytes(part['values']) == 256 * 32 // 2
  assert lifecycle.nbytes(part['indices']) == 256 * 32 // 8
  serve = jax.jit(
    lambda x, w, f: (
      lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.SERVE, frozen=f).out
    )
  )
  train = lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.TRAIN).out
  np.testing.assert_array_equal(serve(x, 0 * w, r.frozen), train)
  np.testing.assert_array_equal(r.out, train)


def test_needs_n_m_sparsity():
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='sparse_weights')
  x, w = jnp.ones((2, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError, match=r'fwd\.rhs\.sparsity.*NM'):
    lifecycle.run(lifecycle.DotCall(x, w, DN, cfg), Mode.CONVERT)


def _affine(bits: int, group: int | None) -> aqtr.DotGeneralConfig:
  """Weight-only affine `bits` in groups of `group` (None: per channel)."""
  cfg = aqtr.presets.int4_asym_weight_only(group or 32)
  if group is not None and bits == 4:
    return cfg
  t = dataclasses.replace(
    cfg.fwd.rhs,
    numerics=aqtr.numerics.IntAsymmetric(bits=bits, storage='int8'),
    tiling=aqtr.tilings.PerChannel(),
  )
  fwd = dataclasses.replace(cfg.fwd, rhs=t)
  dlhs = dataclasses.replace(cfg.dlhs, rhs=t)
  return dataclasses.replace(cfg, fwd=fwd, dlhs=dlhs)


@pytest.mark.parametrize(
  'bits, group, w_kn',
  [(4, 32, True), (8, None, True), (4, 32, False)],
  ids=['int4_asym/32', 'asym8/channel', 'int4_asym/32-w[N,K]'],
)
def test_affine_weights_serve_exactly_what_they_train(bits, group, w_kn):
  # A pruned 0 quantizes to the zero point, not to code 0: SERVE must
  # restore it as z (it used to keep the wrong units and fill with 0).
  cfg = aqtr.freezers.configure(
    sparsity.configure(_affine(bits, group), rhs=sparsity.NM()),
    rhs='sparse_weights',
  )
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 16)) + 0.7, jnp.float32)
  dn = DN if w_kn else (((1,), (1,)), ((), ()))
  w = w if w_kn else w.T
  r = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT)
  assert 'zero_point' in r.frozen['rhs']
  assert r.frozen['rhs']['values'].size == w.size // 2
  call = lifecycle.DotCall(x, 0 * w, dn, cfg)
  serve = lifecycle.run(call, Mode.SERVE, frozen=r.frozen).out
  train = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.TRAIN).out
  np.testing.assert_array_equal(serve, train)


def test_compress_round_trip_with_a_zero_point():
  nm = sparsity.NM(n=2, m=4)
  z = jnp.array([[3], [-5]], jnp.int8)  # one zero point per row
  q = jnp.array([[3, 7, 3, 3, 1, 3, 3, 3], [2, -5, 0, -5, -5, -5, -5, -5]])
  q = q.astype(jnp.int8)  # at most 2 of every 4 differ from z
  values, indices = compress(q, nm, z)
  np.testing.assert_array_equal(decompress(values, indices, nm, z), q)
