"""Random Hadamard transform (RHT) in blocks along the contraction."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr.transforms.base import Transform, check_axis, register

SIGNS = ('none', 'seed', 'key')
METHODS = ('auto', 'matmul', 'butterfly')
# 'auto': the dense product up to this block size, butterflies above.
_AUTO_MATMUL_MAX = 32
_MAX_LOG2 = 10


def hadamard_matrix(n: int) -> np.ndarray:
  """The normalised Sylvester Hadamard matrix `H_n` (`H H^T = I`).

  `H_1 = [1]`, `H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2)`: symmetric,
  entries `+-1/sqrt(n)`.

  Example:
    >>> (hadamard_matrix(2) * 2**0.5).tolist()
    [[1.0, 1.0], [1.0, -1.0]]
  """
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h / math.sqrt(n)


def _butterfly(x: jax.Array, axis: int, n: int) -> jax.Array:
  """`v -> v H_n` (unnormalised) on blocks of n along `axis`, in place.

  log2(n) stages; stage h pairs the elements h apart in groups of 2h:
  (a, b) -> (a + b, a - b). Reshapes only, no transposes, so XLA fuses
  the stages with what reads the result.
  """
  shape = x.shape
  pre, k = shape[:axis], shape[axis]
  post = shape[axis + 1 :]
  h = 1
  while h < n:
    y = x.reshape(pre + (k // (2 * h), 2, h) + post)
    a = lax.index_in_dim(y, 0, axis + 1, keepdims=False)
    b = lax.index_in_dim(y, 1, axis + 1, keepdims=False)
    x = jnp.stack([a + b, a - b], axis=axis + 1).reshape(shape)
    h *= 2
  return x


@register('hadamard')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Hadamard(Transform):
  """Blocked (random) Hadamard transform along the contraction.

  Math (Ailon & Chazelle 2006 for the randomised transform; as used for
  4-bit training by NVIDIA 2025, arXiv 2509.25149, 16-wide, and Quartet,
  Castro et al. 2025, arXiv 2505.14669). With n = `block_size` (a power
  of two dividing the contraction K) and the normalised Sylvester matrix
  H_n (`hadamard_matrix`), `R = I_{K/n} (x) (D H_n)` with
  `D = diag(sigma)`, sigma in {+-1}^n (the same for every block):

    apply:    v -> v R   = ((v * sigma) H_n)   per block of n,
    inverse:  v -> v R^T = (v H_n) * sigma.

  R is orthogonal, so rotating both operands of a dot along its
  contraction leaves the product unchanged (see `Transform`); an outlier
  is spread over its block of n (each output is +-v_i / sqrt(n) summed).

  `signs`:
    'none'  sigma = 1 (the plain Walsh-Hadamard transform);
    'seed'  sigma drawn once from `seed` (numpy), a constant: the same
            every step, and for every layer with the same seed (give
            layers different seeds through rules for per-layer signs);
    'key'   sigma drawn from the dot's PRNG key at call time: new every
            step and different per layer (each dot has its own key).

  `method`: 'matmul' (one dense n x n product per block with `D H_n`
  folded into the matrix, at HIGHEST precision; O(n) per element),
  'butterfly' (log2 n add/subtract stages, O(log n) per element, reshapes
  only, fused by XLA into its reader) or 'auto' ('matmul' for n <= 32,
  else 'butterfly': the faster on XLA:CPU when followed by the NVFP4
  quantization, benchmarks/transforms.py). All give the same values to
  float rounding.

  Attributes:
    block_size: n, a power of two in 2..1024 dividing the contraction.
    signs: one of SIGNS.
    seed: an int >= 0, the signs' seed for signs='seed'.
    method: one of METHODS.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([[4.0, 0.0, 0.0, 0.0]])
    >>> Hadamard(block_size=4, signs='none').apply(x, 1).tolist()
    [[2.0, 2.0, 2.0, 2.0]]
  """

  block_size: int = 16
  signs: str = 'seed'
  seed: int = 0
  method: str = 'auto'

  def __post_init__(self):
    n = self.block_size
    if (
      isinstance(n, bool)
      or not isinstance(n, int)
      or not 2 <= n <= 2**_MAX_LOG2
      or n & (n - 1)
    ):
      raise ValueError(
        'Hadamard.block_size must be a power of two in '
        f'2..{2**_MAX_LOG2} (16, 32, 128, ...), got {n!r}.'
      )
    if self.signs not in SIGNS:
      raise ValueError(
        f'Hadamard.signs must be one of {SIGNS}, got {self.signs!r}.'
      )
    s = self.seed
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
      raise ValueError(f'Hadamard.seed must be an int >= 0, got {s!r}.')
    if self.method not in METHODS:
      raise ValueError(
        f'Hadamard.method must be one of {METHODS}, got {self.method!r}.'
      )

  @property
  def needs_key(self) -> bool:
    return self.signs == 'key'

  def check_size(self, k: int, operand: str = 'operand') -> None:
    if k % self.block_size:
      raise ValueError(
        f'{operand}: Hadamard.block_size={self.block_size} does not divide '
        f'its contraction size {k}; use a power of two dividing {k}.'
      )

  def sigma(self, key: jax.Array | None = None, operand: str = 'operand'):
    """The sign vector (n,) (None for signs='none'; numpy for 'seed')."""
    n = self.block_size
    if self.signs == 'none':
      return None
    if self.signs == 'seed':
      bits = np.random.default_rng(self.seed).integers(0, 2, n)
      return (2 * bits - 1).astype(np.float32)
    if key is None:
      raise ValueError(
        f"{operand}: Hadamard(signs='key') draws its signs from the dot's "
        "PRNG key: pass key=jax.random.key(...) (or use signs='seed')."
      )
    return jax.random.rademacher(key, (n,), jnp.float32)

  def apply(self, x, axis, key=None, operand='operand') -> jax.Array:
    return self._rotate(x, axis, key, operand, inverse=False)

  def inverse(self, x, axis, key=None, operand='operand') -> jax.Array:
    return self._rotate(x, axis, key, operand, inverse=True)

  def _rotate(self, x, axis, key, operand, inverse: bool) -> jax.Array:
    x = jnp.asarray(x)
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    axis = check_axis(axis, x.ndim, operand)
    k, n = x.shape[axis], self.block_size
    self.check_size(k, operand)
    sigma = self.sigma(key, operand)
    blocks = x.shape[:axis] + (k // n, n) + x.shape[axis + 1 :]
    ones = (1,) * (x.ndim - axis - 1)
    lead = (1,) * (axis + 1)
    method = self.method
    if method == 'auto':
      method = 'matmul' if n <= _AUTO_MATMUL_MAX else 'butterfly'
    if method == 'matmul':
      h = hadamard_matrix(n).astype(np.float32)
      if sigma is not None:  # D H (apply) or its transpose H D (inverse).
        h = sigma[:, None] * h
        h = h.T if inverse else h
      y = jnp.tensordot(
        x.reshape(blocks), h, ((axis + 1,), (0,)), precision='highest'
      )
      return jnp.moveaxis(y, -1, axis + 1).reshape(x.shape)
    s = None
    if sigma is not None:
      s = jnp.asarray(sigma).reshape(lead + (n,) + ones)
    if s is not None and not inverse:
      x = (x.reshape(blocks) * s).reshape(x.shape)
    y = _butterfly(x, axis, n) * np.float32(1 / math.sqrt(n))
    if s is not None and inverse:
      y = (y.reshape(blocks) * s).reshape(x.shape)
    return y
