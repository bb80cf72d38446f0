"""Storage codecs: how the values and scales of a QTensor are stored.

A quantizer (`aqtr.core.quantizer`) gives values `q` in the numerics'
dtype (int8, int4, fp8, codebook values in float32, ...) and float32
scales. On XLA:CPU a `jnp.int4` / `float4` array still takes one byte per
value, and a codebook value four, so the stored form of a frozen weight,
a KV cache or an optimizer state is a codec's:

  'raw'      the values as they are (int8, fp8, ...): 1 byte each.
  'int4'     signed integers in [-8, 7], two 4-bit codes per uint8.
  'uint4'    unsigned integers in [0, 15], two per uint8.
  'table4'   values of a table of <= 16 entries (nf4): 4-bit indices,
             two per uint8.
  'e2m1'     fp4 E2M1 values (NVFP4, MXFP4; held in float8_e4m3fn):
             sign + 3-bit magnitude code, two per uint8.
  'dq_int8', 'dq_fp8'  double-quantized scales (QLoRA, Dettmers et al.
             2023, arXiv 2305.14314): per leading index the mean `m` of
             the scales is removed, blocks of 256 are stored as int8 (or
             float8_e4m3fn) with one float32 absmax `c` per block.

Codes are packed along the last axis, low bits first (`pack`); a value
codec applies when that axis divides evenly, else the values stay raw.
Value codecs are lossless: `decode(encode(q))` gives back `q` bit for bit
(the values the training forward used), except that a NaN codebook or
E2M1 value (a group whose scale is NaN, so every dequantized value of
it is NaN anyway) decodes as +0. The double-quantized scales are lossy
(~2^-8 of the scales' spread): a consumer that uses them reads the decoded
scales in training and serving alike.

A numerics names its codec (`Numerics.codec()`); `encode_parts` /
`decode_parts` map a frozen operand's parts {'qvalue', 'scale',
'zero_point'} to the stored parts (the packed values under the codec's
name, 'int4', 'table4', ...) and back.

Example:
  >>> import jax.numpy as jnp
  >>> c = Int4()
  >>> s = c.encode(jnp.array([[-8, 7, 1, -1]], jnp.int8))
  >>> s['int4'].dtype, s['int4'].shape
  (dtype('uint8'), (1, 2))
  >>> c.decode(s, dtype=jnp.int8).tolist()
  [[-8, 7, 1, -1]]
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr.core import prims
from aqtr.core.eager import compiled_when_eager
from aqtr.core.registry import Registry

__all__ = [
  'Codec',
  'DoubleQuant',
  'DqFp8',
  'DqInt8',
  'E2M1',
  'Int4',
  'Raw',
  'Table4',
  'UInt4',
  'decode_parts',
  'encode_parts',
  'get',
  'packed_key',
  'names',
  'pack',
  'register',
  'registry',
  'stored_shape',
  'unpack',
  'value_codec',
]


@compiled_when_eager
def pack(codes: jax.Array, bits: int) -> jax.Array:
  """Unsigned codes < 2^bits [..., L] -> uint8 [..., ceil(L bits / 8)].

  A dense little-endian bit stream along the last axis: code j occupies
  bits j * bits .. (j + 1) * bits - 1 (for 1, 2, 4, 8 bits: `8 // bits`
  codes per byte, the first in the low bits); the last byte is padded
  with zero bits.

  Example:
    >>> import jax.numpy as jnp
    >>> pack(jnp.array([1, 2, 3], jnp.uint8), 4).tolist()
    [33, 3]
  """
  if isinstance(bits, bool) or bits not in range(1, 9):
    raise ValueError(f'pack: bits must be an int in 1..8, got {bits!r}.')
  c = jnp.asarray(codes).astype(jnp.uint8)
  if 8 % bits:  # A bit stream across byte boundaries.
    shifts = jnp.arange(bits, dtype=jnp.uint8).reshape((1,) * c.ndim + (-1,))
    stream = (c[..., None] >> shifts) & jnp.uint8(1)
    stream = stream.reshape(*c.shape[:-1], -1)
    return jnp.packbits(stream, axis=-1, bitorder='little')
  per = 8 // bits
  pad = -c.shape[-1] % per
  if pad:
    c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, pad)])
  if per == 1:
    return c
  c = c.reshape(*c.shape[:-1], -1, per)
  out = c[..., 0]
  for i in range(1, per):
    out = out | (c[..., i] << jnp.uint8(i * bits))
  return out


@compiled_when_eager
def unpack(packed: jax.Array, bits: int, length: int) -> jax.Array:
  """The inverse of `pack`: uint8 [..., P] -> uint8 codes [..., length]."""
  p = jnp.asarray(packed)
  if 8 % bits:
    stream = jnp.unpackbits(p, axis=-1, bitorder='little')
    stream = stream[..., : length * bits].reshape(*p.shape[:-1], length, bits)
    shifts = jnp.arange(bits, dtype=jnp.uint8).reshape((1,) * p.ndim + (-1,))
    return jnp.sum(stream << shifts, axis=-1, dtype=jnp.uint8)
  per = 8 // bits
  if per == 1:
    return p[..., :length].astype(jnp.uint8)
  mask = jnp.uint8(2**bits - 1)
  parts = [(p >> jnp.uint8(i * bits)) & mask for i in range(per)]
  c = jnp.stack(parts, axis=-1).reshape(*p.shape[:-1], -1)
  return c[..., :length]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codec(abc.ABC):
  """Base of the `codecs` registry: stored form of values or scales.

  `encode(x, lead=)` returns a dict of stored arrays; `decode(stored,
  dtype=, shape=)` gives back the array (`shape`: the per-layer shape, for
  codecs that flatten; `lead`: leading stacked axes kept apart).
  """

  # Whether decode(encode(x)) == x bit for bit.
  lossless: ClassVar[bool] = True
  # The stored part's key of a value codec (packed: the codec's name).
  key: ClassVar[str] = 'qvalue'
  # Bits per stored value (value codecs).
  bits: ClassVar[int] = 4

  def applies(self, shape: tuple[int, ...]) -> bool:
    """Whether values of `shape` can be stored (the last axis packs)."""
    per = 8 // self.bits
    return len(shape) >= 1 and shape[-1] % per == 0

  @abc.abstractmethod
  def encode(self, x: jax.Array, *, lead: int = 0) -> dict:
    """The stored arrays of `x`."""

  @abc.abstractmethod
  def decode(self, stored: dict, *, dtype, shape=None) -> jax.Array:
    """`x` back from `encode`'s arrays, in `dtype`."""


registry: Registry = Registry('codecs', Codec)
register = registry.register
get = registry.get
names = registry.names


@register('raw')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Raw(Codec):
  """The values as they are (int8, fp8, float32, ...)."""

  bits = 8

  def applies(self, shape) -> bool:
    return True

  def encode(self, x, *, lead=0):
    return {self.key: x}

  def decode(self, stored, *, dtype, shape=None):
    return stored[self.key].astype(dtype)


@register('int4')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Int4(Codec):
  """Signed integers in [-8, 7] (any integer dtype), two per uint8."""

  key = 'int4'

  def encode(self, x, *, lead=0):
    nib = lax.bitcast_convert_type(x.astype(jnp.int8), jnp.uint8) & 0xF
    return {self.key: pack(nib, 4)}

  def decode(self, stored, *, dtype, shape=None):
    p = stored[self.key]
    nib = unpack(p, 4, 2 * p.shape[-1]).astype(jnp.int8)
    return ((nib ^ 8) - 8).astype(dtype)


@register('uint4')
@dataclasses.dataclass(frozen=True, kw_only=True)
class UInt4(Codec):
  """Unsigned integers in [0, 15], two per uint8."""

  key = 'uint4'

  def encode(self, x, *, lead=0):
    return {self.key: pack(x.astype(jnp.uint8), 4)}

  def decode(self, stored, *, dtype, shape=None):
    p = stored[self.key]
    return unpack(p, 4, 2 * p.shape[-1]).astype(dtype)


def _lookup(idx: jax.Array, table: np.ndarray) -> jax.Array:
  """`table[idx]` as float32, by elementwise selects: they keep any
  sharding of the codes (a gather from the constant table loses it)."""
  i = idx.astype(jnp.int32)
  out = jnp.full(idx.shape, table[0], jnp.float32)
  for j in range(1, len(table)):
    out = prims.where(i == j, table[j], out)
  return out


@register('table4')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Table4(Codec):
  """Values of `table` (<= 16 floats, e.g. nf4): 4-bit indices.

  A value not in the table (NaN) is stored as the index of 0 (or 0).
  """

  table: tuple[float, ...] = (0.0, 1.0)

  key = 'table4'

  def __post_init__(self):
    if not 1 <= len(self.table) <= 16:
      raise ValueError(
        f'Table4.table must hold 1..16 values, got {len(self.table)}.'
      )

  def encode(self, x, *, lead=0):
    t = np.asarray(self.table, np.float32)
    zero = int(np.argmin(np.abs(t)))
    idx = jnp.full(x.shape, zero, jnp.uint8)
    v = x.astype(jnp.float32)
    for j, tv in enumerate(t):
      idx = prims.where(v == tv, jnp.uint8(j), idx)
    return {self.key: pack(idx, 4)}

  def decode(self, stored, *, dtype, shape=None):
    p = stored[self.key]
    idx = unpack(p, 4, 2 * p.shape[-1])
    return _lookup(idx, np.asarray(self.table, np.float32)).astype(dtype)


# E2M1 magnitudes by 3-bit code; code + 8 is the negative (with -0).
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@register('e2m1')
@dataclasses.dataclass(frozen=True, kw_only=True)
class E2M1(Codec):
  """fp4 E2M1 values (any float dtype holding them): sign bit + 3 bits.

  The sign of zero is kept; NaN is stored as +0.
  """

  key = 'e2m1'

  def encode(self, x, *, lead=0):
    v = x.astype(jnp.float32)
    mag = jnp.abs(v)
    code = jnp.zeros(v.shape, jnp.uint8)
    for j, m in enumerate(_E2M1[1:], start=1):
      code = prims.where(mag == m, jnp.uint8(j), code)
    neg = prims.negative(v)
    code = code | prims.where(neg, jnp.uint8(8), jnp.uint8(0))
    return {self.key: pack(code, 4)}

  def decode(self, stored, *, dtype, shape=None):
    p = stored[self.key]
    c = unpack(p, 4, 2 * p.shape[-1])  # The E2M1 bit pattern s e e m.
    if jnp.dtype(dtype) != jnp.float8_e4m3fn:
      table = np.concatenate([_E2M1, -_E2M1])
      return _lookup(c, table).astype(dtype)
    # Straight to e4m3fn bits (bias 7 vs 1): a normal value keeps its
    # exponent + 6 and mantissa bit; the subnormal 0.5 is 2^-1.
    e, m = (c >> 1) & 3, c & 1
    normal = e > 0
    exp = prims.where(normal, e + 6, m * 6)
    man = prims.where(normal, m << 2, jnp.uint8(0))
    bits = ((c & 8) << 4) | (exp << 3) | man
    return lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoubleQuant(Codec):
  """Base of the double-quantized scale codecs (see the module doc).

  `encode(s, lead=)` keeps `lead` leading (stacked) axes apart; `decode`
  needs the per-layer `shape` of the scales.

  Attributes:
    block: scales per second-level block.
  """

  block: int = 256

  lossless = False
  key = 'scale8'
  bits = 8
  # The stored dtype and its largest value (set by subclasses).
  dtype: ClassVar[str] = 'int8'
  top: ClassVar[float] = 127.0

  def applies(self, shape) -> bool:
    return True

  def _round(self, v: jax.Array) -> jax.Array:
    """`v` (within +-top) rounded to the stored dtype."""
    raise NotImplementedError

  def encode(self, x, *, lead=0):
    head = x.shape[:lead]
    flat = x.reshape(*head, -1).astype(jnp.float32)
    n = flat.shape[-1]
    nb = -(-n // self.block)
    m = flat.mean(-1)
    d = jnp.pad(
      flat - m[..., None], [(0, 0)] * lead + [(0, nb * self.block - n)]
    )
    d = d.reshape(*head, nb, self.block)
    c = jnp.abs(d).max(-1)
    safe = prims.where(c > 0, c, 1.0)
    v = prims.clip(self.top * d / safe[..., None], -self.top, self.top)
    return {'c': safe, 'm': m, 'q': self._round(v)}

  def decode(self, stored, *, dtype=jnp.float32, shape=None):
    q, c, m = stored['q'], stored['c'], stored['m']
    head = q.shape[:-2]
    d = q.astype(jnp.float32) * (c[..., None] / self.top)
    n = math.prod(shape)
    flat = d.reshape(*head, -1)[..., :n] + m[..., None]
    return flat.reshape(*head, *shape).astype(dtype)


@register('dq_int8')
@dataclasses.dataclass(frozen=True, kw_only=True)
class DqInt8(DoubleQuant):
  """Double-quantized scales stored as int8: `round(127 (s - m) / c)`."""

  def _round(self, v):
    return prims.round_even(v).astype(jnp.int8)


@register('dq_fp8')
@dataclasses.dataclass(frozen=True, kw_only=True)
class DqFp8(DoubleQuant):
  """Double-quantized scales stored as float8_e4m3fn (QLoRA's 8-bit
  floats): `e4m3(448 (s - m) / c)`."""

  dtype = 'float8_e4m3fn'
  top = 448.0

  def _round(self, v):
    return v.astype(jnp.float8_e4m3fn)


def value_codec(numerics, shape: tuple[int, ...]) -> Codec:
  """The codec storing `numerics`' values of `shape` (raw when the
  numerics' codec does not apply to the shape)."""
  c = numerics.codec()
  return c if c.applies(tuple(shape)) else Raw()


# The stored key of each packed value codec -> how to decode it alone.
_PACKED = ('int4', 'uint4', 'table4', 'e2m1')


@compiled_when_eager
def encode_parts(parts: dict, numerics) -> dict:
  """A frozen operand's parts {'qvalue', 'scale', ...} -> stored parts.

  The values go through `numerics.codec()` (packed: stored under the
  codec's key, 'int4' / 'uint4' / 'table4' / 'e2m1'; else 'qvalue'); the
  other parts are kept.

  Example:
    >>> import jax.numpy as jnp
    >>> from aqtr.numerics import Nf4
    >>> p = {'qvalue': jnp.array([[0.0, 1.0]]), 'scale': jnp.ones((1, 1))}
    >>> sorted(encode_parts(p, Nf4()))
    ['scale', 'table4']
  """
  if 'qvalue' not in parts:
    return dict(parts)
  out = {k: v for k, v in parts.items() if k != 'qvalue'}
  q = parts['qvalue']
  out.update(value_codec(numerics, jnp.shape(q)).encode(q))
  return out


def packed_key(stored) -> str | None:
  """The key of `stored`'s packed values, or None (raw 'qvalue')."""
  found = [k for k in _PACKED if k in stored]
  return found[0] if found else None


@compiled_when_eager
def decode_parts(stored: dict, numerics=None) -> dict:
  """The inverse of `encode_parts`: parts with 'qvalue' in the numerics'
  dtype (bit for bit what the quantizer gave; see the module doc).

  Without `numerics`, integer codes decode to int8 ('int4') / uint8
  ('uint4'); table and E2M1 codes need the numerics.
  """
  key = packed_key(stored) if hasattr(stored, 'keys') else None
  if key is None:
    return dict(stored)
  out = {k: v for k, v in stored.items() if k != key}
  if numerics is None:
    if key not in ('int4', 'uint4'):
      raise ValueError(
        f'decode_parts: {key!r} codes need the numerics that made them; '
        'pass numerics=.'
      )
    c, dtype = get(key)(), jnp.int8 if key == 'int4' else jnp.uint8
  else:
    c, dtype = numerics.codec(), numerics.dtype
    if c.key != key:
      raise ValueError(
        f'decode_parts: values stored as {key!r} codes, but '
        f'{type(numerics).__name__} stores {c.key!r}; decode with the '
        'numerics the values were frozen with.'
      )
  out['qvalue'] = c.decode(stored, dtype=dtype)
  return out


def stored_shape(stored: dict) -> tuple[int, ...]:
  """The shape of the values `decode_parts` gives (packed: last axis x2)."""
  key = packed_key(stored)
  if key is not None:
    s = jnp.shape(stored[key])
    return (*s[:-1], 2 * s[-1])
  return tuple(jnp.shape(stored['qvalue']))
