"""QTensor: a quantized tensor (stored values + scale) as a pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from aqtr.core.dimension_numbers import OperandLayout
from aqtr.core.eager import compiled_when_eager

# The view axes of a quantized operand (see aqtr.tilings.base):
#   'fk': [batch, tile, free, k]     'kf': [batch, tile, k, free]
ROLE_AXES = {
  'fk': {'batch': 0, 'tile': 1, 'free': 2, 'k': 3},
  'kf': {'batch': 0, 'tile': 1, 'k': 2, 'free': 3},
}


def view_shape(shape3, form: str, tile: int | None) -> tuple[int, ...]:
  """The view shape `to_view` gives a canonical array of `shape3`."""
  b, d1, d2 = shape3
  k = d2 if form == 'fk' else d1
  t = tile or k
  n = k // t if t else 1
  return (b, n, d1, t) if form == 'fk' else (b, n, t, d2)


def to_view(x3: jax.Array, form: str, tile: int | None) -> jax.Array:
  """Canonical [B, F, K] / [B, K, F] -> view [B, T, F, t] / [B, T, t, F]."""
  b, d1, d2 = x3.shape
  k = d2 if form == 'fk' else d1
  t = tile or k
  n = k // t
  if form == 'kf':
    return x3.reshape(b, n, t, d2)
  if n == 1:
    return x3.reshape(b, 1, d1, t)
  x4 = x3.reshape(b, d1, n, t)
  return x4.transpose(0, 2, 1, 3) if n > 1 else x4.reshape(b, 1, d1, t)


def from_view(x4: jax.Array, form: str) -> jax.Array:
  """Inverse of `to_view`."""
  b, n, d1, d2 = x4.shape
  if form == 'kf':
    return x4.reshape(b, n * d1, d2)
  if n > 1:
    x4 = x4.transpose(0, 2, 1, 3)
  return x4.reshape(b, d1, n * d2)


def stored_form(scale_shape, form: str) -> str:
  """The view stored parts are in: `form`, or 'fk' for a 'kf' operand
  stored with its contraction minor (`minor_k`).

  Math. A 'kf' view [B, T, t, F] has scales [B, T, 1, F]; the same parts
  with their last two axes swapped are the 'fk' view [B, T, F, t] with
  scales [B, T, F, 1]. Scales that vary along F (F > 1) tell them apart;
  parts with one scale column are only ever stored as they were quantized.

  Args:
    scale_shape: the stored scale's shape (4-D tiled view).
    form: the operand's own form in the dot ('fk' or 'kf').

  Returns:
    'fk' or 'kf'.

  Example:
    >>> stored_form((1, 1, 1, 8), 'kf'), stored_form((1, 1, 8, 1), 'kf')
    ('kf', 'fk')
  """
  s = tuple(scale_shape)
  if form == 'kf' and len(s) == 4 and s[2] > 1 and s[3] == 1:
    return 'fk'
  return form


def swapped_view(parts: dict) -> dict:
  """Stored parts in the other view ('kf' <-> 'fk'): the last two axes of
  `qvalue`, `scale` and `zero_point` swapped (other entries as they are).

  Example:
    >>> import numpy as np
    >>> p = swapped_view({'qvalue': np.zeros((1, 1, 4, 8), np.int8),
    ...                   'scale': np.ones((1, 1, 1, 8), np.float32)})
    >>> p['qvalue'].shape, p['scale'].shape
    ((1, 1, 8, 4), (1, 1, 8, 1))
  """
  out = dict(parts)
  for k in ('qvalue', 'scale', 'zero_point'):
    if out.get(k) is not None:
      out[k] = jnp.swapaxes(out[k], -1, -2)
  return out


def as_stored_in(parts: dict, form: str, want: str) -> dict:
  """Stored parts of an operand of `form` in the view `want` ('kf' for
  a [K, N] weight's readers), whichever view they were stored in.

  Example:
    >>> import numpy as np
    >>> p = {'qvalue': np.zeros((1, 1, 8, 4), np.int8),
    ...      'scale': np.ones((1, 1, 8, 1), np.float32)}
    >>> as_stored_in(p, 'kf', 'kf')['qvalue'].shape
    (1, 1, 4, 8)
  """
  have = stored_form(jnp.shape(parts['scale']), form)
  return parts if have == want else swapped_view(parts)


@dataclasses.dataclass(frozen=True)
class QTensor:
  """Stored values and scale of a quantized tensor: `x ~ qvalue * scale`.

  `qvalue` is held in the dot's tiled view (see `ROLE_AXES`) and `scale`
  broadcasts against it; `dequant()` returns the original layout. Affine
  numerics (`int_asymmetric`) add a zero point: `x ~ (qvalue - zp) * scale`.

  Attributes:
    qvalue: int8/int4/fp8 values (float when not quantized), tiled view.
    scale: float32 scale broadcastable to `qvalue` (None: not quantized).
    layout: the original operand layout (static).
    form: 'fk' or 'kf' (static).
    zero_point: float32 (integer-valued) zero point shaped like `scale`, or
      None for symmetric numerics.
    transform: the forward transform (`aqtr.transforms`) the values were
      rotated by before quantization, along the contraction (static), or
      None: `dequant()` then gives the rotated operand, and a dot takes
      the QTensor only with that forward transform.
    packed: int4 `qvalue` as stored (`codecs.Int4`: uint8, two codes a
      byte along the last axis), or None. Set by serving when the codes
      come packed: a CPU dot then reads these bytes (`native_dot`) and
      `qvalue` is not computed.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> qt = aqtr.quantize(jnp.array([[1.0, -2.0]]), aqtr.TensorConfig())
    >>> qt.qvalue.dtype, qt.dequant().shape
    (dtype('int8'), (1, 2))
  """

  qvalue: jax.Array
  scale: jax.Array | None
  layout: OperandLayout
  form: str = 'fk'
  zero_point: jax.Array | None = None
  transform: Any = None
  packed: jax.Array | None = None

  @compiled_when_eager
  def dequant(self, dtype=jnp.float32) -> jax.Array:
    """`(qvalue - zero_point) * scale` in the original layout and `dtype`."""
    v = self.qvalue.astype(jnp.float32)
    if self.zero_point is not None:
      v = v - self.zero_point
    if self.scale is not None:
      v = v * self.scale
    x3 = from_view(v, self.form)
    return self.layout.from_canonical(x3, self.form).astype(dtype)


jax.tree_util.register_dataclass(
  QTensor,
  data_fields=['qvalue', 'scale', 'zero_point', 'packed'],
  meta_fields=['layout', 'form', 'transform'],
)
