"""Low-bit storage of optimizer states: code tables, normalisation, packing.

A state tensor x is stored as small integer codes into a table T of 2^b
values in [-1, 1] (or [0, 1]) and float32 normalisers N:

  x ~ T[code] * N,   code = argmin_i |T[i] - x / N|

Normalisers: block-wise, `N = max |x|` over blocks of `block` consecutive
elements (Dettmers et al. 2022, arXiv 2110.02861), or rank-1 for tensors
of rank >= 2 (Li et al. 2023, arXiv 2309.01507): with `r_a` the max of |x|
over every axis but a, `N_i = min_a r_a[i_a]` (one vector per axis).

Tables: `dynamic_table` is the dynamic (tree) data type of Dettmers et al.:
after the sign, each extra leading zero bit divides the magnitude by 10,
and the remaining bits spread values linearly over [0.1, 1] of that decade,
giving a relative error that stays small over many orders of magnitude;
its zero-free variant (DE-0 of Li et al.) stores second moments.
`linear_table` is Li et al.'s zero-point-free linear map (i + 1) / 2^b,
which never rounds a second moment to 0 (that would blow up m / sqrt(v)).
Codes round to the nearest table value, or stochastically (given a key:
up to the next value with probability proportional to the distance, so
E[T[code]] = x / N); 4-bit codes are packed two per byte.

Example:
  >>> import jax.numpy as jnp
  >>> t = LowBitTensor.encode(jnp.linspace(-1, 1, 4096), bits=8)
  >>> t.codes.dtype, t.decode().shape
  (dtype('uint8'), (4096,))
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.core import codecs
from aqtr.core.quantizer import table_codes

__all__ = ['LowBitTensor', 'StateCodec', 'dynamic_table', 'linear_table']


@functools.cache
def dynamic_table(
  bits: int, signed: bool, zero: bool = True
) -> tuple[float, ...]:
  """The 2^bits sorted values of the dynamic data type (with 1).

  `zero=False` replaces 0 by a value one decade below the smallest (Li et
  al.'s DE-0 for second moments: no entry of v is stored as 0).
  """
  levels = bits - 1
  mags = []
  for e in range(levels):
    n = 2 ** (levels - 1 - e) if signed else 2 ** (levels - e)
    edges = np.linspace(0.1, 1.0, n + 1)
    mags.extend((10.0**-e) * (edges[:-1] + edges[1:]) / 2)
  mags = np.asarray(mags)
  low = 0.0 if zero else 0.55 * 10.0**-levels
  vals = [low, 1.0, *mags] + ([*(-mags)] if signed else [])
  out = tuple(sorted(float(np.float32(v)) for v in vals))
  assert len(out) == 2**bits, (bits, signed, len(out))
  return out


@functools.cache
def linear_table(bits: int) -> tuple[float, ...]:
  """Zero-point-free linear map: (i + 1) / 2^bits, i = 0 .. 2^bits - 1."""
  return tuple((i + 1) / 2**bits for i in range(2**bits))


def _safe(n: jax.Array) -> jax.Array:
  return jnp.where(n > 0, n, jnp.ones_like(n))


def _rank1(x: jax.Array) -> tuple[jax.Array, ...]:
  a = jnp.abs(x)
  axes = range(x.ndim)
  return tuple(jnp.max(a, axis=tuple(b for b in axes if b != i)) for i in axes)


def _rank1_norm(stats, shape) -> jax.Array:
  n = None
  for i, s in enumerate(stats):
    b = s.reshape([d if j == i else 1 for j, d in enumerate(shape)])
    n = b if n is None else jnp.minimum(n, b)
  return jnp.broadcast_to(n, shape)


@dataclasses.dataclass(frozen=True)
class LowBitTensor:
  """A tensor stored as b-bit codes and float32 normalisers.

  Attributes:
    codes: uint8 codes (4-bit: packed two per byte), flat, padded.
    norms: block maxima [num_blocks], or one vector per axis (rank-1).
    shape: the tensor's shape (static).
    bits: 8 or 4 (static).
    table: the sorted code values (static).
    block: elements per block; 0 for rank-1 normalisation (static).
  """

  codes: jax.Array
  norms: tuple[jax.Array, ...]
  shape: tuple[int, ...]
  bits: int
  table: tuple[float, ...]
  block: int

  @classmethod
  def encode(
    cls,
    x: jax.Array,
    *,
    bits: int = 8,
    table: tuple[float, ...] | None = None,
    block: int = 2048,
    key: jax.Array | None = None,
  ) -> LowBitTensor:
    """Quantizes `x`; `block=0` asks for rank-1 normalisation.

    With a `key`, codes are rounded stochastically (unbiased between the
    table's neighbours); without, to the nearest table value.
    """
    if not _is_int(bits) or bits not in (4, 8):
      raise ValueError(f'LowBitTensor bits must be 4 or 8, got {bits!r}.')
    if not _is_int(block) or block < 0:
      raise ValueError(
        f'LowBitTensor block must be an int >= 0 (0: rank-1), got {block!r}.'
      )
    table = table or dynamic_table(bits, True)
    if len(table) != 2**bits:
      raise ValueError(
        f'LowBitTensor table must have 2^bits = {2**bits} values, got '
        f'{len(table)}.'
      )
    x = jnp.asarray(x, jnp.float32)
    shape = tuple(x.shape)
    if block == 0 and x.ndim >= 2:
      norms = _rank1(x)
      xn = x / _safe(_rank1_norm(norms, shape))
      flat = xn.reshape(-1)
    else:
      block = block or 128
      size = math.prod(shape)
      nb = -(-size // block)
      flat = jnp.pad(x.reshape(-1), (0, nb * block - size)).reshape(nb, block)
      m = jnp.max(jnp.abs(flat), axis=1)
      norms = (m,)
      flat = (flat / _safe(m)[:, None]).reshape(-1)
    codes = table_codes(flat, table, key)  # The core's table quantizer.
    if bits == 4:  # Two per byte (the core's `codecs.pack`).
      codes = codecs.pack(codes, 4)
    return cls(codes, norms, shape, bits, tuple(table), block)

  @classmethod
  def zeros(
    cls,
    shape: tuple[int, ...],
    *,
    bits: int = 8,
    table: tuple[float, ...] | None = None,
    block: int = 2048,
  ) -> LowBitTensor:
    """`encode(jnp.zeros(shape), ...)` without computing it."""
    table = tuple(table or dynamic_table(bits, True))
    shape = tuple(shape)
    size = math.prod(shape)
    zero = int(np.argmin(np.abs(np.asarray(table))))
    if block == 0 and len(shape) >= 2:
      norms = tuple(jnp.zeros((d,), jnp.float32) for d in shape)
      n = size
    else:
      block = block or 128
      nb = -(-size // block)
      norms = (jnp.zeros((nb,), jnp.float32),)
      n = nb * block
    codes = jnp.full((n + (bits == 4) * (n % 2),), zero, jnp.uint8)
    if bits == 4:
      codes = codecs.pack(codes, 4)
    return cls(codes, norms, shape, bits, table, block)

  def decode(self) -> jax.Array:
    """The float32 tensor."""
    codes = self.codes
    if self.bits == 4:
      codes = codecs.unpack(codes, 4, 2 * codes.shape[-1])
    vals = jnp.asarray(self.table, jnp.float32)[codes]
    size = math.prod(self.shape)
    if self.block == 0:
      n = _rank1_norm(self.norms, self.shape)
      return vals[:size].reshape(self.shape) * n
    m = self.norms[0]
    v = vals.reshape(m.shape[0], self.block) * m[:, None]
    return v.reshape(-1)[:size].reshape(self.shape)


jax.tree_util.register_dataclass(
  LowBitTensor,
  data_fields=['codes', 'norms'],
  meta_fields=['shape', 'bits', 'table', 'block'],
)


_TABLES = ('signed_dynamic', 'dynamic_no_zero', 'linear')
_ROUNDINGS = ('nearest', 'stochastic')


def _is_int(v) -> bool:
  """An int proper: 8.0, True and numpy floats are not."""
  return isinstance(v, int | np.integer) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateCodec:
  """How one optimizer state tensor is stored: bits, table, normaliser.

  Attributes:
    bits: 8 or 4.
    table: 'signed_dynamic' (`dynamic_table(bits, True)`, for first
      moments), 'dynamic_no_zero' (unsigned, no 0; Li et al.'s DE-0) or
      'linear' (`linear_table(bits)`, unsigned, zero-point free).
    block: elements per normalisation block; 0 asks for rank-1
      normalisation (1-D tensors: blocks of 128).
    rounding: 'nearest' or 'stochastic' (`encode` then needs a key).

  Example:
    >>> StateCodec(bits=4, table='linear', block=0).encode(
    ...     jnp.ones((8, 8))).decode().sum().item()
    64.0
  """

  bits: int = 8
  table: str = 'signed_dynamic'
  block: int = 256
  rounding: str = 'nearest'

  def __post_init__(self):
    if not _is_int(self.bits) or self.bits not in (4, 8):
      raise ValueError(
        f'StateCodec.bits must be 4 or 8 (an int), got {self.bits!r}.'
      )
    if self.table not in _TABLES:
      raise ValueError(
        f'StateCodec.table must be one of {_TABLES}, got {self.table!r}.'
      )
    if not _is_int(self.block) or self.block < 0:
      raise ValueError(
        f'StateCodec.block must be an int >= 0 (0: rank-1), got {self.block!r}.'
      )
    if self.rounding not in _ROUNDINGS:
      raise ValueError(
        f'StateCodec.rounding must be one of {_ROUNDINGS}, got '
        f'{self.rounding!r}.'
      )

  @property
  def values(self) -> tuple[float, ...]:
    """The sorted code values."""
    if self.table == 'linear':
      return linear_table(self.bits)
    signed = self.table == 'signed_dynamic'
    return dynamic_table(self.bits, signed, zero=signed)

  def encode(self, x: jax.Array, key: jax.Array | None = None) -> LowBitTensor:
    """`LowBitTensor.encode` with this codec (`key`: stochastic only)."""
    stochastic = self.rounding == 'stochastic'
    if stochastic and key is None:
      raise ValueError("StateCodec(rounding='stochastic').encode needs a key.")
    return _encode_jit(
      x,
      bits=self.bits,
      table=self.values,
      block=self.block,
      key=key if stochastic else None,
    )

  def zeros(self, shape: tuple[int, ...]) -> LowBitTensor:
    """The encoding of zeros of `shape`."""
    return LowBitTensor.zeros(
      shape, bits=self.bits, table=self.values, block=self.block
    )


_encode_jit = jax.jit(
  LowBitTensor.encode, static_argnames=('bits', 'table', 'block')
)
