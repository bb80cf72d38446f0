"""The `transforms` registry: orthogonal maps along a dot's contraction.

A transform rotates both operands of a dot along the contracted axis
before they are quantized, so that exact arithmetic leaves the product
unchanged while outliers are spread over a block (arXiv 2509.25149,
arXiv 2505.14669).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax

from aqtr.core.registry import Registry

__all__ = [
  'Transform',
  'check_axis',
  'get',
  'names',
  'register',
  'registry',
]


def check_axis(axis, ndim: int, operand: str = 'operand') -> int:
  """`axis` in 0..ndim-1 (negative counts from the end); one line if not.

  Example:
    >>> check_axis(-1, 2)
    1
  """
  if isinstance(axis, bool) or not isinstance(axis, int):
    raise TypeError(f'{operand}: axis must be an int, got {axis!r}.')
  if not -ndim <= axis < ndim:
    raise ValueError(
      f'{operand}: axis={axis} is out of range for an array of rank {ndim} '
      f'(use -{ndim}..{ndim - 1}).'
    )
  return axis % ndim


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transform(abc.ABC):
  """Base class of the `transforms` registry: an orthogonal map R.

  Math. Along the contracted axis (size K) every vector is mapped
  `v -> v R` with R a K x K orthogonal matrix (`R R^T = I`). For a dot
  `out = x w` contracting K, both operands are mapped along K: the lhs
  rows `x' = x R` and the rhs columns `w'[:, j]^T = w[:, j]^T R`, i.e.
  `w' = R^T w`, so `x' w' = x R R^T w = x w` in exact arithmetic. The
  same holds for any pass of the engine: the wgrad GEMM `dW = x^T g`
  contracts the tokens, and `(R^T x)^T (R^T g) = x^T g`. Quantizing the
  rotated operands instead of the raw ones spreads an outlier of one
  element over its block. `inverse` maps back, `v -> v R^T`.

  Both operands of one dot must use the same R: a transform whose R is
  drawn at call time (`needs_key`) must get the same key for both.

  Subclasses are frozen kw-only dataclasses; validate in `__post_init__`.
  """

  # False only for the identity ('none'): the engine skips it.
  transforms: ClassVar[bool] = True

  @property
  def needs_key(self) -> bool:
    """Whether `apply` draws R from a PRNG key (then `key` is required)."""
    return False

  def check_size(self, k: int, operand: str = 'operand') -> None:
    """Raises ValueError when R does not fit a contraction of size `k`.

    Args:
      k: the (flattened) contraction size.
      operand: the operand's name for the message (e.g. 'drhs.lhs').
    """
    del k, operand

  @abc.abstractmethod
  def apply(
    self,
    x: jax.Array,
    axis: int,
    key: jax.Array | None = None,
    operand: str = 'operand',
  ) -> jax.Array:
    """`x` with every vector along `axis` mapped `v -> v R`.

    Args:
      x: a float array (any rank); the result is float32 or wider.
      axis: the contracted axis.
      key: a typed PRNG key when `needs_key`; the same for both operands.
      operand: the operand's name for error messages.
    """

  @abc.abstractmethod
  def inverse(
    self,
    x: jax.Array,
    axis: int,
    key: jax.Array | None = None,
    operand: str = 'operand',
  ) -> jax.Array:
    """`x` with every vector along `axis` mapped `v -> v R^T` (undoes
    `apply` with the same key)."""


registry: Registry = Registry('transforms', Transform)
register = registry.register
get = registry.get
names = registry.names
