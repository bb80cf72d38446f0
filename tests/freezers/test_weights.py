"""Tests of the 'weights' freezer: frozen int values serve bit for bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.core import codecs, native_dot
from aqtr.freezers import Mode, WeightsFreezer, lifecycle

CASES = {  # lhs shape, rhs shape, dimension numbers
  'mk_kn': ((5, 16), (16, 6), (((1,), (0,)), ((), ()))),
  'mk_nk': ((5, 16), (6, 16), (((1,), (1,)), ((), ()))),
  'batched': ((2, 3, 8), (2, 8, 4), (((2,), (1,)), ((0,), (0,)))),
  'two_contractions': ((3, 4, 5), (4, 5, 6), (((1, 2), (0, 1)), ((), ()))),
}
PRESETS = {
  'int8': aqtr.presets.int8,
  'int4_weight_only': aqtr.presets.int4_weight_only,
  'fp8': aqtr.presets.fp8,
}


def _data(seed, shape):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_stores_qvalue_and_scale_in_convert_only():
  f = WeightsFreezer()
  assert f.frozen_parts == ('qvalue', 'scale') and not f.collects
  assert [f.stores(m) for m in Mode] == [(), (), ('qvalue', 'scale'), ()]
  assert aqtr.freezers.get('weights') is WeightsFreezer


@pytest.mark.parametrize('preset', sorted(PRESETS))
@pytest.mark.parametrize('case', sorted(CASES))
def test_serve_from_frozen_weights_equals_train(case, preset):
  ls, rs, dn = CASES[case]
  cfg = aqtr.freezers.configure(PRESETS[preset](), rhs='weights')
  x, w = _data(0, ls), _data(1, rs)
  conv = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT)
  numerics = cfg.fwd.rhs.numerics
  stored = conv.frozen['rhs']
  if numerics.codec().bits == 4:  # Two 4-bit codes per byte.
    key = numerics.codec().key
    assert stored[key].dtype == jnp.uint8 and 'qvalue' not in stored
    assert stored[key].size * 2 == w.size
  part = codecs.decode_parts(stored, numerics)
  assert part['qvalue'].dtype == numerics.dtype
  assert part['qvalue'].size == w.size
  train = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.TRAIN).out
  served = lifecycle.run(
    lifecycle.DotCall(x, jnp.zeros_like(w), dn, cfg),
    Mode.SERVE,
    frozen=conv.frozen,
  ).out
  np.testing.assert_array_equal(served, train)
  np.testing.assert_array_equal(conv.out, train)


def test_frozen_lhs_operand():
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), lhs='weights')
  ls, rs, dn = CASES['mk_nk']
  x, w = _data(0, ls), _data(1, rs)
  frozen = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT).frozen
  served = lifecycle.run(
    lifecycle.DotCall(jnp.zeros_like(x), w, dn, cfg), Mode.SERVE, frozen=frozen
  ).out
  train = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.TRAIN).out
  np.testing.assert_array_equal(served, train)


def test_zeroed_qvalues_change_the_output():
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  ls, rs, dn = CASES['mk_kn']
  x, w = _data(0, ls), _data(1, rs)
  frozen = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT).frozen
  zero = {
    'rhs': dict(frozen['rhs'], qvalue=jnp.zeros_like(frozen['rhs']['qvalue']))
  }
  out = lifecycle.run(
    lifecycle.DotCall(x, w, dn, cfg), Mode.SERVE, frozen=zero
  ).out
  np.testing.assert_array_equal(out, jnp.zeros_like(out))


def test_frozen_values_of_another_shape_are_rejected():
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  ls, rs, dn = CASES['mk_kn']
  x, w = _data(0, ls), _data(1, rs)
  frozen = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT).frozen
  bigger = jnp.zeros((16, 7))
  with pytest.raises(ValueError, match='does not match this dot'):
    lifecycle.run(
      lifecycle.DotCall(x, bigger, dn, cfg), Mode.SERVE, frozen=frozen
    )


# Integer x integer dots store a 'kf' weight with its contraction minor.
MINOR_K = {  # preset, lhs shape, rhs shape, dimension numbers, stored form
  'int8 [K, N]': ('int8', (3, 64), (64, 48), (((1,), (0,)), ((), ())), 'fk'),
  'int8 batched [B, K, N]': (
    'int8',
    (2, 3, 32),
    (2, 32, 8),
    (((2,), (1,)), ((0,), (0,))),
    'fk',
  ),
  'int8 [N, K] (already minor)': (
    'int8',
    (3, 64),
    (48, 64),
    (((1,), (1,)), ((), ())),
    'fk',
  ),
  'w4a8 [K, N]': ('w4a8', (3, 64), (64, 48), (((1,), (0,)), ((), ())), 'fk'),
  'int8 sub-channel [K, N]': (
    'int8_g32',
    (3, 64),
    (64, 48),
    (((1,), (0,)), ((), ())),
    'fk',
  ),
  'int8 weight only (float dot)': (
    'int8_weight_only',
    (3, 64),
    (64, 48),
    (((1,), (0,)), ((), ())),
    'kf',
  ),
  'fp8 (float dot)': ('fp8', (3, 64), (64, 48), (((1,), (0,)), ((), ())), 'kf'),
  'int8 one output column': (
    'int8',
    (3, 64),
    (64, 1),
    (((1,), (0,)), ((), ())),
    'kf',
  ),
}


def _minor_k_config(name):
  replace = dataclasses.replace
  if name == 'int8_g32':
    cfg = aqtr.presets.int8()
    tiled = aqtr.tilings.SubChannel(tile_size=32)
    fwd = replace(
      cfg.fwd,
      lhs=replace(cfg.fwd.lhs, tiling=tiled),
      rhs=replace(cfg.fwd.rhs, tiling=tiled),
    )
    cfg = replace(cfg, fwd=fwd)
  else:  # A preset (w4a8: int4 weights x int8 activations).
    cfg = getattr(aqtr.presets, name)()
  return aqtr.freezers.configure(cfg, rhs='weights')


@pytest.mark.parametrize('case', sorted(MINOR_K))
def test_integer_dots_store_the_weight_with_its_contraction_minor(case):
  name, ls, rs, dn, form = MINOR_K[case]
  cfg = _minor_k_config(name)
  x, w = _data(0, ls), _data(1, rs)
  conv = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT)
  part = codecs.decode_parts(conv.frozen['rhs'], cfg.fwd.rhs.numerics)
  q = lifecycle.DotCall(x, w, dn, cfg).operand('rhs').quantize()
  want = q.qvalue if form == q.form else jnp.swapaxes(q.qvalue, -1, -2)
  np.testing.assert_array_equal(part['qvalue'], want)
  assert aqtr.core.qtensor.stored_form(part['scale'].shape, q.form) == form
  for rows in (
    x,
    x[..., :1, :],
    jnp.concatenate([x, x, x], axis=-2)[..., :8, :],
  ):
    train = lifecycle.run(lifecycle.DotCall(rows, w, dn, cfg), Mode.TRAIN).out
    served = lifecycle.run(
      lifecycle.DotCall(rows, jnp.zeros_like(w), dn, cfg),
      Mode.SERVE,
      frozen=conv.frozen,
    ).out
    np.testing.assert_array_equal(served, train)


def test_a_weight_stored_as_quantized_still_serves_the_same_bits():
  # Entries frozen before the contraction-minor layout (the 'kf' view as
  # quantized) are read by their scale's shape and serve unchanged.
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  dn = (((1,), (0,)), ((), ()))
  x, w = _data(0, (4, 64)), _data(1, (64, 48))
  conv = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT)
  old = aqtr.core.qtensor.swapped_view(conv.frozen['rhs'])
  assert old['qvalue'].shape == (1, 1, 64, 48)
  served = lifecycle.run(
    lifecycle.DotCall(x, jnp.zeros_like(w), dn, cfg),
    Mode.SERVE,
    frozen={'rhs': old},
  ).out
  np.testing.assert_array_equal(served, conv.out)


def test_the_served_dot_contracts_the_weights_minor_axis():
  cfg = aqtr.freezers.configure(aqtr.presets.int8(), rhs='weights')
  dn = (((1,), (0,)), ((), ()))
  x, w = _data(0, (2, 64)), _data(1, (64, 48))
  frozen = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT).frozen

  def serve(x, frozen):
    call = lifecycle.DotCall(x, jnp.zeros((64, 48)), dn, cfg)
    return lifecycle.run(call, Mode.SERVE, frozen=frozen).out

  text = jax.jit(serve).lower(x, frozen).as_text()
  native = [ln for ln in text.splitlines() if native_dot.TARGET in ln]
  dots = [ln for ln in text.splitlines() if 'dot_general' in ln]
  if native_dot.ready():  # The native few-row dot: [1, N, K] as stored.
    assert not dots and len(native) == 1, native
    assert 'tensor<1x48x64xi8>' in native[0], native[0]
    return
  assert len(dots) == 1 and not native, dots
  assert 'contracting_dims = [2] x [2]' in dots[0], dots[0]
  assert 'tensor<1x48x64xi8>' in dots[0], dots[0]


def test_served_int4_weights_reach_the_native_dot_as_stored_bytes():
  # w4a8: the native dot reads the `int4` codec's bytes; the served
  # program decodes nothing (no s4 array), and serves the training bits.
  cfg = _minor_k_config('w4a8')
  dn = (((1,), (0,)), ((), ()))
  x, w = _data(0, (2, 256)), _data(1, (256, 48))
  frozen = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.CONVERT).frozen
  assert frozen['rhs']['int4'].shape == (1, 1, 48, 128)

  def serve(x, frozen):
    call = lifecycle.DotCall(x, jnp.zeros((256, 48)), dn, cfg)
    return lifecycle.run(call, Mode.SERVE, frozen=frozen).out

  lowered = jax.jit(serve).lower(x, frozen)
  text = lowered.as_text().splitlines()
  native = [ln for ln in text if native_dot.TARGET in ln]
  if native_dot.ready():
    assert len(native) == 1 and 'tensor<1x48x128xui8>' in native[0]
    assert 's4[' not in lowered.compile().as_text()
  train = lifecycle.run(lifecycle.DotCall(x, w, dn, cfg), Mode.TRAIN).out
  np.testing.assert_array_equal(jax.jit(serve)(x, frozen), train)


def test_a_qtensors_packed_bytes_are_read_only_where_they_fit_its_codes():
  cfg = _minor_k_config('w4a8')
  dn = (((1,), (1,)), ((), ()))  # an [N, K] weight: its codes are 'fk'
  x, w = _data(0, (1, 256)), _data(1, (48, 256))
  q = lifecycle.DotCall(x, w, dn, cfg).operand('rhs').quantize()
  assert q.form == 'fk' and q.qvalue.shape == (1, 1, 48, 256)
  want = aqtr.dot_general(x, q, dn, cfg)
  stored = codecs.get('int4')().encode(q.qvalue)['int4']
  for packed in (stored, stored[:, :, :24]):  # its bytes; a wrong shape
    got = aqtr.dot_general(x, dataclasses.replace(q, packed=packed), dn, cfg)
    np.testing.assert_array_equal(got, want)
