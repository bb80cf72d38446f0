"""The passthrough numerics: not quantized."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from aqtr.numerics.base import Numerics, register


@register('none')
@dataclasses.dataclass(frozen=True, kw_only=True)
class NoNumerics(Numerics):
  """No quantization: the operand enters the dot as it is.

  A config whose numerics are all `NoNumerics` reproduces `lax.dot_general`
  bit for bit, values and gradients.

  Example:
    >>> import aqtr
    >>> aqtr.TensorConfig(numerics=NoNumerics()).numerics.quantizes
    False
  """

  quantizes = False

  @property
  def max_value(self) -> float:
    return 1.0

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(jnp.float32)

  def quantize(self, v: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    return v
