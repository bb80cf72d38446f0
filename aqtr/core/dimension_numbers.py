"""Axes bookkeeping: canonical operand layouts and dot dimension numbers.

Every quantized dot runs on canonical 3-D operands. An operand with batch
axes `b`, free (remaining) axes `f` and contraction axes `c` is brought to

  'fk': [B, F, K] = x.transpose(b + f + c).reshape(prod b, prod f, prod c)
  'kf': [B, K, F] = x.transpose(b + c + f).reshape(prod b, prod c, prod f)

On XLA:CPU an int8 dot takes the fast kernel only when its lhs contracts its
last axis, so the lhs of every dot is 'fk' and the rhs is either form. The
dot output `[B, M, N]` is a plain reshape of `lax.dot_general`'s output
layout `[batch..., lhs free..., rhs free...]`.

Example:
  >>> lay = OperandLayout(shape=(4, 3, 5), batch=(), contract=(1,))
  >>> lay.canonical_shape('fk')
  (1, 20, 3)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax

DimensionNumbers = tuple[
  tuple[tuple[int, ...], tuple[int, ...]],
  tuple[tuple[int, ...], tuple[int, ...]],
]


@dataclasses.dataclass(frozen=True)
class OperandLayout:
  """Where the batch, free and contraction axes of one operand are.

  Attributes:
    shape: the operand's shape.
    batch: batch axes, in dot order.
    contract: contraction axes, in dot order.
  """

  shape: tuple[int, ...]
  batch: tuple[int, ...] = ()
  contract: tuple[int, ...] = ()

  @property
  def free(self) -> tuple[int, ...]:
    used = set(self.batch) | set(self.contract)
    return tuple(a for a in range(len(self.shape)) if a not in used)

  def _size(self, axes: Sequence[int]) -> int:
    return math.prod(self.shape[a] for a in axes)

  @property
  def b(self) -> int:
    return self._size(self.batch)

  @property
  def f(self) -> int:
    return self._size(self.free)

  @property
  def k(self) -> int:
    return self._size(self.contract)

  def perm(self, form: str) -> tuple[int, ...]:
    if form == 'fk':
      return self.batch + self.free + self.contract
    if form == 'kf':
      return self.batch + self.contract + self.free
    raise ValueError(f"form must be 'fk' or 'kf', got {form!r}")

  def canonical_shape(self, form: str) -> tuple[int, int, int]:
    return (
      (self.b, self.f, self.k) if form == 'fk' else (self.b, self.k, self.f)
    )

  def natural_form(self) -> str:
    """'kf' when the contraction axes already precede the free axes."""
    kf = self.perm('kf')
    return 'kf' if kf == tuple(sorted(kf)) and self.free else 'fk'

  def to_canonical(self, x: jax.Array, form: str) -> jax.Array:
    perm = self.perm(form)
    if perm != tuple(range(len(perm))):
      x = x.transpose(perm)
    return x.reshape(self.canonical_shape(form))

  def from_canonical(self, x3: jax.Array, form: str) -> jax.Array:
    perm = self.perm(form)
    x = x3.reshape(tuple(self.shape[a] for a in perm))
    if perm != tuple(range(len(perm))):
      x = x.transpose(np.argsort(perm))
    return x


def normalize_axes(value, rank: int, field: str) -> tuple[int, ...]:
  """`value` as non-negative axes of a rank-`rank` operand, validated.

  Raises:
    ValueError: naming `field` when an axis is out of range or repeated.
  """
  try:
    axes = tuple(int(a) for a in value)
  except TypeError:
    raise ValueError(
      f'{field} must be a sequence of ints, got {value!r}.'
    ) from None
  out = []
  for a in axes:
    if not -rank <= a < rank:
      raise ValueError(
        f'{field} has axis {a}, out of range for an operand of rank {rank} '
        f'(allowed {-rank}..{rank - 1}).'
      )
    out.append(a % rank)
  if len(set(out)) != len(out):
    raise ValueError(f'{field} repeats an axis: {value!r}.')
  return tuple(out)


def normalize(
  lhs_shape: Sequence[int],
  rhs_shape: Sequence[int],
  dimension_numbers,
) -> DimensionNumbers:
  """Validates `dimension_numbers` for the shapes; returns them normalized.

  Raises:
    ValueError: naming the offending field and the allowed values.
  """
  try:
    (lc, rc), (lb, rb) = dimension_numbers
  except (TypeError, ValueError):
    raise ValueError(
      'dimension_numbers must be ((lhs_contracting, rhs_contracting), '
      f'(lhs_batch, rhs_batch)), got {dimension_numbers!r}.'
    ) from None
  nl, nr = len(lhs_shape), len(rhs_shape)
  lc = normalize_axes(lc, nl, 'lhs_contracting_dimensions')
  rc = normalize_axes(rc, nr, 'rhs_contracting_dimensions')
  lb = normalize_axes(lb, nl, 'lhs_batch_dimensions')
  rb = normalize_axes(rb, nr, 'rhs_batch_dimensions')
  if len(lc) != len(rc):
    raise ValueError(
      f'lhs_contracting_dimensions {lc} and rhs_contracting_dimensions {rc} '
      'must have the same length.'
    )
  if len(lb) != len(rb):
    raise ValueError(
      f'lhs_batch_dimensions {lb} and rhs_batch_dimensions {rb} must have '
      'the same length.'
    )
  if set(lc) & set(lb) or set(rc) & set(rb):
    raise ValueError('an axis cannot be both a batch and a contraction axis.')
  for name, la, ra in (('contracting', lc, rc), ('batch', lb, rb)):
    for i, j in zip(la, ra, strict=True):
      if lhs_shape[i] != rhs_shape[j]:
        raise ValueError(
          f'{name} dimensions do not match: lhs axis {i} has size '
          f'{lhs_shape[i]}, rhs axis {j} has size {rhs_shape[j]} '
          f'(lhs shape {tuple(lhs_shape)}, rhs shape {tuple(rhs_shape)}).'
        )
  return (lc, rc), (lb, rb)


@dataclasses.dataclass(frozen=True)
class DotLayout:
  """The layouts of both operands and the output of one dot_general."""

  lhs: OperandLayout
  rhs: OperandLayout

  @classmethod
  def create(cls, lhs_shape, rhs_shape, dimension_numbers) -> DotLayout:
    (lc, rc), (lb, rb) = normalize(lhs_shape, rhs_shape, dimension_numbers)
    return cls(
      lhs=OperandLayout(tuple(lhs_shape), lb, lc),
      rhs=OperandLayout(tuple(rhs_shape), rb, rc),
    )

  @property
  def out_shape(self) -> tuple[int, ...]:
    s = self.lhs.shape
    r = self.rhs.shape
    return (
      tuple(s[a] for a in self.lhs.batch)
      + tuple(s[a] for a in self.lhs.free)
      + tuple(r[a] for a in self.rhs.free)
    )

  @property
  def dimension_numbers(self) -> DimensionNumbers:
    """The normalized ((lhs, rhs) contracting, (lhs, rhs) batch) axes."""
    return (
      (self.lhs.contract, self.rhs.contract),
      (self.lhs.batch, self.rhs.batch),
    )


# The ragged (grouped, mixture-of-experts) dot of `aqtr.ragged_dot`, as
# `lax.ragged_dot` runs it: L [M, K] . R [G, K, N] -> [M, N], the rows of L
# split into G consecutive groups by `group_sizes`. In the plan the group
# axis G is a batch axis of R whose segments of L's rows come from the
# group sizes: L is [1, M, K] ('fk'), R [G, K, N] ('kf').
RAGGED = lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((1,), (1,)), ((), ())),
  lhs_ragged_dimensions=[0],
  rhs_group_dimensions=[0],
)


def is_ragged(dimension_numbers) -> bool:
  """Whether `dimension_numbers` are a ragged dot's (`RAGGED`)."""
  return isinstance(dimension_numbers, lax.RaggedDotDimensionNumbers)


def ragged_layout(lhs_shape, rhs_shape, dimension_numbers) -> DotLayout:
  """The layout of the ragged dot [M, K] . [G, K, N] (`RAGGED` only).

  Example:
    >>> ragged_layout((6, 4), (3, 4, 5), RAGGED).rhs.canonical_shape('kf')
    (3, 4, 5)
  """
  dn = dimension_numbers
  same = (
    tuple(map(tuple, dn.dot_dimension_numbers[0])),
    tuple(map(tuple, dn.dot_dimension_numbers[1])),
    tuple(dn.lhs_ragged_dimensions),
    tuple(dn.rhs_group_dimensions),
  ) == ((((1,), (1,))), ((), ()), (0,), (0,))
  if not same:
    raise ValueError(
      f'ragged dimension numbers {dn} are not supported; allowed: '
      'aqtr.core.dimension_numbers.RAGGED (lhs [M, K] ragged along M, rhs '
      '[G, K, N] grouped along G).'
    )
  if len(lhs_shape) != 2 or len(rhs_shape) != 3:
    raise ValueError(
      f'a ragged dot takes lhs [M, K] and rhs [G, K, N], got shapes '
      f'{tuple(lhs_shape)} and {tuple(rhs_shape)}.'
    )
  if lhs_shape[1] != rhs_shape[1]:
    raise ValueError(
      f'ragged_dot: lhs.shape[1] = {lhs_shape[1]} must equal rhs.shape[1] '
      f'= {rhs_shape[1]} (the contraction K).'
    )
  return DotLayout(
    lhs=OperandLayout(tuple(lhs_shape), (), (1,)),
    rhs=OperandLayout(tuple(rhs_shape), (0,), (1,)),
  )


@dataclasses.dataclass(frozen=True)
class Broadcast:
  """A dot whose size-1 batch axes broadcast, as a dot that needs none.

  `jnp.einsum` (and `jnp.matmul`) broadcast a batch axis of size 1 on one
  operand against size n on the other, e.g. multi-query attention's
  'btnd,bsnd->bnts' with one key head; `lax.dot_general` refuses it. The
  size-1 axis is squeezed from its operand and the other operand's axis
  becomes a free axis: the same values, nothing materialized n times, and
  a per-channel scale stays per (free) index. `perm` puts the dot's output
  back in `lax.dot_general`'s layout [batch..., lhs free..., rhs free...].

  Attributes:
    lhs_squeeze, rhs_squeeze: the size-1 axes squeezed from each operand.
    dimension_numbers: the rewritten dot's dimension numbers.
    perm: the output permutation (None: identity).

  Example:
    >>> b = Broadcast.of((2, 8, 4, 16), (2, 8, 1, 16),
    ...                  (((3,), (3,)), ((0, 2), (0, 2))))
    >>> b.rhs_squeeze, b.dimension_numbers, b.perm
    ((2,), (((3,), (2,)), ((0,), (0,))), (0, 2, 1, 3))
  """

  lhs_squeeze: tuple[int, ...]
  rhs_squeeze: tuple[int, ...]
  dimension_numbers: DimensionNumbers
  perm: tuple[int, ...] | None

  @classmethod
  def of(cls, lhs_shape, rhs_shape, dimension_numbers) -> Broadcast | None:
    """The rewrite of a broadcasting dot (None: no batch axis broadcasts)."""
    try:
      (lc, rc), (lb, rb) = dimension_numbers
      lc, lb = (normalize_axes(a, len(lhs_shape), 'lhs') for a in (lc, lb))
      rc, rb = (normalize_axes(a, len(rhs_shape), 'rhs') for a in (rc, rb))
    except (TypeError, ValueError):
      return None  # `normalize` names the error.
    if len(lb) != len(rb):
      return None
    lsq, rsq = [], []
    for i, j in zip(lb, rb, strict=True):
      n, m = lhs_shape[i], rhs_shape[j]
      if n != m and m == 1:
        rsq.append(j)
      elif n != m and n == 1:
        lsq.append(i)
    if not lsq and not rsq:
      return None
    nl, nr = len(lhs_shape), len(rhs_shape)
    # Output tags before: batch pair k, lhs free axis a, rhs free axis a.
    want = [('b', k) for k in range(len(lb))]
    want += [('l', a) for a in range(nl) if a not in lb and a not in lc]
    want += [('r', a) for a in range(nr) if a not in rb and a not in rc]
    keep = [
      k
      for k, (i, j) in enumerate(zip(lb, rb, strict=True))
      if i not in lsq and j not in rsq
    ]

    got = [('b', k) for k in keep]
    for side, n, batch, contract, sq in (
      ('l', nl, lb, lc, lsq),
      ('r', nr, rb, rc, rsq),
    ):
      kept = {batch[k] for k in keep}
      for a in range(n):
        if a in sq or a in contract or a in kept:
          continue
        got.append(('b', batch.index(a)) if a in batch else (side, a))
    perm = tuple(got.index(t) for t in want)

    def shift(axes, sq):
      return tuple(a - sum(s < a for s in sq) for a in axes)

    dn = (
      (shift(lc, lsq), shift(rc, rsq)),
      (shift([lb[k] for k in keep], lsq), shift([rb[k] for k in keep], rsq)),
    )
    ident = perm == tuple(range(len(perm)))
    return cls(tuple(lsq), tuple(rsq), dn, None if ident else perm)
