"""Per-platform lowering of the engine: one traced function, a form per chip.

XLA:CPU and XLA:GPU (cuBLASLt) run a quantized dot fast in different forms:

  CPU  an integer dot is fast when its lhs contracts its last axis; XLA
       drops `optimization_barrier`s before fusion, so a conditional it
       cannot fold, both branches the identity, makes an array a buffer of
       its own (`boundary.fence`: fusion boundaries, the transposed int8
       copy of the forward lhs); a one-row integer dot gets
       a zero row; the operands of a low-precision dot are pinned by a
       barrier; tiles are summed as chained adds (XLA:CPU reduces a
       non-minor axis slowly).
  GPU  cuBLASLt's int8 and fp8 GEMMs want both operands contracting their
       minor axis ("TN"): the quantized (1-byte) operand is transposed,
       never a float one; no fence or barrier stands between a quantization
       and its GEMM; tiles are summed by one reduction, and the per-tile
       dots of emulated block formats (MX, NVFP4, sub-channel int8) become
       one dot of the dequantized operands.

`per_platform` (in `prims`, so that a quantizer family such as a
calibration may choose a form too) chooses between the two with
`lax.platform_dependent`:
both forms are traced, and lowering keeps the one of the platform it
lowers for. So one jitted function serves CPU and GPU, and
`jax.export(f, platforms=('cuda',))` on a CPU-only machine emits the GPU
form (tests/core/test_lowering.py checks that StableHLO). TPU and ROCm
take the GPU form. Under a mesh the fences are not used (a fence's
branch index, read from a sharded array, costs a collective), and tiles are
summed by one reduction (the tile axis may be split: one all-reduce).

`sub_jaxprs` reads a traced program as one platform's lowering would,
and `is_dot` tells its dots (for tests and benchmarks that count the dots
in a jaxpr).

Internal API (for `boundary.py`, `passes.py`, `geometry.py`):
`per_platform`, `loops_allowed`, `tn_dot`, `tile_sum`, and the dtype
dispatch of the low-precision dot: `dot_kind`, `is_int`, `is_fp8`,
`low_precision`, `batched_dot`.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax
from jax.sharding import get_abstract_mesh

from aqtr.core import prims
from aqtr.core.config import DotGeneralRaw
from aqtr.core.prims import per_platform


def sub_jaxprs(eqn, platform: str = 'cpu') -> list:
  """The sub-jaxprs (open) of jaxpr equation `eqn`; of a `per_platform`
  cond, only the branch lowered for `platform` ('cpu', 'cuda', ...).

  Example:
    >>> f = lambda x: per_platform(x, cpu=jnp.sin, gpu=jnp.cos)
    >>> eqns = jax.make_jaxpr(f)(1.0).eqns
    >>> (eqn,) = [e for e in eqns if e.primitive.name == 'cond']
    >>> [e.primitive.name for e in sub_jaxprs(eqn, 'cuda')[0].eqns]
    ['cos']
  """
  names = eqn.params.get('branches_platforms')
  if eqn.primitive.name != 'cond' or not names:
    return list(jex_core.jaxprs_in_params(eqn.params))
  for branch, kept in zip(eqn.params['branches'], names, strict=True):
    if kept is None or platform in kept:
      return [branch.jaxpr]
  raise ValueError(f'no branch of this cond is lowered for {platform!r}')


NATIVE_DOT = 'aqtr_int_rows_dot'  # `native_dot.rows_dot`'s primitive.


def is_dot(eqn) -> bool:
  """Whether jaxpr equation `eqn` is a dot: a `dot_general`, or the native
  few-row integer dot (`aqtr.core.native_dot`; operands int8 and int8 /
  int4, result int32: XLA's int8 dot's bits) that stands for one.

  Example:
    >>> x = jnp.ones((2, 2))
    >>> [is_dot(e) for e in jax.make_jaxpr(jnp.matmul)(x, x).eqns]
    [True]
  """
  return eqn.primitive.name in ('dot_general', NATIVE_DOT)


def loops_allowed(*trees) -> bool:
  """Whether the CPU form may use its fences (`boundary.fence`) and chained
  tile sums: outside a mesh, and no array of `trees` sharded by its type
  (an explicitly sharded array under `jit` without `jax.set_mesh`: a
  fence's branch index slices its first value, which a sharded type
  refuses).

  Example:
    >>> loops_allowed(jnp.ones(2))  # No mesh set, unsharded.
    True
  """
  if not get_abstract_mesh().empty:
    return False
  for x in jax.tree.leaves(trees):
    spec = getattr(jax.typeof(x).sharding, 'spec', None) or ()
    if any(p is not None for p in spec):
      return False
  return True


def tn_dot(qa: jax.Array, qb: jax.Array, b_contract: int, preferred):
  """[B, F_a, K] . qb -> [B, F_a, F_b], both operands contracting their
  minor axis: a 'kf' `qb` ([B, K, F_b], `b_contract` 1) is transposed
  first (a 1-byte array where quantized). The GPU form of a canonical dot.

  Example:
    >>> a, b = jnp.ones((1, 2, 3), jnp.int8), jnp.ones((1, 3, 4), jnp.int8)
    >>> tn_dot(a, b, 1, jnp.int32).shape
    (1, 2, 4)
  """
  if b_contract == 1:
    qb = jnp.swapaxes(qb, 1, 2)
  return prims.dot_general(
    qa, qb, (((2,), (2,)), ((0,), (0,))), preferred_element_type=preferred
  )


_FAN = 32  # Slices one unrolled add sums (bounds the program's size).


def _chained_sum(x: jax.Array) -> jax.Array:
  while x.shape[1] > _FAN:
    n = x.shape[1]
    m = -(-n // _FAN)
    if m * _FAN > n:
      pad = jnp.zeros((x.shape[0], m * _FAN - n, *x.shape[2:]), x.dtype)
      x = jnp.concatenate([x, pad], axis=1)
    x = x.reshape(x.shape[0], m, _FAN, *x.shape[2:])
    x = functools.reduce(operator.add, [x[:, :, i] for i in range(_FAN)])
  return functools.reduce(operator.add, [x[:, i] for i in range(x.shape[1])])


def tile_sum(x: jax.Array) -> jax.Array:
  """`x.sum(axis=1)` over tiles.

  Lowered for CPU outside a mesh: chained adds of slices (`_FAN` at a
  time, zero-padded chunks): XLA:CPU reduces a non-minor axis element by
  element, 10-200x slower (benchmarks/subchannel_sum.py); the order
  differs from `sum`'s in the last bits. Elsewhere, and under a mesh (the
  tile axis may be split: one all-reduce), `sum`.

  Example:
    >>> tile_sum(jnp.ones((1, 3, 2, 2))).tolist()
    [[[3.0, 3.0], [3.0, 3.0]]]
  """
  if x.shape[1] == 1:
    return x[:, 0]
  if not loops_allowed():
    return x.sum(axis=1)
  return per_platform(x, cpu=_chained_sum, gpu=lambda x: x.sum(axis=1))


def is_int(dtype) -> bool:
  """Whether `dtype` is an integer type."""
  return jnp.issubdtype(dtype, jnp.integer)


def is_fp8(dtype) -> bool:
  """Whether `dtype` is a 1-byte float (fp8) type."""
  return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def dot_kind(da, db, raw: DotGeneralRaw) -> str:
  """'int' (int x int -> int32), 'fp8' (fp8 x fp8 -> f32) or 'float'.

  Example:
    >>> from aqtr.core.config import DotGeneralRaw
    >>> dot_kind(jnp.int8, jnp.int8, DotGeneralRaw())
    'int'
  """
  if is_int(da) and is_int(db) and raw.accumulator != 'float32':
    return 'int'
  if is_fp8(da) and is_fp8(db) and raw.accumulator != 'int32':
    return 'fp8'
  return 'float'


def low_precision(qa, qb, dot, raw: DotGeneralRaw, precision, zero=None):
  """`dot(qa, qb, preferred, precision)` in the operands' own types -> f32.

  The one dtype dispatch of the engine's dots: int x int runs an
  int32-accumulating dot, fp8 x fp8 an f32-accumulating one (lowered for
  CPU on operands pinned by an optimization barrier, so XLA keeps the
  low-precision dot; for GPU nothing stands between the quantization and
  the GEMM), anything else a float dot in the operands' float type.
  `zero` (affine operands) is a pair of functions: `subtract(qa, qb)`
  before a float dot, `correct(out, qa, qb)` of an int32 result (exact
  integer corrections, `zero_point.py`).

  Example:
    >>> from aqtr.core.config import DotGeneralRaw
    >>> q = jnp.ones((1, 2, 3), jnp.int8)
    >>> low_precision(q, q, batched_dot(2), DotGeneralRaw(), None).tolist()
    [[[3.0, 3.0], [3.0, 3.0]]]
  """
  kind = dot_kind(qa.dtype, qb.dtype, raw)
  if kind == 'float':
    floats = [d for d in (qa.dtype, qb.dtype) if not (is_int(d) or is_fp8(d))]
    ct = jnp.result_type(*floats) if floats else jnp.float32
    qa, qb = qa.astype(ct), qb.astype(ct)
    if zero is not None:  # Subtracted in float: exact for integer values.
      qa, qb = zero[0](qa, qb)
    return dot(qa, qb, jnp.float32, precision)
  qa, qb = per_platform(
    qa, qb, cpu=lambda *q: lax.optimization_barrier(q), gpu=lambda *q: q
  )
  if kind == 'fp8':
    return dot(qa, qb, jnp.float32, None)
  out = dot(qa, qb, jnp.int32, None)
  if zero is not None:
    out = zero[1](out, qa, qb)
  return out.astype(jnp.float32)


def batched_dot(b_contract: int):
  """The canonical dot [B, F_a, K] . [B, ., .] contracting `b_contract`,
  as `dot(qa, qb, preferred, precision)`."""
  dn = (((2,), (b_contract,)), ((0,), (0,)))

  def dot(qa, qb, preferred, precision):
    return prims.dot_general(
      qa, qb, dn, precision=precision, preferred_element_type=preferred
    )

  return dot
