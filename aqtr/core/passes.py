"""Operands of a canonical quantized dot, and the one contraction core.

An operand is a canonical 3-D array, [B, F, K] ('fk') or [B, K, F] ('kf'),
see `dimension_numbers.py`. Tiles split K into T blocks of t elements; a
quantized operand is kept in the tiled view [B, T, F, t] / [B, T, t, F]
(`qtensor.to_view`) with a scale broadcastable to it. `contract` runs the
low-precision dot (int8 x int8 -> int32, fp8 x fp8 -> f32; `low_precision`
is the dtype dispatch, shared with `geometry.py`) and applies both scales:

  out[b, f_a, f_b] = sum_j (q_a[b, j, f_a, :] . q_b[b, j, f_b, :])
                     * s_a[b, j, f_a] * s_b[b, j, f_b]

Internal API (for `forward.py`, `backward.py`, `geometry.py`): the names
below without a leading underscore.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core import native_dot, prims
from aqtr.core.boundary import (
  copy_index,
  copyable,
  fence,
  first_index,
  swap_last,
)
from aqtr.core.config import DotGeneralRaw, TensorConfig
from aqtr.core.dimension_numbers import OperandLayout
from aqtr.core.lowering import (
  batched_dot,
  dot_kind,
  is_fp8,
  is_int,
  loops_allowed,
  low_precision,
  per_platform,
  tile_sum,
  tn_dot,
)
from aqtr.core.qtensor import from_view, to_view
from aqtr.core.quantizer import quantize_view
from aqtr.core.slots import Slot
from aqtr.core.zero_point import (
  as_int8,
  int_corrections,
  per_row,
  subtract_rows,
)


def flip(form: str) -> str:
  """'fk' <-> 'kf'."""
  return 'kf' if form == 'fk' else 'fk'


def k_axis(form: str) -> int:
  """The contraction axis of a canonical 3-D operand in `form`."""
  return 2 if form == 'fk' else 1


@dataclasses.dataclass(frozen=True)
class Operand:
  """One operand of a canonical dot, before quantization.

  Attributes:
    x: canonical 3-D array, [B, F, K] ('fk') or [B, K, F] ('kf').
    form: 'fk' or 'kf'.
    config: how to quantize it, or None when `x` enters the dot as it is
      (float, or already quantized with its scale folded elsewhere).
    noise: rounding noise shaped like `x`, or None.
    dot_dtype: the dtype an unquantized `x` enters the dot in (None: its
      own); e.g. int4 values reused from the forward pass are widened.
    state: its calibration state {'stats', 'learned'}, or None.
  """

  x: jax.Array
  form: str
  config: TensorConfig | None = None
  noise: jax.Array | None = None
  dot_dtype: jnp.dtype | None = None
  state: dict | None = None


def with_transposed_copy(
  values: jax.Array, scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """`values` [B, T, X, Y], and as [B, T, Y, X] written by a plain copy.

  XLA:CPU fuses an elementwise producer (here the quantization) into a
  transposing consumer: one loop of strided scalar loads from the float
  input, several times the cost of copying the 1-byte result; and it drops
  `optimization_barrier`s before fusion. A conditional is a fusion
  boundary it keeps (`boundary.fence`: a branch index it cannot fold, from
  the first value of `scale` if given, else of `values`' bits): it makes
  `values` a buffer of their own that the transpose then copies, and that
  every other consumer reads (no recomputation). The forward pass writes
  its copy in its fusion boundary instead (`boundary.fusion_boundary`).
  Lowered for GPU, a plain transpose (no fence; `lowering.py`).
  """
  if not copyable(values) or not loops_allowed(values):
    return values, swap_last(values)
  from_scale = scale is not None and scale.size and loops_allowed(scale)

  def index(values):  # From the scale, its kernel quantizes nothing.
    return first_index(scale) if from_scale else copy_index(values)

  def cpu(values):
    values = fence(values, index)
    return values, swap_last(values)

  return per_platform(values, cpu=cpu, gpu=lambda v: (v, swap_last(v)))


@dataclasses.dataclass(frozen=True)
class QuantizedOperand:
  """An operand in the tiled view, ready for `contract`.

  Attributes:
    values: q in the view [B, T, F, t] ('fk') or [B, T, t, F] ('kf').
    scale: s broadcastable to `values` (None: not scaled).
    mask: the straight-through gradient mask in the view, or None.
    form: 'fk' or 'kf' (static).
    dot_dtype: the dtype `values` enter the dot in (static; the numerics'
      `dot_dtype`, e.g. int8 for int4 storage).
    zero_point: z shaped like `scale` for affine numerics (x ~ s (q - z)),
      else None (see `zero_point.py`).
    state: the calibration's new state, or None (stateless).
    learned: {name: d xhat / d param} in the view (learned calibrations).
    packed: int4 'fk' values as stored, two a byte (QTensor.packed), or None.
  """

  values: jax.Array
  scale: jax.Array | None
  mask: jax.Array | None
  form: str
  dot_dtype: jnp.dtype
  zero_point: jax.Array | None = None
  state: dict | None = None
  learned: dict | None = None
  packed: jax.Array | None = None

  @property
  def n_tiles(self) -> int:
    return self.values.shape[1]

  def free_scale(self) -> jax.Array:
    """The scale per free index, [B|1, T|1, F] (scales are constant on t)."""
    return self.scale[..., 0] if self.form == 'fk' else self.scale[:, :, 0, :]

  def without_mask(self) -> QuantizedOperand:
    return dataclasses.replace(self, mask=None, state=None, learned=None)

  def with_transposed(
    self, copied: tuple[jax.Array, jax.Array] | None = None
  ) -> tuple[QuantizedOperand, QuantizedOperand]:
    """This operand, and the same in the other form (`with_transposed_copy`).

    Both read one buffer of values; use the first in place of `self`.
    `copied`: (values, values transposed) already written (by the forward
    pass's fusion boundary), else a fence of its own writes them.
    """
    values, values_t = copied or with_transposed_copy(self.values, self.scale)
    transposed = QuantizedOperand(
      values_t,
      swap_last(self.scale),
      swap_last(self.mask),
      flip(self.form),
      self.dot_dtype,
      swap_last(self.zero_point),
    )
    return dataclasses.replace(self, values=values), transposed

  def as_partner(self) -> Operand:
    """This operand as the partner of a backward dot, its scale folded away.

    In a backward dot the roles of the axes swap: the forward free axis F
    is contracted and the tile's t elements become free. With the tiles
    merged into the batch, [B, T, F, t] is the 'kf' operand [B*T, F, t] of
    that dot (and [B, T, t, F] the 'fk' operand [B*T, t, F]).
    """
    bsz, n = self.values.shape[:2]
    values, _ = as_int8(self.values, self.zero_point)
    x = values.reshape((bsz * n,) + values.shape[2:])
    return Operand(x, flip(self.form), dot_dtype=self.dot_dtype)

  def partner_zero_point(self) -> jax.Array | None:
    """The zero point of `as_partner()`'s values per row, [B*T, F], or None.

    The backward dot contracts F, so it is subtracted with
    `zero_point.reuse_term`.
    """
    _, z = as_int8(self.values, self.zero_point)
    return None if z is None else per_row(z, self.values.shape, self.form)

  def grad_mask(self, layout: OperandLayout) -> jax.Array | None:
    """The gradient mask in the operand's own layout, or None."""
    if self.mask is None:
      return None
    return layout.from_canonical(from_view(self.mask, self.form), self.form)

  def dequantized(self, layout: OperandLayout, dtype) -> jax.Array:
    """`(values - zero_point) * scale` in the operand's layout and `dtype`."""
    v = self.values.astype(jnp.float32)
    if self.zero_point is not None:
      v = v - self.zero_point
    v = v * self.scale
    return layout.from_canonical(from_view(v, self.form), self.form).astype(
      dtype
    )


jax.tree_util.register_dataclass(
  QuantizedOperand,
  data_fields='values scale mask zero_point state learned packed'.split(),
  meta_fields=['form', 'dot_dtype'],
)


def slot_keys(key: jax.Array | None) -> dict:
  """{Slot: key}: the forward operands' keys and each backward pass's key
  (under its gradient slot; its requantized residual uses `residual_key`
  of it). Empty without a key."""
  if key is None:
    return {}
  fwd, dlhs, drhs = jax.random.split(key, 3)
  fwd_lhs, fwd_rhs = jax.random.split(fwd, 2)
  return {
    Slot.FWD_LHS: fwd_lhs,
    Slot.FWD_RHS: fwd_rhs,
    Slot.DLHS_LHS: dlhs,
    Slot.DRHS_LHS: drhs,
  }


def residual_key(key: jax.Array | None) -> jax.Array | None:
  """The key of a backward pass's residual operand (its g uses `key`)."""
  return None if key is None else jax.random.split(key, 2)[1]


def transform_key(key: jax.Array | None) -> jax.Array | None:
  """The key a backward pass's transform draws its R from (one for both
  operands; independent of their rounding noise)."""
  return None if key is None else jax.random.fold_in(key, 1)


def rounding_noise(cfg: TensorConfig, key, shape) -> jax.Array | None:
  """Stochastic-rounding noise of `shape` for `cfg`, or None."""
  if key is None or not (cfg.quantized and cfg.rounding.stochastic):
    return None
  return cfg.rounding.noise(key, shape)


def canonical_noise(
  cfg: TensorConfig, key, layout: OperandLayout, form: str
) -> jax.Array | None:
  """Noise drawn in the operand's own layout, brought to canonical form."""
  noise = rounding_noise(cfg, key, layout.shape)
  return None if noise is None else layout.to_canonical(noise, form)


def quantize_tiled(op: Operand, tile: int | None) -> QuantizedOperand:
  """Brings `op` to the tiled view and quantizes it as its config says."""
  x4 = to_view(op.x, op.form, tile)
  if op.config is None or not op.config.quantized:
    dot_dtype = jnp.dtype(op.dot_dtype or x4.dtype)
    return QuantizedOperand(x4, None, None, op.form, dot_dtype)
  noise = None if op.noise is None else to_view(op.noise, op.form, tile)
  r = quantize_view(x4, op.config, op.form, noise, op.state)
  dot_dtype = jnp.dtype(op.config.numerics.dot_dtype)
  return QuantizedOperand(
    r.q, r.s, r.mask, op.form, dot_dtype, r.z, r.state, r.learned
  )


def _merged(va, vb, a: QuantizedOperand, b: QuantizedOperand, t: int):
  """The tiled views with their tiles merged into the batch (as the dot's
  types): [B*T, F_a, t] and [B*T, F_b, t] / [B*T, t, F_b]."""
  bsz, n = va.shape[:2]
  qa = va.reshape(bsz * n, va.shape[2], t).astype(a.dot_dtype)
  qb = vb.reshape((bsz * n,) + vb.shape[2:]).astype(b.dot_dtype)
  return qa, qb


def _zero_fns(za, zb, b_contract: int):
  """`low_precision`'s zero-point pair (None for symmetric operands)."""
  if za is None and zb is None:
    return None
  return (
    functools.partial(subtract_rows, za=za, zb=zb, b_contract=b_contract),
    functools.partial(int_corrections, za=za, zb=zb, b_contract=b_contract),
  )


def _int_corrected(out, qa, qb, za, zb, b_contract: int):
  """An integer dot's `out` with the zero points' exact corrections."""
  if za is None and zb is None or out.dtype != jnp.int32:
    return out
  return int_corrections(out, qa, qb, za=za, zb=zb, b_contract=b_contract)


def dense_tiles() -> bool:
  """Whether a float dot, or an fp8 dot of an emulated format, over tiles
  runs as one dot of dequantized operands (nf4 codes, int4 against float
  activations, MX / NVFP4 blocks, fp4 / fp6 held in fp8 containers:
  `Numerics.emulated`; train and serve alike).

  True outside a mesh context; under a mesh, and lowered for CPU for int8
  dots (XLA:CPU's int8 dots are native) and fp8 tiles of a recipe that
  accumulates per tile (DeepSeek-V3's blockwise fp8), the per-tile form
  (`tile_sum`) stays. Lowered for GPU those run dense too (`contract`).
  On CPU an mxfp8 forward at 1024^3 runs 6.4x faster dense than as 32 fp8
  dots per row and a tile sum (XLA:CPU emulates fp8).

  Example:
    >>> dense_tiles()  # No mesh set.
    True
  """
  return loops_allowed()


def dequantized(q: QuantizedOperand, dtype) -> jax.Array:
  """`(values - zero_point) * scale` of `q` (tiled view) as the canonical
  3-D operand [B, F, K] ('fk') or [B, K, F] ('kf') in `dtype`.

  Example:
    >>> s, v = jnp.array([2.0, 3.0]).reshape(1, 2, 1, 1), jnp.ones((1, 2, 1, 2))
    >>> q = QuantizedOperand(v, s, None, 'fk', v.dtype)
    >>> dequantized(q, v.dtype).tolist()
    [[[2.0, 2.0, 3.0, 3.0]]]
  """
  v = q.values.astype(dtype)
  if q.zero_point is not None:
    v = v - q.zero_point.astype(dtype)
  if q.scale is not None:
    v = v * q.scale.astype(dtype)
  return from_view(v, q.form)


def _dense_contract(a: QuantizedOperand, b: QuantizedOperand, precision):
  """One float dot of the dequantized operands -> [B, F_a, F_b] f32."""
  floats = [
    d for d in (a.dot_dtype, b.dot_dtype) if not (is_int(d) or is_fp8(d))
  ]
  dtype = jnp.result_type(*floats) if floats else jnp.float32
  for q in (a, b):
    if q.scale is not None or q.zero_point is not None:
      dtype = jnp.promote_types(dtype, jnp.float32)
  b_contract = 2 if b.form == 'fk' else 1
  return prims.dot_general(
    dequantized(a, dtype),
    dequantized(b, dtype),
    (((2,), (b_contract,)), ((0,), (0,))),
    precision=precision,
    preferred_element_type=jnp.float32,
  )


def contract(
  a: QuantizedOperand, b: QuantizedOperand, raw: DotGeneralRaw, precision
) -> jax.Array:
  """sum_tiles (q_a - z_a) . (q_b - z_b) * s_a * s_b -> [B, F_a, F_b] f32.

  `a` is 'fk' ([B, T, F_a, t]); `b` is either form. Zero points (affine
  numerics) are None for symmetric operands. A float dot over several
  tiles runs as one dot of the dequantized operands (`dense_tiles`).
  """
  bsz, n, fa, t = a.values.shape
  kind = dot_kind(a.dot_dtype, b.dot_dtype, raw)
  dense = n > 1 and dense_tiles()
  # Emulated fp8 operands: MX / NVFP4 blocks, fp4 / fp6 in fp8 containers.
  emulated = any(c.numerics.emulated for c in (raw.lhs, raw.rhs))
  if dense and (kind == 'float' or kind == 'fp8' and emulated):
    return _dense_contract(a, b, precision)
  if dense:  # int8 / fp8 tiles: one dense dot where lowered for GPU.
    return per_platform(
      a,
      b,
      cpu=lambda a, b: _tiled_contract(a, b, raw, precision),
      gpu=lambda a, b: _dense_contract(a, b, precision),
    )
  return _tiled_contract(a, b, raw, precision)


def _native_operands(va, codes_b, za, zb, kind: str, b_contract: int, t: int):
  """[B*T, F_a, t] int8 and [B*T, F_b, t] int8|int4 for the native
  few-row dot (`native_dot`), or None where XLA's dot runs: zero points,
  a 'kf' rhs, and what `native_dot.usable` refuses (rows, types, ...)."""
  if kind != 'int' or za is not None or zb is not None or b_contract != 2:
    return None
  qa = va.reshape(-1, va.shape[2], t)
  qb = codes_b.reshape(-1, *codes_b.shape[2:])  # [.., t / 2] when packed
  return (qa, qb) if native_dot.usable(qa, qb) else None


def _tiled_contract(a: QuantizedOperand, b: QuantizedOperand, raw, precision):
  """`contract` as one dot per tile, scaled, then summed over tiles."""
  bsz, n, fa, t = a.values.shape
  va, za = as_int8(a.values, a.zero_point)
  vb, zb = as_int8(b.values, b.zero_point)
  za = None if za is None else per_row(za, a.values.shape, a.form)
  zb = None if zb is None else per_row(zb, b.values.shape, b.form)
  kind = dot_kind(a.dot_dtype, b.dot_dtype, raw)
  b_contract = 2 if b.form == 'fk' else 1
  if kind == 'float':
    qa, qb = _merged(va, vb, a, b, t)
    zero = _zero_fns(za, zb, b_contract)
    out = low_precision(qa, qb, batched_dot(b_contract), raw, precision, zero)
  else:
    # Widened to the dot's type first (int4 codes -> int8: exact), so a
    # stored weight's widening depends on the weight alone and XLA can
    # hoist it out of a decode loop.
    # As stored: int4 codes reach the native dot packed (jnp.int4, or the
    # stored bytes, which spare a serving step the decode).
    codes_b = vb if b.packed is None else b.packed
    va, vb = va.astype(a.dot_dtype), vb.astype(b.dot_dtype)
    pref = jnp.int32 if kind == 'int' else jnp.float32

    def cpu(va, vb):
      native = _native_operands(va, codes_b, za, zb, kind, b_contract, t)
      if native is not None:
        return native_dot.rows_dot(*native)
      # XLA:CPU runs a one-row integer dot as a slow int32 loop: add a
      # zero row (integer sums are exact: same bits) and drop its output.
      one_row = za is None and zb is None and fa == 1 and kind == 'int'
      if one_row:
        va = jnp.concatenate([va, jnp.zeros_like(va)], axis=2)
      # Pinned as they lie (a reshape of a pinned array is a copy on CPU).
      va, vb = lax.optimization_barrier((va, vb))
      qa, qb = _merged(va, vb, a, b, t)
      out = batched_dot(b_contract)(qa, qb, pref, None)
      out = _int_corrected(out, qa, qb, za, zb, b_contract)
      return out[:, :1] if one_row else out

    def gpu(va, vb):  # Both contracting their minor axis; no barrier.
      qa, qb = _merged(va, vb, a, b, t)
      out = tn_dot(qa, qb, b_contract, pref)
      return _int_corrected(out, qa, qb, za, zb, b_contract)

    out = per_platform(va, vb, cpu=cpu, gpu=gpu).astype(jnp.float32)
  fb = out.shape[2]
  out = out.reshape(bsz, n, fa, fb)
  if a.scale is not None:
    out = out * a.scale
  if b.scale is not None:
    out = out * (b.scale.transpose(0, 1, 3, 2) if b.form == 'fk' else b.scale)
  return tile_sum(out)


def qdot(a: Operand, b: Operand, raw: DotGeneralRaw, precision, tile):
  """One backward dot: quantize `a` and `b` as their configs say (tiles of
  `tile` along the contraction); contract. Returns (out, a's new state,
  b's new state).

  The lhs `a` may come in either form. A 'kf' lhs [B, K, F] is quantized
  as it lies and its values then written transposed by a plain copy
  (`with_transposed_copy`): on XLA:CPU far cheaper than quantizing a
  transposed float array.
  """
  qa, qb = quantize_tiled(a, tile), quantize_tiled(b, tile)
  state_a = qa.state
  if qa.form == 'kf':
    qa = qa.with_transposed()[1]
  return contract(qa, qb, raw, precision), state_a, qb.state


def fold_scale(
  g: jax.Array, q: QuantizedOperand, axis: int
) -> tuple[jax.Array, int]:
  """g * s_q along g's `axis` (1 or 2), one copy per tile of `q`.

  The reuse identity `(g * s) . q == g . dequant(q)` per tile: returns
  g * s as [B * T, ., .] (tiles merged into the batch) and T.
  """
  s = q.free_scale()  # [B|1, T|1, F]
  s = s[:, :, None, :] if axis == 2 else s[:, :, :, None]
  g4 = g[:, None].astype(jnp.float32) * s
  bsz, n = g.shape[0], q.n_tiles
  g4 = jnp.broadcast_to(g4, (bsz, n) + g4.shape[2:])
  return g4.reshape((bsz * n,) + g4.shape[2:]), n


def repeat_tiles(x: jax.Array | None, n: int) -> jax.Array | None:
  """[B, ., .] -> [B * n, ., .]: one copy of `x` per tile (as `fold_scale`)."""
  if x is None:
    return None
  x = jnp.broadcast_to(x[:, None], (x.shape[0], n) + x.shape[1:])
  return x.reshape((-1,) + x.shape[2:])


def merge_tiles(x3: jax.Array, n: int, form: str) -> jax.Array:
  """Tiles back into K: [B*T, F, t] / [B*T, t, F] -> [B, F, K] / [B, K, F]."""
  return from_view(x3.reshape((-1, n) + x3.shape[1:]), form)
