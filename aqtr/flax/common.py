"""What the linen and nnx adapters share: names, op plumbing, size report.

Both adapters run every quantized op as one `aqtr.dot_general` through
`aqtr.freezers.lifecycle` (einsum: dimension numbers + a transpose of the
output; conv: im2col `aqtr.core.conv.ConvPlan`), so one set of freezer
semantics serves Dense, DenseGeneral, Einsum and Conv alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from aqtr.core import einsum as einsum_lib
from aqtr.core.config import DotGeneralConfig
from aqtr.freezers import lifecycle

# Variable collections (linen) / Variable types' names (nnx).
FROZEN = 'aqtr'
STATS = 'aqtr_stats'
# The default rng stream of stochastic rounding.
RNG = 'quant'


def is_float(config: DotGeneralConfig | None) -> bool:
  """True when the op is the plain lax / jnp one (no config, all float)."""
  return config is None or config.is_float


def einsum_plan(subscripts: str, lhs_ndim: int, rhs_ndim: int):
  """(dimension numbers, output permutation or None) of a 2-operand einsum.

  `aqtr.einsum` computes `dot_general(lhs, rhs, dn).transpose(perm)`; the
  adapters do the same so the dot can be frozen.

  Example:
    >>> einsum_plan('btd,dhf->bthf', 3, 3)
    ((((2,), (0,)), ((), ())), None)
  """
  ls, rs, os = einsum_lib.parse(subscripts, lhs_ndim, rhs_ndim)
  dn = einsum_lib.dimension_numbers(subscripts, lhs_ndim, rhs_ndim)
  batch = [c for c in ls if c in rs and c in os]
  got = (
    ''.join(batch)
    + ''.join(c for c in ls if c not in rs)
    + ''.join(c for c in rs if c not in ls)
  )
  perm = None if got == os else tuple(got.index(c) for c in os)
  return dn, perm


def constrain(out: jax.Array, out_sharding) -> jax.Array:
  """Applies an op's `out_sharding=` (as nnx passes it) to its output."""
  if out_sharding is None:
    return out
  return jax.lax.with_sharding_constraint(out, out_sharding)


def check_mode(mode) -> None:
  if not isinstance(mode, lifecycle.Mode):
    raise TypeError(
      f'mode must be an aqtr.Mode (TRAIN, CALIBRATE, CONVERT, SERVE), got '
      f'{mode!r}.'
    )


@dataclasses.dataclass(frozen=True)
class Report:
  """Sizes of a conversion, in bytes (int4 counted packed, 2 per byte).

  Attributes:
    float_kernel_bytes: the float kernels removed from the tree.
    frozen_kernel_bytes: their frozen qvalues and scales.
    serving_bytes: everything in the serving tree.
  """

  float_kernel_bytes: int
  frozen_kernel_bytes: int
  serving_bytes: int

  @property
  def kernel_ratio(self) -> float:
    return self.frozen_kernel_bytes / max(self.float_kernel_bytes, 1)

  def __str__(self) -> str:
    return (
      f'kernels: {self.float_kernel_bytes} B float -> '
      f'{self.frozen_kernel_bytes} B frozen ({self.kernel_ratio:.3f}x); '
      f'serving tree: {self.serving_bytes} B'
    )


def removed_bytes(shape, dtype) -> int:
  return lifecycle.nbytes(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)))


nbytes = lifecycle.nbytes
