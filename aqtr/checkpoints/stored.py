"""One stored quantized linear weight, the unit every layout codec reads.

A `Stored` is the layout-free form of a frozen weight matrix in the Flax
kernel orientation [d_in, d_out]: signed integer codes `q`, one scale per
group of `group` consecutive input rows and output column, and (affine
numerics) an integer zero point per scale:

  w[i, o] = (q[i, o] - zero[g[i], o]) * scale[g[i], o],  g[i] = i // group

computed in float32 (what aqtr's `QTensor.dequant` computes). Codes and
zero points are signed, in [-2^(b-1), 2^(b-1) - 1] (the compressed-tensors
convention); layouts with unsigned codes add 2^(b-1) on the way out.
An act-order weight (GPTQ's `desc_act`) gives each row its group by
`g_idx` instead (g[i] = g_idx[i]: every group holds `group` rows, in any
order); aqtr serves it with the rows sorted by group and the input
gathered to match (`aqtr.checkpoints.tree`).

The bit packers here are the ones the layouts share: `pack` lays values of
`bits` bits densely into little-endian int32 words along one axis (value
j of a row at bit j * bits of the row's bit stream; a value may straddle
two words), `unpack` inverts it.

Example:
  >>> import numpy as np
  >>> s = Stored(q=np.array([[1, -2], [3, 4]], np.int8),
  ...            scale=np.array([[0.5, 0.25]], np.float32), bits=4, group=2)
  >>> s.dequant().tolist()
  [[0.5, -0.5], [1.5, 1.0]]
  >>> unpack(pack(np.arange(8, dtype=np.uint8), 4), 4, 8).tolist()
  [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from aqtr.core import codecs

__all__ = [
  'E2M1',
  'FP4_GROUPS',
  'KINDS',
  'CheckpointError',
  'Stored',
  'check_g_idx',
  'pack',
  'unpack',
]


KINDS = ('int', 'mxfp4', 'nvfp4')
FP4_GROUPS = {'mxfp4': 32, 'nvfp4': 16}  # Block size of the fp4 kinds.
# The value of each fp4 E2M1 code (sign bit 3, then the magnitude code).
E2M1 = np.array(
  [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
  np.float32,
)


class CheckpointError(ValueError):
  """A checkpoint (or an export request) that cannot be read or written."""


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Stored:
  """One quantized weight matrix [d_in, d_out] (see the module docstring).

  Attributes:
    q: int8 [d_in, d_out] signed codes.
    scale: float [groups, d_out] (float32, float16 or bfloat16).
    zero: int8 [groups, d_out] signed zero points, or None (symmetric).
    bits: 1..8.
    group: input rows per scale group (d_in: one group per channel).
    kind: 'int' (the codes above) or 'mxfp4': `q` holds fp4 E2M1 codes
      (uint8 0..15: sign bit 3, then the 3-bit magnitude code of
      0, 0.5, 1, 1.5, 2, 3, 4, 6), `scale` powers of two (E8M0), groups
      of 32, no zero point: w = e2m1(q) * scale; or 'nvfp4': E2M1 codes
      in groups of 16 whose float32 scale is NVFP4's two-level one (an
      e4m3 block scale over the tensor's global scale, d / g: what aqtr's
      numerics and compressed-tensors' dequantization compute).
    g_idx: int32 [d_in], the group of each row (act-order), or None (row
      i is in group i // group).
  """

  q: np.ndarray
  scale: np.ndarray
  zero: np.ndarray | None = None
  bits: int = 4
  group: int = 0
  kind: str = 'int'
  g_idx: np.ndarray | None = None

  def __post_init__(self):
    self.check('weight')

  @property
  def d_in(self) -> int:
    return int(self.q.shape[0])

  @property
  def d_out(self) -> int:
    return int(self.q.shape[1])

  @property
  def groups(self) -> int:
    return self.d_in // self.group

  @property
  def symmetric(self) -> bool:
    return self.zero is None

  @property
  def channelwise(self) -> bool:
    return self.group == self.d_in

  def check(self, name: str) -> None:
    """Raises CheckpointError (one line naming `name` and the field)."""
    if self.kind not in KINDS:
      raise CheckpointError(
        f'{name}: kind must be one of {KINDS}, got {self.kind!r}.'
      )
    if self.kind in FP4_GROUPS:
      self._check_fp4(name)
      return
    b = self.bits
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8:
      raise CheckpointError(f'{name}: bits must be in 1..8, got {b!r}.')
    if self.q.ndim != 2:
      raise CheckpointError(
        f'{name}: codes must be [d_in, d_out], got shape {self.q.shape}.'
      )
    g = self.group
    if not isinstance(g, int) or g <= 0 or self.d_in % g:
      raise CheckpointError(
        f'{name}: group size {g!r} must divide d_in={self.d_in}.'
      )
    want = (self.groups, self.d_out)
    if tuple(self.scale.shape) != want:
      raise CheckpointError(
        f'{name}: scale has shape {tuple(self.scale.shape)}, but bits / '
        f'group size give {want} (group={g}, d_in={self.d_in}).'
      )
    if self.zero is not None and tuple(self.zero.shape) != want:
      raise CheckpointError(
        f'{name}: zero point has shape {tuple(self.zero.shape)}, expected '
        f'{want} (group={g}).'
      )
    if self.g_idx is not None:
      check_g_idx(self.g_idx, self.d_in, g, name)
    lo, hi = -(2 ** (b - 1)), 2 ** (b - 1) - 1
    for what, a in (('codes', self.q), ('zero points', self.zero)):
      if a is None or not a.size:
        continue
      if int(a.min()) < lo or int(a.max()) > hi:
        raise CheckpointError(
          f'{name}: {what} span [{int(a.min())}, {int(a.max())}], outside '
          f'the signed {b}-bit range [{lo}, {hi}] (field bits={b}).'
        )

  def _check_fp4(self, name: str) -> None:
    what, n = self.kind.upper(), FP4_GROUPS[self.kind]
    if self.q.ndim != 2 or self.group != n or self.d_in % n:
      raise CheckpointError(
        f'{name}: {what} holds [d_in, d_out] codes in groups of {n} along '
        f'd_in; got shape {self.q.shape}, group size {self.group}.'
      )
    if tuple(self.scale.shape) != (self.groups, self.d_out):
      raise CheckpointError(
        f'{name}: scale has shape {tuple(self.scale.shape)}, but groups of '
        f'{n} give {(self.groups, self.d_out)}.'
      )
    if self.zero is not None or (self.q.size and int(self.q.max()) > 15):
      raise CheckpointError(
        f'{name}: {what} codes are 4-bit E2M1 (0..15) with no zero point.'
      )
    scale = np.asarray(self.scale, np.float32)
    if not (np.isfinite(scale) & (scale >= 0)).all():
      raise CheckpointError(
        f'{name}: {what} block scales must be finite and >= 0 (field '
        'weight_scale).'
      )
    m, _ = np.frexp(scale)
    if self.kind == 'mxfp4' and not (m == 0.5).all():
      raise CheckpointError(
        f'{name}: MXFP4 scales must be powers of two (E8M0; field '
        'weight_scale).'
      )

  @property
  def rows(self) -> np.ndarray:
    """int [d_in]: the group of each row (`g_idx`, or i // group)."""
    if self.g_idx is not None:
      return np.asarray(self.g_idx, np.int64)
    return np.arange(self.d_in) // self.group

  def dequant(self) -> np.ndarray:
    """The float32 weight [d_in, d_out] the codes serve."""
    g = self.rows
    s = self.scale.astype(np.float32)[g]
    if self.kind in FP4_GROUPS:
      return E2M1[self.q.astype(np.int64)] * s
    v = self.q.astype(np.float32)
    if self.zero is not None:
      v = v - self.zero.astype(np.float32)[g]
    return v * s


def check_g_idx(g_idx, d_in: int, group: int, name: str) -> None:
  """Raises CheckpointError (one line per mismatch) unless `g_idx` gives
  each of d_in rows a group in [0, d_in / group), `group` rows each."""
  a = np.asarray(g_idx)
  if a.shape != (d_in,):
    raise CheckpointError(
      f'{name}.g_idx: shape {a.shape}, but the codes have d_in={d_in} rows '
      '(field g_idx).'
    )
  if not np.issubdtype(a.dtype, np.integer):
    raise CheckpointError(
      f'{name}.g_idx: dtype {a.dtype}; the group of each row is an integer.'
    )
  n = d_in // group
  if a.size and (int(a.min()) < 0 or int(a.max()) >= n):
    raise CheckpointError(
      f'{name}.g_idx: groups span [{int(a.min())}, {int(a.max())}], outside '
      f'[0, {n - 1}] (group_size={group}, d_in={d_in}).'
    )
  counts = np.bincount(a.astype(np.int64), minlength=n)
  bad = np.flatnonzero(counts != group)
  if bad.size:
    raise CheckpointError(
      f'{name}.g_idx: group {int(bad[0])} holds {int(counts[bad[0]])} rows, '
      f'group_size={group} gives {group} (field group_size).'
    )


def pack(values: np.ndarray, bits: int, axis: int = -1) -> np.ndarray:
  """Unsigned `bits`-bit values -> int32 words, densely along `axis`.

  The bytes are the core's bit stream (`aqtr.core.codecs.pack`), padded
  to whole little-endian int32 words.

  Args:
    values: integers in [0, 2^bits) (any int dtype), any rank.
    bits: 1..8.
    axis: the axis packed; its length n becomes ceil(n * bits / 32).

  Returns:
    int32 words (little-endian bit order: value j at bit j * bits).
  """
  v = np.moveaxis(np.asarray(values), axis, -1)
  by = np.asarray(codecs.pack(jnp.asarray(v.astype(np.uint8)), bits))
  pad = -by.shape[-1] % 4
  by = np.pad(by, [(0, 0)] * (by.ndim - 1) + [(0, pad)])
  out = np.ascontiguousarray(by).view('<u4').astype(np.uint32)
  return np.ascontiguousarray(np.moveaxis(out.view(np.int32), -1, axis))


def unpack(words: np.ndarray, bits: int, n: int, axis: int = -1) -> np.ndarray:
  """Inverse of `pack`: int32 words -> uint8 values, `n` along `axis`."""
  w = np.moveaxis(np.asarray(words), axis, -1)
  by = np.ascontiguousarray(w.astype('<i4')).view(np.uint8)
  if by.shape[-1] * 8 < n * bits:
    raise CheckpointError(
      f'packed words hold {by.shape[-1] * 8 // bits} values of {bits} bits, '
      f'{n} needed.'
    )
  vals = np.asarray(codecs.unpack(jnp.asarray(by), bits, n))
  return np.moveaxis(vals, -1, axis)
