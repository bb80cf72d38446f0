"""Rounding modes: round-to-nearest-even and stochastic rounding."""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rounding(abc.ABC):
  """How the scaled tensor is rounded; stochastic modes draw noise."""

  stochastic: ClassVar[bool] = False

  @abc.abstractmethod
  def noise(self, key: jax.Array | None, shape: tuple[int, ...]):
    """Additive rounding noise of `shape` (None for deterministic modes)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NearestEven(Rounding):
  """Round to nearest, ties to even (the default).

  Example:
    >>> NearestEven().noise(None, (2,)) is None
    True
  """

  def noise(self, key, shape):
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stochastic(Rounding):
  """Stochastic rounding (Gupta et al. 2015, arXiv 1502.02551).

  Math: `q = round(v + u)`, `u ~ U[-1/2, 1/2)` from an explicit PRNG key, so
  `E[q] = v` for v inside the clip range (u is drawn on a 2^16-point grid,
  see `uniform16`). Noise is drawn once per group of
  `noise_sharing_axes` (axes of the operand as the user sees it; for a
  gradient operand, the axes of the dot output) and broadcast along them.

  Attributes:
    noise_sharing_axes: axes along which one noise value is shared.

  Example:
    >>> import jax
    >>> Stochastic().noise(jax.random.key(0), (2, 3)).shape
    (2, 3)
  """

  noise_sharing_axes: tuple[int, ...] = ()
  stochastic = True

  def __post_init__(self):
    axes = self.noise_sharing_axes
    if not isinstance(axes, tuple) or not all(
      isinstance(a, int) and not isinstance(a, bool) for a in axes
    ):
      raise TypeError(
        f'Stochastic.noise_sharing_axes must be a tuple of ints, got {axes!r}.'
      )

  def noise(self, key, shape):
    if key is None:
      raise ValueError(
        'Stochastic rounding needs a PRNG key: pass key=jax.random.key(...) '
        'to aqtr.dot_general / aqtr.einsum / aqtr.quantize.'
      )
    rank = len(shape)
    for a in self.noise_sharing_axes:
      if not -rank <= a < rank:
        raise ValueError(
          f'Stochastic.noise_sharing_axes has axis {a}, out of range for an '
          f'operand of rank {rank}.'
        )
    shared = {a % rank for a in self.noise_sharing_axes} if rank else set()
    small = tuple(1 if i in shared else d for i, d in enumerate(shape))
    return jnp.broadcast_to(uniform16(key, small), shape)


def uniform16(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform noise on the 2^16-point grid `(j + 1/2) / 2^16 - 1/2`.

  Each 32-bit word from the key's generator gives two values, which halves
  the generator's cost against `jax.random.uniform` (the dominant cost of
  stochastic rounding on CPU). The mean is exactly 0; the grid bounds the
  rounding bias of any value to 2^-17 of a quantization step.
  """
  n = math.prod(shape)
  words = jax.random.bits(key, ((n + 1) // 2,), jnp.uint32)
  halves = jnp.concatenate([words & 0xFFFF, words >> 16])[:n]
  u = (halves.astype(jnp.float32) + 0.5) * (1.0 / 65536) - 0.5
  return u.reshape(shape)


_KEY_HELP = (
  'key must be None, a typed PRNG key (jax.random.key(seed)) or a raw '
  'uint32[2] key (jax.random.PRNGKey(seed))'
)


def as_typed_key(key):
  """Accepts typed keys and raw uint32 `PRNGKey`s; returns a typed key.

  Raises:
    TypeError: naming `key` and what is allowed, for anything else.
  """
  if key is None:
    return None
  if not isinstance(key, jax.Array | np.ndarray):
    raise TypeError(f'{_KEY_HELP}, got {type(key).__name__} {key!r:.60}.')
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  if key.dtype != jnp.uint32 or key.shape[-1:] != (2,):
    raise TypeError(
      f'{_KEY_HELP}, got an array of dtype {key.dtype} shape {key.shape}.'
    )
  return jax.random.wrap_key_data(key)
