"""Tests of the 'weights' freezer: frozen int values serve bit for bit."""

import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.core import codecs
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
