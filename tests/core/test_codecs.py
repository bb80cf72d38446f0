"""Storage codecs: contract over every registered codec and numerics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.calibrations import AbsMax, MinMax
from aqtr.core import codecs
from aqtr.numerics import (
  Fp,
  Fp8,
  IntAsymmetric,
  IntSymmetric,
  Mx,
  Nf4,
  NoNumerics,
  NvFp4,
  Ternary,
)
from aqtr.tilings import SubChannel

# One sample of stored values per registered codec (a new codec must add
# one): (values, dtype).
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_E2M1 = _E2M1 + [-v for v in _E2M1]  # All 16 codes, -0 included.
SAMPLES = {
  'raw': (np.arange(-6, 6), jnp.int8),
  'int4': (np.arange(-8, 8), jnp.int4),
  'uint4': (np.arange(16), jnp.uint8),
  'table4': (np.array(Nf4.table[::-1]), jnp.float32),
  'e2m1': (np.array(_E2M1), jnp.float8_e4m3fn),
  'dq_int8': (np.linspace(0.01, 3.0, 600), jnp.float32),
  'dq_fp8': (np.linspace(0.01, 3.0, 600), jnp.float32),
}


def _codec(name):
  if name == 'table4':
    return codecs.Table4(table=Nf4.table)
  return codecs.get(name)()


def _bits(x):
  """Bit patterns (compares -0 / NaN exactly)."""
  x = np.asarray(x)
  return x.view(np.dtype(f'u{x.dtype.itemsize}'))


def test_every_codec_has_a_sample():
  assert set(SAMPLES) == set(codecs.names())


def test_e2m1_decodes_to_any_float_dtype():
  x = jnp.asarray(_E2M1, jnp.float32).reshape(2, 8)
  c = codecs.E2M1()
  for dtype in (jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16):
    back = c.decode(c.encode(x.astype(dtype)), dtype=dtype)
    np.testing.assert_array_equal(_bits(back), _bits(x.astype(dtype)))


@pytest.mark.parametrize('name', sorted(SAMPLES))
def test_codec_round_trip(name):
  vals, dtype = SAMPLES[name]
  c = _codec(name)
  x = jnp.asarray(vals, jnp.float32).astype(dtype).reshape(2, -1)
  stored = c.encode(x, lead=1)
  back = c.decode(stored, dtype=dtype, shape=x.shape[1:])
  assert back.shape == x.shape and back.dtype == x.dtype
  if c.lossless:
    np.testing.assert_array_equal(_bits(back), _bits(x))
    if c.bits == 4:  # Two codes per byte.
      assert stored[c.key].dtype == jnp.uint8
      assert stored[c.key].size * 2 == x.size
  else:  # Double quantization: within 1/2 step of the block's spread.
    spread = float(jnp.abs(x - x.mean(-1, keepdims=True)).max())
    step = spread / (127 if name == 'dq_int8' else 16)
    assert float(jnp.abs(back - x).max()) <= step


def test_pack_layout():
  c = jnp.array([[1, 2, 3, 4, 5]], jnp.uint8)
  p = codecs.pack(c, 4)
  assert p.tolist() == [[0x21, 0x43, 0x05]]
  np.testing.assert_array_equal(codecs.unpack(p, 4, 5), c)
  two = codecs.pack(jnp.array([1, 2, 3, 0, 1], jnp.uint8), 2)
  assert two.tolist() == [1 | 2 << 2 | 3 << 4, 1]


# Every registered numerics that can be frozen, with a config it runs in.
def _configs():
  sub = {'tiling': SubChannel(tile_size=16)}
  out = [
    (IntSymmetric(bits=8), {}),
    (IntSymmetric(bits=4), {}),
    (IntSymmetric(bits=4, storage='int4'), {}),
    (IntSymmetric(bits=3, preserve_zero=False), {}),
    (IntSymmetric(bits=4, preserve_zero=False), {}),
    (IntAsymmetric(bits=4, storage='uint8'), {'calibration': MinMax()}),
    (IntAsymmetric(bits=4), {'calibration': MinMax()}),
    (IntAsymmetric(bits=8), {'calibration': MinMax()}),
    (Fp8(dtype_name='float8_e4m3fn'), {}),
    (Fp8(dtype_name='float8_e5m2'), {}),
    (Fp(exponent_bits=2, mantissa_bits=1), {}),
    (Fp(exponent_bits=3, mantissa_bits=2), {}),
    (Nf4(), sub),
    (NvFp4(), sub),
    (Mx(element='fp4_e2m1'), {'tiling': SubChannel(tile_size=32)}),
    (Mx(element='int8'), {'tiling': SubChannel(tile_size=32)}),
    (Ternary(), {}),
  ]
  return out


def test_configs_cover_every_numerics():
  frozen = {type(n) for n, _ in _configs()} | {NoNumerics}
  assert {aqtr.numerics.get(n) for n in aqtr.numerics.names()} == frozen


def _weight(key):
  w = jax.random.normal(key, (64, 8), jnp.float32)
  w = w.at[0, 0].set(-1e-38).at[1, 0].set(-0.0).at[2, 0].set(0.0)
  w = w.at[:, 2].set(0.0)  # An all-zero group.
  w = w.at[5, 3].set(jnp.nan).at[6, 4].set(jnp.inf)  # Non-finite rows.
  return w.at[:, 5].multiply(1e-30)  # Tiny magnitudes.


@pytest.mark.parametrize(
  'numerics,kw', _configs(), ids=lambda v: repr(v)[:40] if v else ''
)
def test_numerics_values_round_trip(numerics, kw):
  """decode(encode(q)) == q bit for bit wherever the scale is finite,
  and the dequantized values are equal everywhere (NaN where NaN)."""
  kw = {'calibration': AbsMax(), **kw}
  cfg = aqtr.TensorConfig(numerics=numerics, **kw)
  qt = aqtr.quantize(_weight(jax.random.key(0)), cfg, contracting_axes=(0,))
  parts = {'qvalue': qt.qvalue, 'scale': qt.scale, 'zero_point': qt.zero_point}
  stored = codecs.encode_parts(parts, numerics)
  got = codecs.decode_parts(stored, numerics)
  assert got['qvalue'].dtype == qt.qvalue.dtype
  assert got['qvalue'].shape == qt.qvalue.shape
  packs = numerics.codec().bits == 4
  assert (codecs.packed_key(stored) is not None) == packs
  if packs:
    assert stored[numerics.codec().key].nbytes * 2 == qt.qvalue.size
  finite = np.broadcast_to(np.isfinite(np.asarray(qt.scale)), qt.qvalue.shape)
  q0 = _bits(qt.qvalue.astype(jnp.float32))
  q1 = _bits(got['qvalue'].astype(jnp.float32))
  np.testing.assert_array_equal(q1[finite], q0[finite])
  back = aqtr.QTensor(
    got['qvalue'], got['scale'], qt.layout, qt.form, got['zero_point']
  )
  np.testing.assert_array_equal(
    np.asarray(back.dequant()), np.asarray(qt.dequant())
  )


def test_odd_last_axis_stays_raw():
  q = jnp.zeros((1, 3), jnp.int8)
  stored = codecs.encode_parts({'qvalue': q}, IntSymmetric(bits=4))
  assert set(stored) == {'qvalue'}


def test_table4_rejects_large_tables():
  with pytest.raises(ValueError, match='Table4.table'):
    codecs.Table4(table=tuple(float(i) for i in range(17)))


def test_integer_codes_decode_without_numerics():
  q = jnp.array([[-3, 7]], jnp.int4)
  stored = codecs.encode_parts({'qvalue': q}, IntSymmetric(bits=4))
  assert codecs.decode_parts(stored)['qvalue'].tolist() == [[-3, 7]]
  with pytest.raises(ValueError, match='stores'):
    codecs.decode_parts(stored, Nf4())


@pytest.mark.parametrize('bits', range(1, 9))
def test_pack_is_a_dense_little_endian_bit_stream(bits):
  rng = np.random.default_rng(bits)
  c = rng.integers(0, 2**bits, (2, 11)).astype(np.uint8)
  p = np.asarray(codecs.pack(jnp.asarray(c), bits))
  assert p.shape == (2, -(-11 * bits // 8))
  stream = np.unpackbits(p, axis=-1, bitorder='little')[:, : 11 * bits]
  want = ((c[..., None] >> np.arange(bits)) & 1).reshape(2, -1)
  np.testing.assert_array_equal(stream, want)
  np.testing.assert_array_equal(codecs.unpack(p, bits, 11), c)
