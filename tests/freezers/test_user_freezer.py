"""Freezers registered here, in a test file, work end to end with no library
edit: through `lifecycle`, the linen and nnx adapters and the Pax layers.

Two examples a user might write:
  Int4Packed   stores TRAIN's int4 values two per uint8 byte + scales;
               SERVE unpacks them (bit-identical to TRAIN; no float kernel).
  RangeOnly    stores one number per operand, its max |x| at CONVERT;
               SERVE quantizes the float operand within that fixed range.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aqtr
import aqtr.pax
from aqtr import freezers
from aqtr.flax import linen as ql
from aqtr.flax import nnx as qn
from aqtr.flax.frozen import is_removed
from aqtr.freezers import Freezer, Mode, Served, lifecycle
from aqtr.testing import freezers as contract


def pack_int4(q: jax.Array) -> jax.Array:
  """int4 values -> uint8 bytes, two per byte (low nibble first)."""
  v = q.astype(jnp.int32).reshape(-1)
  v = jnp.pad(v, (0, v.size % 2)) & 0xF
  return (v[0::2] | (v[1::2] << 4)).astype(jnp.uint8)


def unpack_int4(packed: jax.Array, shape) -> jax.Array:
  """Inverse of `pack_int4` for an int4 array of `shape`."""
  p = packed.astype(jnp.int32)
  v = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(-1)
  v = jnp.where(v >= 8, v - 16, v)[: np.prod(shape, dtype=int)]
  return v.reshape(shape).astype(jnp.int4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int4Packed(Freezer):
  """Frozen int4 weights packed two per byte (uint8) with their scales."""

  frozen_parts = ('packed', 'scale')
  reads_float = False

  def stores(self, mode):
    if not isinstance(mode, Mode):
      raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
    return self.frozen_parts if mode is Mode.CONVERT else ()

  def freeze(self, call, stats):
    q = call.quantize()
    if q.qvalue.dtype != jnp.int4:
      raise call.error(f'Int4Packed needs int4 storage, got {q.qvalue.dtype}.')
    return {'packed': pack_int4(q.qvalue), 'scale': q.scale}

  def serve(self, call, frozen):
    shape = jax.eval_shape(call.quantize).qvalue.shape
    q = unpack_int4(frozen['packed'], shape)
    return Served(call.qtensor(q, frozen['scale']))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RangeOnly(Freezer):
  """Stores max |x| seen at CONVERT; SERVE quantizes within that range."""

  frozen_parts = ('bound',)

  def stores(self, mode):
    if not isinstance(mode, Mode):
      raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
    return self.frozen_parts if mode is Mode.CONVERT else ()

  def freeze(self, call, stats):
    return {'bound': jnp.max(jnp.abs(call.x)).astype(jnp.float32)}

  def serve(self, call, frozen):
    b = jnp.maximum(frozen['bound'], jnp.finfo(jnp.float32).tiny)
    return Served(call.x / b, tensor=call.with_range(1.0), out_scale=b)


@pytest.fixture
def registered(monkeypatch):
  """Registers both freezers for one test (undone afterwards)."""
  reg = freezers.registry
  monkeypatch.setattr(reg, '_classes', dict(reg._classes))
  freezers.register('test_int4_packed')(Int4Packed)
  freezers.register('test_range_only')(RangeOnly)
  return reg


def _cfg(name):
  base = (
    aqtr.presets.int4_weight_only() if 'int4' in name else aqtr.presets.int8()
  )
  return freezers.configure(base, rhs=name)


def _data(seed, shape):
  return jnp.asarray(
    np.random.default_rng(seed).normal(size=shape), jnp.float32
  )


X, W = _data(0, (4, 8)), _data(1, (8, 6))
DN = (((1,), (0,)), ((), ()))
# lifecycle.run, compiled once per mode and config (eager dispatch compiles
# every primitive, which is slower).
_run = jax.jit(lifecycle.run, static_argnums=(1,))


def run(mode, x, w, dn, cfg, **kw):
  return _run(lifecycle.DotCall(x, w, dn, cfg), mode, **kw)


def test_pack_round_trip_is_exact():
  q = jnp.arange(-8, 8, dtype=jnp.int32).reshape(2, 8).astype(jnp.int4)
  p = jax.jit(pack_int4)(q)
  assert p.dtype == jnp.uint8 and p.shape == (8,)
  unpack = jax.jit(unpack_int4, static_argnums=1)
  np.testing.assert_array_equal(unpack(p, q.shape), q)
  np.testing.assert_array_equal(unpack(p[:7], (13,)), q.reshape(-1)[:13])


def test_registered_freezers_pass_the_contract(registered):
  # The checks a freezer's own code decides (check_freezer runs these and
  # the engine-level ones; the README section runs it in full).
  for name in ('test_int4_packed', 'test_range_only'):
    for check in (
      contract.check_builds,
      contract.check_modes,
      contract.check_life_cycle,
      contract.check_bad_fields,
    ):
      check(registered.get(name), [])


def test_int4_packed_serves_train_bit_for_bit(registered):
  cfg = _cfg('test_int4_packed')
  conv = run(Mode.CONVERT, X, W, DN, cfg)
  part = conv.frozen['rhs']
  assert set(part) == {'packed', 'scale'} and part['packed'].dtype == jnp.uint8
  assert part['packed'].size == W.size // 2
  train = run(Mode.TRAIN, X, W, DN, cfg).out
  served = run(Mode.SERVE, X, 0 * W, DN, cfg, frozen=conv.frozen)
  np.testing.assert_array_equal(served.out, train)
  # The packed bytes are what is read: flipping them changes the output.
  bad = {'rhs': dict(part, packed=part['packed'] ^ 0x11)}
  flipped = run(Mode.SERVE, X, 0 * W, DN, cfg, frozen=bad).out
  assert not np.array_equal(flipped, train)


def test_range_only_reads_its_frozen_bound(registered):
  cfg = _cfg('test_range_only')
  frozen = run(Mode.CONVERT, X, W, DN, cfg).frozen
  assert float(frozen['rhs']['bound']) == float(jnp.abs(W).max())

  def serve(w, fr=frozen):
    return run(Mode.SERVE, X, w, DN, cfg, frozen=fr).out

  np.testing.assert_allclose(serve(W), X @ W, rtol=0.05, atol=0.05)
  # Weights beyond the frozen range are clipped to it.
  b = frozen['rhs']['bound']
  np.testing.assert_array_equal(serve(3 * W), serve(jnp.clip(3 * W, -b, b)))


def test_linen(registered):
  for name, exact in (('test_int4_packed', True), ('test_range_only', False)):
    cfg = _cfg(name)

    def make(mode, cfg=cfg):
      op = functools.partial(ql.DotGeneral, config=cfg, mode=mode)
      return nn.Dense(6, dot_general_cls=op)

    v = jax.jit(make(Mode.TRAIN).init)(jax.random.key(0), X)
    want = jax.jit(make(Mode.TRAIN).apply)(v, X)
    s = ql.convert(make(Mode.CONVERT), v, X)
    entry = s['aqtr']['DotGeneral_0'][lifecycle.entry_name(cfg)]
    assert set(entry['rhs']) == set(cfg.fwd.rhs.freezer.frozen_parts)
    assert is_removed(s['params']['kernel']) == exact
    got = jax.jit(make(Mode.SERVE).apply)(s, X)
    if exact:
      np.testing.assert_array_equal(got, want)
    else:
      np.testing.assert_allclose(got, want, rtol=0.1, atol=0.1)


def test_nnx(registered):
  for name, exact in (('test_int4_packed', True), ('test_range_only', False)):
    cfg = _cfg(name)
    m = nnx.Linear(8, 6, dot_general=qn.DotGeneral(cfg), rngs=nnx.Rngs(0))
    want = m(X)
    qn.convert(m, X)
    assert is_removed(m.kernel) == exact
    (entry,) = m.dot_general.frozen_entries().values()
    assert set(entry['rhs']) == set(cfg.fwd.rhs.freezer.frozen_parts)
    if exact:
      np.testing.assert_array_equal(m(X), want)
    else:
      np.testing.assert_allclose(m(X), want, rtol=0.1, atol=0.1)


def test_pax_layer(registered):
  cfg = _cfg('test_int4_packed')

  def make(mode):
    op = aqtr.pax.EinsumOp(config=cfg, mode=mode)
    return aqtr.pax.Linear(features=6, einsum=op)

  x = X.reshape(2, 2, 8)
  v = make(Mode.TRAIN).init(jax.random.key(0), x)
  want = make(Mode.TRAIN).apply(v, x)
  s = ql.convert(make(Mode.CONVERT), v, x)
  assert is_removed(s['params']['kernel'])
  part = s['aqtr']['einsum'][lifecycle.entry_name(cfg)]['rhs']
  assert part['packed'].dtype == jnp.uint8
  np.testing.assert_array_equal(make(Mode.SERVE).apply(s, x), want)


def test_the_contract_catches_a_freezer_that_cannot_convert():
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Forgetful(Freezer):
    """Declares a stored part but never says how to freeze it."""

    frozen_parts = ('qvalue',)

    def stores(self, mode):
      if not isinstance(mode, Mode):
        raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
      return self.frozen_parts if mode is Mode.CONVERT else ()

  contract.check_modes(Forgetful, [])  # the old contract passed it
  with pytest.raises(NotImplementedError, match='does not override'):
    contract.check_life_cycle(Forgetful, [])


def test_freeze_must_return_exactly_its_parts():
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Misnamed(RangeOnly):
    def freeze(self, call, stats):
      return {'range': jnp.float32(1.0)}  # not 'bound'

  cfg = freezers.configure(aqtr.presets.int8(), rhs=Misnamed())
  with pytest.raises(TypeError, match=r"exactly the keys.*\('bound',\)"):
    lifecycle.run(lifecycle.DotCall(X, W, DN, cfg), Mode.CONVERT)
