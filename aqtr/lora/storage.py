"""Compact storage of a frozen LoRA base: 4-bit codes, double quantization.

`aqtr.flax.convert` stores a codebook weight (nf4) as its float32 table
values. A LoRA base keeps instead, per value, its 4-bit index into the
table (`uint4`; `table[index]` is the value) and, with `double_quant`,
QLoRA's 8-bit scales (Dettmers et al. 2023, arXiv 2305.14314): the
positive block scales `s` (one per 64 weights) minus their mean `m` are
split into blocks of 256 and stored as `int8` with one float32 absmax
`c` per block:

  q = round(127 (s - m) / c),   s ~ q c / 127 + m

so a weight costs 4 + 8/64 + 32/(64 * 256) bits instead of 4 + 32/64.
(QLoRA stores the second-level values as 8-bit floats; these are int8.)

The holders (`LoraKernel` for nnx, `LoraBox` for linen) sit where the
float kernel sat, as `aqtr.flax.frozen`'s do, and hand the engine the
decoded entries (`entries()`), computed inside the traced step: training
and serving read the same decoded values, so they agree bit for bit.
Stacked leading axes (scan over layers) are kept on every stored array.

Example:
  >>> import jax.numpy as jnp
  >>> s = jnp.linspace(0.5, 2.0, 300).reshape(1, 300)
  >>> packed = encode_scale(s, lead=0)
  >>> packed['q'].dtype, packed['c'].shape
  (dtype('int8'), (2,))
  >>> float(jnp.abs(decode_scale(packed, (1, 300)) - s).max()) < 0.01
  True
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from aqtr.flax.frozen import FrozenBox, FrozenKernel

__all__ = [
  'BLOCK',
  'LoraBox',
  'LoraKernel',
  'decode',
  'decode_scale',
  'encode',
  'encode_scale',
]

BLOCK = 256  # Scales per second-level block (QLoRA's double quantization).


def encode_scale(s: jax.Array, lead: int) -> dict:
  """8-bit scales: `s` [lead..., per-layer shape] -> {q, c, m}.

  Per leading index: mean `m`, then blocks of `BLOCK` of `s - m` as int8
  with their absmax `c`.
  """
  head = s.shape[:lead]
  flat = s.reshape(*head, -1).astype(jnp.float32)
  n = flat.shape[-1]
  nb = -(-n // BLOCK)
  m = flat.mean(-1)
  d = jnp.pad(flat - m[..., None], [(0, 0)] * lead + [(0, nb * BLOCK - n)])
  d = d.reshape(*head, nb, BLOCK)
  c = jnp.abs(d).max(-1)
  safe = jnp.where(c > 0, c, 1.0)
  q = jnp.clip(jnp.round(127.0 * d / safe[..., None]), -127, 127)
  return {'c': safe, 'm': m, 'q': q.astype(jnp.int8)}


def decode_scale(packed: dict, shape: tuple[int, ...]) -> jax.Array:
  """The float32 scales of one layer's `shape` (leading axes kept)."""
  q, c, m = packed['q'], packed['c'], packed['m']
  head = q.shape[:-2]
  d = q.astype(jnp.float32) * (c[..., None] / 127.0)
  n = math.prod(shape)
  flat = d.reshape(*head, -1)[..., :n] + m[..., None]
  return flat.reshape(*head, *shape)


def _codes(q: jax.Array, table: tuple[float, ...]) -> jax.Array:
  """The table index of each value of `q` (exact table values)."""
  t = np.asarray(table, np.float32)
  idx = jnp.zeros(q.shape, jnp.int32)
  for i, v in enumerate(t):
    idx = jnp.where(q == v, i, idx)
  return idx.astype(jnp.uint4)


def _values(codes: jax.Array, table: tuple[float, ...]) -> jax.Array:
  """`table[codes]` (elementwise selects: keeps any sharding of codes)."""
  idx = codes.astype(jnp.int32)
  out = jnp.zeros(codes.shape, jnp.float32)
  for i, v in enumerate(np.asarray(table, np.float32)):
    out = jnp.where(idx == i, v, out)
  return out


def encode(entries: dict, table, double_quant: bool, ref_ndim: int):
  """Converted entries -> (stored entries, static per-part shapes).

  Args:
    entries: a holder's {op key: {entry name: {'rhs': parts}}}.
    table: the codebook's values (None: `qvalue` is kept as it is).
    double_quant: store `scale` in 8 bits (`encode_scale`).
    ref_ndim: the rank of one layer's `qvalue` (more axes are stacked).
  """
  out, shapes = {}, {}
  for op, named in entries.items():
    out[op] = {}
    for name, sides in named.items():
      parts = dict(sides['rhs'])
      lead = parts['qvalue'].ndim - ref_ndim
      if table is not None:
        parts['qvalue'] = _codes(parts['qvalue'], table)
      if double_quant:
        s = parts.pop('scale')
        shapes[f'{op}/{name}'] = tuple(s.shape[lead:])
        parts['scale8'] = encode_scale(s, lead)
      out[op][name] = {'rhs': parts}
  return out, shapes


def decode(stored: dict, table, shapes: dict) -> dict:
  """Stored entries -> the entries the engine reads (float32 values)."""
  out = {}
  for op, named in stored.items():
    out[op] = {}
    for name, sides in named.items():
      parts = dict(sides['rhs'])
      if table is not None:
        parts['qvalue'] = _values(parts['qvalue'], table)
      if 'scale8' in parts:
        parts['scale'] = decode_scale(
          parts.pop('scale8'), shapes[f'{op}/{name}']
        )
      out[op][name] = {'rhs': parts}
  return out


class LoraKernel(FrozenKernel):
  """nnx: a LoRA base stored compactly (metadata `table`, `scale_shapes`)."""

  def entries(self) -> dict:
    return decode(
      self.get_raw_value(),
      self.get_metadata('table'),
      dict(self.get_metadata('scale_shapes')),
    )

  def stored(self) -> dict:
    """The stored (compact) entries."""
    return self.get_raw_value()


class LoraBox(FrozenBox):
  """linen: a LoRA base stored compactly (fields `table`, `scale_shapes`)."""

  table: Any = struct.field(pytree_node=False, default=None)
  scale_shapes: Any = struct.field(pytree_node=False, default=None)

  def entries(self) -> dict:
    return decode(self.frozen, self.table, dict(self.scale_shapes or ()))

  def stored(self) -> dict:
    """The stored (compact) entries."""
    return self.frozen
