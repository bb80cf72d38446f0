"""The canonical passes of a quantized `ragged_dot` (mixture of experts).

Math. Rows of L [M, K] are split into G consecutive groups by
`group_sizes`; row i belongs to expert e(i), and R [G, K, N] holds one
weight matrix per expert:

  fwd:   out[i, n]    = sum_k L[i, k] R[e(i), k, n]
  dlhs:  dL[i, k]     = sum_n g[i, n] R[e(i), k, n]     (a ragged dot again)
  drhs:  dR[e, k, n]  = sum_{i in e} L[i, k] g[i, n]    (ragged contraction)

Scales are constant along each pass's contraction, so they factor out of
the integer dot: L per token (row) and tile, R per expert, tile and output
channel, g per row in dlhs and per output channel (over all tokens) in
drhs. The forward thus runs `q_L . q_R[e(i)]` (int8 x int8 -> int32,
fp8 x fp8 -> f32) times `s_L[i] s_R[e(i), n]`. A backward pass that reuses
the forward quantization folds the residual's scale into g first, exactly
as `dot_general.py` does: (g * s_R[e(i)]) . q_R[e(i)]^T and
q_L^T . (g * s_L). Gradients pass straight through the rounding, masked by
the forward numerics' clip_gradient.

Internal API (used by `dot_general.py`, which holds the custom VJP):
`RaggedResiduals`, `ragged_fwd`, `ragged_bwd`, `group_ids`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.passes import (
  Operand,
  PassKeys,
  QuantizedOperand,
  common_tile,
  quantize_tiled,
  residual_key,
  rounding_noise,
)
from aqtr.core.qtensor import from_view, to_view

# L [M, K] . R [G, K, N] -> [M, N]; and R as [G, N, K] (contract its last).
_DN_KF = lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((1,), (1,)), ((), ())),
  lhs_ragged_dimensions=[0],
  rhs_group_dimensions=[0],
)
_DN_FK = lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((1,), (2,)), ((), ())),
  lhs_ragged_dimensions=[0],
  rhs_group_dimensions=[0],
)
# A [M, Fa] . B [M, Fb] contracting the ragged M -> [G, Fa, Fb].
_DN_TOKENS = lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((0,), (0,)), ((), ())),
  lhs_ragged_dimensions=[0],
  rhs_group_dimensions=[],
)


def group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
  """e(i) for each of the m rows: [M] int32 (rows past the sum: last)."""
  g = group_sizes.shape[0]
  return jnp.repeat(
    jnp.arange(g, dtype=jnp.int32), group_sizes, total_repeat_length=m
  )


def _is_int(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.integer)


def _is_fp8(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _low_precision_dot(qa, qb, gs, dn, raw: DotGeneralRaw, precision):
  """`lax.ragged_dot_general` in the operands' own low-precision types."""
  da, db = qa.dtype, qb.dtype
  kw = {'ragged_dot_dimension_numbers': dn}
  if _is_int(da) and _is_int(db) and raw.accumulator != 'float32':
    out = lax.ragged_dot_general(
      qa, qb, gs, preferred_element_type=jnp.int32, **kw
    )
    return out.astype(jnp.float32)
  if _is_fp8(da) and _is_fp8(db) and raw.accumulator != 'int32':
    return lax.ragged_dot_general(
      qa, qb, gs, preferred_element_type=jnp.float32, **kw
    )
  floats = [d for d in (da, db) if not (_is_int(d) or _is_fp8(d))]
  ct = jnp.result_type(*floats) if floats else jnp.float32
  return lax.ragged_dot_general(
    qa.astype(ct),
    qb.astype(ct),
    gs,
    precision=precision,
    preferred_element_type=jnp.float32,
    **kw,
  )


def _row_scale(q: QuantizedOperand) -> jax.Array | None:
  """The 'fk' operand [1, T, M, t]'s scale as [T, M, 1], or None."""
  if q.scale is None:
    return None
  _, n, m, _ = q.values.shape
  return jnp.broadcast_to(q.scale, (1, n, m, 1))[0]


def _expert_scale(q: QuantizedOperand, ids: jax.Array) -> jax.Array | None:
  """The per-expert operand's scale gathered per row: [M, T, F], or None."""
  if q.scale is None:
    return None
  g, n = q.values.shape[:2]
  f = q.values.shape[3] if q.form == 'kf' else q.values.shape[2]
  s = jnp.broadcast_to(q.free_scale(), (g, n, f))
  return s[ids]


def ragged_contract(
  a: QuantizedOperand,
  b: QuantizedOperand,
  gs: jax.Array,
  raw: DotGeneralRaw,
  precision,
) -> jax.Array:
  """sum_tiles (q_a . q_b[e(i)]) * s_a[i] * s_b[e(i)] -> [M, F_b] float32.

  `a` is 'fk' [1, T, M, t]; `b` holds one operand per expert, [G, T, t, F]
  ('kf') or [G, T, F, t] ('fk').
  """
  n, m = a.values.shape[1], a.values.shape[2]
  s_a, s_b = _row_scale(a), _expert_scale(b, group_ids(gs, m))
  dn = _DN_KF if b.form == 'kf' else _DN_FK
  out = None
  for j in range(n):
    qa = a.values[0, j].astype(a.dot_dtype)
    qb = b.values[:, j].astype(b.dot_dtype)
    o = _low_precision_dot(qa, qb, gs, dn, raw, precision)
    if s_a is not None:
      o = o * s_a[j]
    if s_b is not None:
      o = o * s_b[:, j]
    out = o if out is None else out + o
  return out


def _token_contract(a, s_a, b, s_b, gs, raw, precision) -> jax.Array:
  """sum_{i in e} a[i, :]^T b[i, :] * s_a * s_b -> [G, Fa, Fb] float32.

  a [M, Fa], b [M, Fb] with scales [1, Fa] / [1, Fb] (or None) constant
  along the ragged contraction M.
  """
  out = _low_precision_dot(a, b, gs, _DN_TOKENS, raw, precision)
  if s_a is not None:
    out = out * s_a[0][None, :, None]
  if s_b is not None:
    out = out * s_b[0][None, None, :]
  return out


# ----------------------------------------------------------------- residuals


@dataclasses.dataclass(frozen=True)
class RaggedResiduals:
  """What the forward pass keeps for the backward passes.

  Attributes:
    lhs, rhs: the float operands, or None where a pass reuses q instead.
    q_lhs: the forward quantization of L ('fk' [1, T, M, t]) for drhs.
    q_rhs: the forward quantization of R ('kf' [G, T, t, N]) for dlhs.
    mask_lhs, mask_rhs: straight-through gradient masks, or None.
    group_sizes: [G] integers.
    key_dlhs, key_drhs: PRNG keys of the backward passes, or None.
    lhs_struct, rhs_struct: the operands' shapes and dtypes (static).
  """

  lhs: jax.Array | None
  rhs: jax.Array | None
  q_lhs: QuantizedOperand | None
  q_rhs: QuantizedOperand | None
  mask_lhs: jax.Array | None
  mask_rhs: jax.Array | None
  group_sizes: jax.Array
  key_dlhs: jax.Array | None
  key_drhs: jax.Array | None
  lhs_struct: jax.ShapeDtypeStruct
  rhs_struct: jax.ShapeDtypeStruct


jax.tree_util.register_dataclass(
  RaggedResiduals,
  data_fields=[
    'lhs',
    'rhs',
    'q_lhs',
    'q_rhs',
    'mask_lhs',
    'mask_rhs',
    'group_sizes',
    'key_dlhs',
    'key_drhs',
  ],
  meta_fields=['lhs_struct', 'rhs_struct'],
)


def _operand(x3, form, cfg: TensorConfig, key, tile) -> QuantizedOperand:
  noise = rounding_noise(cfg, key, x3.shape)
  return quantize_tiled(Operand(x3, form, cfg, noise), tile)


def ragged_fwd(lhs, rhs, gs, key, cfg: DotGeneralConfig, precision, preferred):
  """out = ragged_dot(L, R), quantized as `cfg.fwd` says; and residuals."""
  keys = PassKeys.split(key)
  tile = common_tile([cfg.fwd.lhs, cfg.fwd.rhs], lhs.shape[1])
  q_l = _operand(lhs[None], 'fk', cfg.fwd.lhs, keys.fwd_lhs, tile)
  q_r = _operand(rhs, 'kf', cfg.fwd.rhs, keys.fwd_rhs, tile)
  out = ragged_contract(q_l, q_r, gs, cfg.fwd, precision)
  out_dtype = preferred or jnp.result_type(lhs.dtype, rhs.dtype)
  reuse_l = q_l.scale is not None and cfg.drhs.use_fwd_quant
  reuse_r = q_r.scale is not None and cfg.dlhs.use_fwd_quant
  res = RaggedResiduals(
    lhs=None if reuse_l else lhs,
    rhs=None if reuse_r else rhs,
    q_lhs=q_l.without_mask() if reuse_l else None,
    q_rhs=q_r.without_mask() if reuse_r else None,
    mask_lhs=None if q_l.mask is None else from_view(q_l.mask, 'fk')[0],
    mask_rhs=None if q_r.mask is None else from_view(q_r.mask, 'kf'),
    group_sizes=gs,
    key_dlhs=keys.dlhs,
    key_drhs=keys.drhs,
    lhs_struct=jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
    rhs_struct=jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
  )
  return out.astype(out_dtype), res


# ------------------------------------------------------------------ backward


def _dequantized(q: QuantizedOperand, dtype) -> jax.Array:
  return from_view(q.values.astype(jnp.float32) * q.scale, q.form).astype(dtype)


def _float_grad(lhs, rhs, gs, g, wrt, precision, preferred) -> jax.Array:
  """The gradient of lax.ragged_dot w.r.t. operand `wrt`, as JAX does it."""

  def f(x):
    args = (x, rhs) if wrt == 0 else (lhs, x)
    return lax.ragged_dot(
      *args, gs, precision=precision, preferred_element_type=preferred
    )

  return jax.linear_transpose(f, lhs if wrt == 0 else rhs)(g)[0]


def _dlhs(raw: DotGeneralRaw, res: RaggedResiduals, g, precision, preferred):
  """dL [M, K] = g . R[e(i)]^T, contracting N."""
  gs, n_out = res.group_sizes, g.shape[1]
  if not raw.quantized:
    y_r = res.rhs if res.q_rhs is None else _dequantized(res.q_rhs, g.dtype)
    zero = jnp.zeros(res.lhs_struct.shape, res.lhs_struct.dtype)
    return _float_grad(zero, y_r, gs, g, 0, precision, preferred)
  if res.q_rhs is None:  # Requantize R, contracting its N: 'fk' [G, K, N].
    tile = common_tile([raw.lhs, raw.rhs], n_out)
    key = residual_key(res.key_dlhs)
    q_g = _operand(g[None], 'fk', raw.lhs, res.key_dlhs, tile)
    q_r = _operand(res.rhs, 'fk', raw.rhs, key, tile)
    return ragged_contract(q_g, q_r, gs, raw, precision)
  q_r = res.q_rhs  # [G, T, t, N]: per fwd tile j, (g * s_R) . q_R[:, j]^T.
  tile = common_tile([raw.lhs], n_out)
  noise = rounding_noise(raw.lhs, res.key_dlhs, (1,) + g.shape)
  s_r = _expert_scale(q_r, group_ids(gs, g.shape[0]))  # [M, T, N]
  parts = []
  for j in range(q_r.n_tiles):
    g_s = g.astype(jnp.float32) * s_r[:, j]
    q_g = quantize_tiled(Operand(g_s[None], 'fk', raw.lhs, noise), tile)
    partner = QuantizedOperand(
      to_view(q_r.values[:, j], 'fk', tile), None, None, 'fk', q_r.dot_dtype
    )
    parts.append(ragged_contract(q_g, partner, gs, raw, precision))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _token_operand(x, cfg: TensorConfig, key, field: str):
  """x [M, F] quantized with scales per F over all tokens: (q, s [1, F])."""
  if cfg.quantized and cfg.tiling.tile(x.shape[0]) is not None:
    raise ValueError(
      f'ragged_dot: {field}.tiling splits the token axis, which drhs '
      'contracts per expert; use per_channel or per_tensor tiling there.'
    )
  q = _operand(x[None], 'kf', cfg, key, None)
  s = None if q.scale is None else jnp.broadcast_to(q.scale, q.values.shape)
  s = None if s is None else s[0, 0, :1]
  return q.values[0, 0].astype(q.dot_dtype), s


def _drhs(raw: DotGeneralRaw, res: RaggedResiduals, g, precision, preferred):
  """dR [G, K, N] = sum over each expert's tokens of L^T g."""
  gs = res.group_sizes
  if not raw.quantized:
    y_l = res.lhs if res.q_lhs is None else _dequantized(res.q_lhs, g.dtype)
    y_l = y_l[0] if y_l.ndim == 3 else y_l
    zero = jnp.zeros(res.rhs_struct.shape, res.rhs_struct.dtype)
    return _float_grad(y_l, zero, gs, g, 1, precision, preferred)
  if res.q_lhs is None:
    key = residual_key(res.key_drhs)
    q_l, s_l = _token_operand(res.lhs, raw.rhs, key, 'config.drhs.rhs')
    q_g, s_g = _token_operand(g, raw.lhs, res.key_drhs, 'config.drhs.lhs')
    return _token_contract(q_l, s_l, q_g, s_g, gs, raw, precision)
  q_l = res.q_lhs  # [1, T, M, t]: per fwd tile j, q_L^T . (g * s_L).
  s_l = _row_scale(q_l)  # [T, M, 1]
  parts = []
  for j in range(q_l.n_tiles):
    g_s = g.astype(jnp.float32) * s_l[j]
    q_g, s_g = _token_operand(g_s, raw.lhs, res.key_drhs, 'config.drhs.lhs')
    a = q_l.values[0, j].astype(q_l.dot_dtype)
    parts.append(_token_contract(a, None, q_g, s_g, gs, raw, precision))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def ragged_bwd(cfg: DotGeneralConfig, precision, preferred, res, g):
  """(dL, dR, None, None): the two gradients as `cfg.dlhs/drhs` say."""
  dl = _dlhs(cfg.dlhs, res, g, precision, preferred)
  dr = _drhs(cfg.drhs, res, g, precision, preferred)
  if res.mask_lhs is not None:
    dl = jnp.where(res.mask_lhs, dl, jnp.zeros_like(dl))
  if res.mask_rhs is not None:
    dr = jnp.where(res.mask_rhs, dr, jnp.zeros_like(dr))
  dl = dl.astype(res.lhs_struct.dtype)
  dr = dr.astype(res.rhs_struct.dtype)
  return dl, dr, None, None
