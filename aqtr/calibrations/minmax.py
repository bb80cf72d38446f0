"""Min/max calibration: lo/hi bounds for asymmetric (affine) numerics."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.calibrations.base import Calibration, register


@register('minmax')
@dataclasses.dataclass(frozen=True, kw_only=True)
class MinMax(Calibration):
  """lo = min(min_G x, 0), hi = max(max_G x, 0) (TFLite / PyTorch affine).

  Math (Jacob et al. 2018, arXiv 1712.05877, the affine scheme of integer
  inference): the range of each scale group G, widened to hold 0 so that
  0 is exactly representable. Asymmetric numerics (`int_asymmetric`) map
  it onto their integer range with a zero point. A calibration serves
  asymmetric numerics by defining `calibrate_range` (with `gives_range`);
  `calibrate` (the symmetric bound) is `max(-lo, hi) = max_G |x|`, as
  `absmax`.

  Example:
    >>> import jax.numpy as jnp
    >>> lo, hi = MinMax().calibrate_range(jnp.array([[1., 3.]]), axes=(1,))
    >>> lo.tolist(), hi.tolist()
    ([[0.0]], [[3.0]])
  """

  gives_range = True

  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    lo, hi = self.calibrate_range(x, axes)
    return jnp.maximum(-lo, hi)

  def calibrate_range(
    self, x: jax.Array, axes: Sequence[int]
  ) -> tuple[jax.Array, jax.Array]:
    """(lo, hi) per scale group, keepdims; NaN/inf in a group propagate."""
    axes = tuple(axes)
    lo = jnp.minimum(jnp.min(x, axis=axes, keepdims=True), 0)
    hi = jnp.maximum(jnp.max(x, axis=axes, keepdims=True), 0)
    return lo, hi
