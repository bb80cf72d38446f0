"""Compact storage of a frozen LoRA base: 4-bit codes, double quantization.

`aqtr.flax.convert` stores a base's values through its numerics' codec
(`aqtr.core.codecs`: nf4 and int4 as 4-bit codes, two per byte). A LoRA
base may also store its scales in 8 bits (`double_quant`, QLoRA's double
quantization, Dettmers et al. 2023, arXiv 2305.14314, codec 'dq_int8'):
the positive block scales `s` (one per 64 weights) minus their mean `m` are
split into blocks of 256 and stored as `int8` with one float32 absmax `c`
per block:

  q = round(127 (s - m) / c),   s ~ q c / 127 + m

so a weight costs 4 + 8/64 + 32/(64 * 256) bits instead of 4 + 32/64.
(QLoRA stores the second-level values as 8-bit floats: codec 'dq_fp8'.)

The base stays in `aqtr.flax.frozen`'s holders (the one frozen container
per framework), marked compact (`frozen.compact`); they hand the engine
the decoded entries (`entries()`, `frozen.decode`), computed inside the
traced step: training and serving read the same decoded values, so they
agree bit for bit.
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

import jax

from aqtr.core import codecs
from aqtr.flax import frozen

__all__ = [
  'BLOCK',
  'decode',
  'decode_scale',
  'encode',
  'encode_scale',
]

_DQ = frozen.SCALE_CODEC  # QLoRA's double quantization, blocks of 256
BLOCK = _DQ.block  # Scales per second-level block.
decode = frozen.decode  # Stored entries -> the entries the engine reads.


def encode_scale(s: jax.Array, lead: int) -> dict:
  """8-bit scales: `s` [lead..., per-layer shape] -> {q, c, m}.

  Per leading index: mean `m`, then blocks of `BLOCK` of `s - m` as int8
  with their absmax `c` (the core codec 'dq_int8').
  """
  return _DQ.encode(s, lead=lead)


def decode_scale(packed: dict, shape: tuple[int, ...]) -> jax.Array:
  """The float32 scales of one layer's `shape` (leading axes kept)."""
  return _DQ.decode(packed, shape=shape)


def encode(entries: dict, table, double_quant: bool, ref_ndim: int):
  """Converted entries -> (stored entries, static per-part shapes).

  Args:
    entries: a holder's {op key: {entry name: {'rhs': parts}}}.
    table: the codebook's values: float 'qvalue's (an entry stored raw)
      are stored as 4-bit table indices (None: kept as they are).
    double_quant: store `scale` in 8 bits (`encode_scale`).
    ref_ndim: the rank of one layer's `qvalue` (more axes are stacked).
  """
  out, shapes = {}, {}
  for op, named in entries.items():
    out[op] = {}
    for name, sides in named.items():
      parts = dict(sides['rhs'])
      lead = parts['scale'].ndim - ref_ndim
      if table is not None and 'qvalue' in parts:
        c = codecs.Table4(table=tuple(table))
        if c.applies(parts['qvalue'].shape):
          parts.update(c.encode(parts.pop('qvalue')))
      if double_quant:
        s = parts.pop('scale')
        shapes[f'{op}/{name}'] = tuple(s.shape[lead:])
        parts['scale8'] = encode_scale(s, lead)
      out[op][name] = {'rhs': parts}
  return out, shapes
