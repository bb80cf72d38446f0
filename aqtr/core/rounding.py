"""Rounding modes: round-to-nearest-even and stochastic rounding."""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_NOISE_BITS = (8, 16)


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
  `E[q] = v` for v inside the clip range, up to 2^-9 of a step: u is drawn
  on a 256-point grid (`uniform_grid`), four draws per 32-bit random word,
  ample for the at most 8-bit integer targets that round stochastically.
  Noise is drawn once per group of `noise_sharing_axes` (axes of the
  operand as the user sees it; for a gradient operand, the axes of the dot
  output) and broadcast along them.

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
    u = uniform_grid(key, small, bits=8)
    return jnp.broadcast_to(u, shape)


def uniform_grid(
  key: jax.Array, shape: tuple[int, ...], bits: int = 16
) -> jax.Array:
  """Uniform noise on the 2^bits-point grid `(j + 1/2) / 2^bits - 1/2`.

  Each 32-bit word from the key's generator gives 32 / bits values (4 for
  8 bits), which divides the generator's cost, the dominant cost of
  stochastic rounding on CPU, by that much against `jax.random.uniform`.
  The mean is exactly 0, and the rounding bias `E[round(v + u)] - v` lies
  within 2^-(bits+1) of a quantization step for every v (zero when v's
  fraction is on the grid): 2^-9 of a step for 8 bits.

  Args:
    key: a typed PRNG key.
    shape: the noise shape.
    bits: 8 or 16.

  Example:
    >>> import jax
    >>> u = uniform_grid(jax.random.key(0), (3,), bits=8)
    >>> bool(((u + 0.5) * 256 - 0.5 == ((u + 0.5) * 256 - 0.5).round()).all())
    True
  """
  if bits not in _NOISE_BITS:
    raise ValueError(f'noise bits must be one of {_NOISE_BITS}, got {bits!r}.')
  n = math.prod(shape)
  per_word = 32 // bits
  words = jax.random.bits(key, (-(-n // per_word),), jnp.uint32)
  unsigned = jnp.uint8 if bits == 8 else jnp.uint16
  parts = lax.bitcast_convert_type(words, unsigned).reshape(-1)[:n]
  u = (parts.astype(jnp.float32) + 0.5) * (1.0 / 2**bits) - 0.5
  return u.reshape(shape)


def uniform16(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """`uniform_grid` with 16 bits."""
  return uniform_grid(key, shape, 16)


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
