"""Codebook (lookup-table) numerics: round to the nearest value of a table."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.core import codecs
from aqtr.numerics.base import Numerics


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codebook(Numerics):
  """Base of lookup-table numerics: `q` = the nearest value of `table`.

  Math: `table` holds T sorted values t_0 < ... < t_{T-1} with
  `max_value = max |t_j|` (the calibration bound maps onto it; with a
  table normalized to [-1, 1], `s = bound`). With midpoints
  `m_j = (t_j + t_{j+1}) / 2`, `q = t_j` for `m_{j-1} < v <= m_j` (ties go
  to the lower value); values beyond the table saturate; NaN stays NaN.

  Emulated: there is no lookup-table dot on CPU, so `q` is stored as the
  table's float32 values and the dot runs in float32 (a serving kernel
  would store the log2(T)-bit index and look the values up). Stochastic
  rounding is not supported (the grid is not uniform).

  To add a table, subclass and register it:

    @numerics.register('my_table')
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MyTable(Codebook):
      table = (-1.0, -0.25, 0.0, 0.25, 1.0)

  Example:
    >>> import jax.numpy as jnp
    >>> class Five(Codebook):
    ...   table = (-1.0, -0.25, 0.0, 0.25, 1.0)
    >>> Five().quantize(jnp.array([-0.7, 0.1, 0.2, 3.0])).tolist()
    [-1.0, 0.0, 0.25, 1.0]
  """

  # The sorted, finite table values (at least 2), set by subclasses.
  table: ClassVar[tuple[float, ...]] = ()

  def __post_init__(self):
    t = self.table
    name = type(self).__name__
    if (
      not isinstance(t, tuple)
      or len(t) < 2
      or not all(isinstance(v, float | int) and math.isfinite(v) for v in t)
      or any(a >= b for a, b in zip(t, t[1:], strict=False))
    ):
      raise TypeError(
        f'{name}.table must be a tuple of >= 2 finite, strictly increasing '
        f'floats, got {t!r}.'
      )

  @property
  def max_value(self) -> float:
    return float(max(abs(v) for v in self.table))

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(jnp.float32)

  def codec(self) -> codecs.Codec:
    """4-bit table indices, two per byte (tables of <= 16 values)."""
    if len(self.table) > 16:
      return codecs.Raw()
    return codecs.Table4(table=tuple(float(v) for v in self.table))

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    if noise is not None:
      raise ValueError(
        f'{type(self).__name__} (a codebook) does not support stochastic '
        'rounding; use NearestEven().'
      )
    t = np.asarray(self.table, np.float32)
    mids = (t[1:] + t[:-1]) / 2
    v = v.astype(jnp.float32)
    q = jnp.full(v.shape, t[0], jnp.float32)
    for m, hi in zip(mids, t[1:], strict=True):
      q = jnp.where(v > m, hi, q)
    return jnp.where(jnp.isnan(v), v, q)
