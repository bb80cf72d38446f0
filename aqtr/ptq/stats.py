"""Streaming statistics of a weight op's activation operand.

The post-training solvers need, per weight op, the second moment of its
input, `xtx = sum_t x_t^T x_t` (GPTQ's Hessian up to 2/n), and the
per-input-channel absolute maximum and mean (AWQ, SmoothQuant). They are
sums and maxima, so they stream: one batch's stats merge into the running
ones and no activation is kept.

Indexing: `d_in` enumerates the WEIGHT's contraction dims flattened
row-major in the weight's own axis order. The weight as a matrix is
`as_matrix(w, contracting) -> [d_in, d_out]` (contraction dims moved
first and flattened, d_out the remaining dims flattened in order);
`from_matrix` inverts it. The output error of a weight change dW (as a
matrix) over the calibration tokens is `||X dW||_F^2 = tr(dW^T xtx dW)`
(`output_error`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp


class LayerStats(NamedTuple):
  """Streaming statistics of one weight op's activation (input) operand.

  Attributes:
    xtx: [d_in, d_in] f32, sum over tokens of x^T x.
    absmax: [d_in] f32, max over tokens of |x_j|.
    abssum: [d_in] f32, sum over tokens of |x_j|.
    count: [] f32, tokens seen.

  Example:
    >>> s = LayerStats.from_activations(jnp.ones((4, 3)))
    >>> float(s.count), s.mean_abs.tolist()
    (4.0, [1.0, 1.0, 1.0])
  """

  xtx: jax.Array
  absmax: jax.Array
  abssum: jax.Array
  count: jax.Array

  @classmethod
  def zeros(cls, d_in: int) -> LayerStats:
    """The stats of no tokens (the identity of `merge`)."""
    z = jnp.zeros((d_in,), jnp.float32)
    return cls(jnp.zeros((d_in, d_in), jnp.float32), z, z, jnp.zeros(()))

  @classmethod
  def from_activations(cls, x2d: jax.Array) -> LayerStats:
    """Stats of a [tokens, d_in] activation matrix (traceable under jit)."""
    if x2d.ndim != 2:
      raise ValueError(
        f'LayerStats.from_activations: x2d must be [tokens, d_in], got '
        f'shape {x2d.shape}.'
      )
    x = x2d.astype(jnp.float32)
    a = jnp.abs(x)
    xtx = jnp.matmul(x.T, x, precision=jax.lax.Precision.HIGHEST)
    return cls(
      xtx,
      jnp.max(a, axis=0, initial=0.0),
      jnp.sum(a, axis=0),
      jnp.asarray(x.shape[0], jnp.float32),
    )

  @property
  def d_in(self) -> int:
    return self.xtx.shape[0]

  @property
  def mean_abs(self) -> jax.Array:
    """[d_in] mean over tokens of |x_j| (0 before any token)."""
    return self.abssum / jnp.maximum(self.count, 1.0)

  @property
  def hessian(self) -> jax.Array:
    """GPTQ's H = 2 xtx / count (arXiv 2210.17323, eq. 1's Hessian)."""
    return 2.0 * self.xtx / jnp.maximum(self.count, 1.0)


def merge(a: LayerStats, b: LayerStats) -> LayerStats:
  """Stats of the union of two token sets: sums add, maxima max."""
  if a.xtx.shape != b.xtx.shape:
    raise ValueError(
      f'merge: stats of different d_in ({a.d_in} vs {b.d_in}); merge only '
      'stats of the same weight op.'
    )
  return _merge(a, b)


@jax.jit
def _merge(a: LayerStats, b: LayerStats) -> LayerStats:
  return LayerStats(
    a.xtx + b.xtx,
    jnp.maximum(a.absmax, b.absmax),
    a.abssum + b.abssum,
    a.count + b.count,
  )


def _normalize(contracting: Sequence[int], ndim: int) -> tuple[int, ...]:
  ok = all(-ndim <= int(d) < ndim for d in contracting)
  dims = tuple(sorted(int(d) % ndim for d in contracting)) if ok else ()
  if not ok or len(set(dims)) != len(dims):
    raise ValueError(
      f'contracting dims {tuple(contracting)} are not distinct axes of a '
      f'rank-{ndim} weight.'
    )
  return dims


def as_matrix(w: jax.Array, contracting: Sequence[int]) -> jax.Array:
  """The weight as [d_in, d_out]: contraction dims first, each group flat.

  Both groups keep the weight's own axis order (the contraction dims are
  sorted, whatever order the dot lists them in).

  Example:
    >>> as_matrix(jnp.zeros((2, 3, 4)), (2,)).shape
    (4, 6)
  """
  dims = _normalize(contracting, w.ndim)
  rest = tuple(d for d in range(w.ndim) if d not in dims)
  d_in = math.prod(w.shape[d] for d in dims)
  return jnp.transpose(w, dims + rest).reshape(d_in, -1)


def from_matrix(
  w2: jax.Array, contracting: Sequence[int], shape: Sequence[int]
) -> jax.Array:
  """Inverse of `as_matrix` for a weight of `shape`.

  Example:
    >>> w = jnp.arange(24.).reshape(2, 3, 4)
    >>> bool((from_matrix(as_matrix(w, (0, 2)), (0, 2), w.shape) == w).all())
    True
  """
  shape = tuple(shape)
  dims = _normalize(contracting, len(shape))
  rest = tuple(d for d in range(len(shape)) if d not in dims)
  order = dims + rest
  w = w2.reshape(tuple(shape[d] for d in order))
  return jnp.transpose(w, tuple(order.index(d) for d in range(len(shape))))


@jax.jit
def output_error(dw2: jax.Array, xtx: jax.Array) -> jax.Array:
  """tr(dW^T xtx dW) = ||X dW||_F^2 for a [d_in, d_out] weight change."""
  dw = dw2.astype(jnp.float32)
  hp = jax.lax.Precision.HIGHEST
  return jnp.sum(dw * jnp.matmul(xtx, dw, precision=hp))


def relative_error(dw2: jax.Array, w2: jax.Array, xtx: jax.Array) -> float:
  """tr(dW^T xtx dW) / tr(W^T xtx W): the layer's relative output error.

  NaN when it is undefined: the denominator is 0 (no nonzero input or an
  all-zero weight) or not finite (a non-finite input or weight), so a
  report never shows a perfect 0.0 it did not measure.

  Example:
    >>> w = jnp.ones((2, 1))
    >>> relative_error(0.5 * w, w, jnp.eye(2))
    0.25
    >>> relative_error(0.5 * w, w, jnp.zeros((2, 2)))
    nan
  """
  den = float(output_error(w2, xtx))
  if not (math.isfinite(den) and den > 0):
    return math.nan
  return float(output_error(dw2, xtx)) / den
