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

The passes share the engine's pieces: the quantizer (`quantize_tiled`),
the contraction core's dtype dispatch (`passes.low_precision`), the
per-side residual records (`residuals.SideResidual`) and the slot keys.
Affine operands (zero points) are exact: the integer dot is corrected by
`sum_k (a - z_a)(b - z_b) = a.b - z_a sum b - z_b sum a + t z_a z_b` per
row and expert, and a reused affine residual subtracts (g s) . z. What the
ragged passes do not take (calibration state, stored QTensors, sparsity)
is refused at the call with one line naming the slot.

Internal API (used by `dot_general.py`, which holds the custom VJP, and
`ragged_dot.py`): `RaggedPlan`, `ragged_fwd`, `ragged_bwd`, `group_ids`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr.core import prims
from aqtr.core.algorithms import StatefulCalibration
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.passes import (
  Operand,
  QuantizedOperand,
  low_precision,
  quantize_tiled,
  residual_key,
  rounding_noise,
  slot_keys,
)
from aqtr.core.plan import common_tile
from aqtr.core.qtensor import from_view, to_view
from aqtr.core.residuals import Residuals, SideResidual
from aqtr.core.slots import Side, Slot
from aqtr.core.zero_point import as_int8

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


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
  """The static facts of one quantized ragged dot (built once per call).

  Attributes:
    config: the DotGeneralConfig.
    lhs, rhs: shapes and dtypes of L [M, K] and R [G, K, N].
    tile: the forward tile size along K, or None.
    precision, preferred: as in `lax.ragged_dot`.
  """

  config: DotGeneralConfig
  lhs: tuple
  rhs: tuple
  tile: int | None = None
  precision: object = None
  preferred: np.dtype | None = None

  @classmethod
  def create(cls, lhs, rhs, config, precision=None, preferred=None):
    """Checks what the ragged passes support, naming the operand slot."""
    for slot in Slot:
      t = slot.tensor(config)
      cal = type(t.calibration).__name__
      if t.quantized and isinstance(t.calibration, StatefulCalibration):
        raise ValueError(
          f'ragged_dot: config.{slot.path} has the stateful calibration '
          f'{cal}, but ragged_dot takes no calibration state; use a '
          'stateless calibration there (absmax, minmax, percentile, ...).'
        )
    return cls(
      config=config,
      lhs=(tuple(lhs.shape), np.dtype(lhs.dtype)),
      rhs=(tuple(rhs.shape), np.dtype(rhs.dtype)),
      tile=common_tile([config.fwd.lhs, config.fwd.rhs], lhs.shape[1]),
      precision=precision,
      preferred=None if preferred is None else np.dtype(preferred),
    )

  def struct(self, side: Side) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(*(self.lhs if side is Side.LHS else self.rhs))


def _ragged(gs, dn):
  """The `dot` of `passes.low_precision`: lax.ragged_dot_general."""

  def dot(qa, qb, preferred, precision):
    return lax.ragged_dot_general(
      qa,
      qb,
      gs,
      ragged_dot_dimension_numbers=dn,
      precision=precision,
      preferred_element_type=preferred,
    )

  return dot


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


def _expert_zero(q: QuantizedOperand) -> jax.Array | None:
  """The per-expert operand's zero point per tile and channel [G, T, F]."""
  _, z = as_int8(q.values, q.zero_point)
  if z is None:
    return None
  g, n = q.values.shape[:2]
  f = q.values.shape[3] if q.form == 'kf' else q.values.shape[2]
  z = z[:, :, 0, :] if q.form == 'kf' else z[..., 0]
  return jnp.broadcast_to(z, (g, n, f))


def _zero_terms(za, zb, ids, valid, b_form):
  """`low_precision`'s zero-point functions for one tile of a ragged dot.

  za [M] (per row) and zb [G, F] (per expert and channel), either None:
  sum_k (a - za)(b - zb) = a.b - za sum_k b - zb sum_k a + t za zb, the
  correction terms kept at zero for rows past sum(group_sizes).
  """
  k_axis = 1 if b_form == 'kf' else 2

  def subtract(qa, qb):
    if za is not None:
      qa = qa - za[:, None].astype(qa.dtype)
    if zb is not None:
      zz = zb[:, None, :] if b_form == 'kf' else zb[:, :, None]
      qb = qb - zz.astype(qb.dtype)
    return qa, qb

  def correct(out, qa, qb):
    t = qa.shape[1]
    zai = None if za is None else za.astype(jnp.int32)[:, None]
    zbi = None if zb is None else zb.astype(jnp.int32)[ids]
    if zai is not None:
      out = out - zai * jnp.sum(qb, axis=k_axis, dtype=jnp.int32)[ids]
    if zbi is not None:
      out = out - zbi * jnp.sum(qa, axis=1, dtype=jnp.int32)[:, None]
    if zai is not None and zbi is not None:
      out = out + t * zai * zbi
    return out

  def correct_valid(out, qa, qb):
    return jnp.where(valid[:, None], correct(out, qa, qb), out)

  if za is None and zb is None:
    return None
  return subtract, correct_valid


def ragged_contract(
  a: QuantizedOperand,
  b: QuantizedOperand,
  gs: jax.Array,
  raw: DotGeneralRaw,
  precision,
) -> jax.Array:
  """sum_tiles (q_a - z_a) . (q_b - z_b)[e(i)] * s_a[i] * s_b[e(i)] -> [M, F_b].

  `a` is 'fk' [1, T, M, t]; `b` holds one operand per expert, [G, T, t, F]
  ('kf') or [G, T, F, t] ('fk'). Zero points (affine numerics) are None
  for symmetric operands.
  """
  n, m = a.values.shape[1], a.values.shape[2]
  ids = group_ids(gs, m)
  valid = jnp.arange(m) < jnp.sum(gs)
  s_a, s_b = _row_scale(a), _expert_scale(b, ids)
  va, za = as_int8(a.values, a.zero_point)
  vb, _ = as_int8(b.values, b.zero_point)
  za = None if za is None else jnp.broadcast_to(za, (1, n, m, 1))[0, :, :, 0]
  zb = _expert_zero(b)
  dn = _DN_KF if b.form == 'kf' else _DN_FK
  dot = _ragged(gs, dn)
  out = None
  for j in range(n):
    qa = va[0, j].astype(a.dot_dtype)
    qb = vb[:, j].astype(b.dot_dtype)
    zero = _zero_terms(
      None if za is None else za[j],
      None if zb is None else zb[:, j],
      ids,
      valid,
      b.form,
    )
    o = low_precision(qa, qb, dot, raw, precision, zero)
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
  out = low_precision(a, b, _ragged(gs, _DN_TOKENS), raw, precision)
  if s_a is not None:
    out = out * s_a[0][None, :, None]
  if s_b is not None:
    out = out * s_b[0][None, None, :]
  return out


# ------------------------------------------------------------------- passes


def ragged_operand(x3, form, cfg: TensorConfig, key, tile) -> QuantizedOperand:
  """One operand of a ragged pass quantized in its tiled view."""
  noise = rounding_noise(cfg, key, x3.shape)
  return quantize_tiled(Operand(x3, form, cfg, noise), tile)


def stored_operand(values, scale, zero_point, form, dot_dtype):
  """A stored (frozen) operand as the ragged passes take it."""
  return QuantizedOperand(
    values, scale, None, form, jnp.dtype(dot_dtype), zero_point
  )


def ragged_fwd(plan: RaggedPlan, lhs, rhs, gs, key):
  """out = ragged_dot(L, R) quantized as `config.fwd` says; residuals.

  The residuals are `(Residuals, group_sizes)`: per side the float
  operand, or its forward quantization where the other gradient reuses it.
  """
  cfg = plan.config
  keys = slot_keys(key)
  q_l = ragged_operand(
    lhs[None], 'fk', cfg.fwd.lhs, keys.get(Slot.FWD_LHS), plan.tile
  )
  q_r = ragged_operand(
    rhs, 'kf', cfg.fwd.rhs, keys.get(Slot.FWD_RHS), plan.tile
  )
  out = ragged_contract(q_l, q_r, gs, cfg.fwd, plan.precision)
  out_dtype = plan.preferred or jnp.result_type(lhs.dtype, rhs.dtype)

  def side(x, q, reuse, mask_form, key):
    mask = None if q.mask is None else from_view(q.mask, mask_form)
    return SideResidual(
      x=None if reuse else x,
      q=q.without_mask() if reuse else None,
      mask=mask,
      key=key,
    )

  reuse_l = q_l.scale is not None and cfg.drhs.use_fwd_quant
  reuse_r = q_r.scale is not None and cfg.dlhs.use_fwd_quant
  res_l = side(lhs, q_l, reuse_l, 'fk', keys.get(Slot.DLHS_LHS))
  res_r = side(rhs, q_r, reuse_r, 'kf', keys.get(Slot.DRHS_LHS))
  if res_l.mask is not None:
    res_l = dataclasses.replace(res_l, mask=res_l.mask[0])
  return out.astype(out_dtype), (Residuals(res_l, res_r), gs)


# ------------------------------------------------------------------ backward


def _dequantized(q: QuantizedOperand, dtype) -> jax.Array:
  v = q.values.astype(jnp.float32)
  if q.zero_point is not None:
    v = v - q.zero_point
  return from_view(v * q.scale, q.form).astype(dtype)


def _float_grad(plan: RaggedPlan, side: Side, y, gs, g) -> jax.Array:
  """The gradient of lax.ragged_dot w.r.t. `side` (partner `y`), as JAX."""
  struct = plan.struct(side)

  def f(x):
    args = (x, y) if side is Side.LHS else (y, x)
    return prims.ragged_dot(
      *args,
      gs,
      precision=plan.precision,
      preferred_element_type=plan.preferred,
    )

  return jax.linear_transpose(f, jnp.zeros(struct.shape, struct.dtype))(g)[0]


def _dlhs(plan: RaggedPlan, res: Residuals, gs, g):
  """dL [M, K] = g . R[e(i)]^T, contracting N."""
  raw, n_out = plan.config.dlhs, g.shape[1]
  key = res.lhs.key
  if not raw.quantized:
    q = res.rhs.q
    y_r = res.rhs.x if q is None else _dequantized(q, g.dtype)
    return _float_grad(plan, Side.LHS, y_r, gs, g)
  if res.rhs.q is None:  # Requantize R, contracting its N: 'fk' [G, K, N].
    names = (Slot.DLHS_LHS.path, Slot.DLHS_RHS.path)
    tile = common_tile([raw.lhs, raw.rhs], n_out, names)
    q_g = ragged_operand(g[None], 'fk', raw.lhs, key, tile)
    q_r = ragged_operand(res.rhs.x, 'fk', raw.rhs, residual_key(key), tile)
    return ragged_contract(q_g, q_r, gs, raw, plan.precision)
  q_r = res.rhs.q  # [G, T, t, N]: per fwd tile j, (g * s_R) . q_R[:, j]^T.
  tile = common_tile([raw.lhs], n_out, (Slot.DLHS_LHS.path,))
  noise = rounding_noise(raw.lhs, key, (1,) + g.shape)
  ids = group_ids(gs, g.shape[0])
  valid = (jnp.arange(g.shape[0]) < jnp.sum(gs))[:, None]
  s_r = _expert_scale(q_r, ids)  # [M, T, N]
  z_r = _expert_zero(q_r)  # [G, T, N] or None
  values, _ = as_int8(q_r.values, q_r.zero_point)
  parts = []
  for j in range(q_r.n_tiles):
    g_s = g.astype(jnp.float32) * s_r[:, j]
    q_g = quantize_tiled(Operand(g_s[None], 'fk', raw.lhs, noise), tile)
    partner = QuantizedOperand(
      to_view(values[:, j], 'fk', tile), None, None, 'fk', q_r.dot_dtype
    )
    part = ragged_contract(q_g, partner, gs, raw, plan.precision)
    if z_r is not None:  # (g s) . z_R[e(i)] over N, per row.
      term = jnp.sum(g_s * z_r[:, j][ids], axis=1, keepdims=True)
      part = part - jnp.where(valid, term, 0.0)
    parts.append(part)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _token_operand(x, cfg: TensorConfig, key, slot: Slot):
  """x [M, F] quantized per F over all tokens: (q - z, s [1, F])."""
  if cfg.quantized and cfg.tiling.tile(x.shape[0]) is not None:
    raise ValueError(
      f'ragged_dot: config.{slot.path}.tiling splits the token axis, which '
      'drhs contracts per expert; use per_channel or per_tensor tiling there.'
    )
  q = ragged_operand(x[None], 'kf', cfg, key, None)
  s = None if q.scale is None else jnp.broadcast_to(q.scale, q.values.shape)
  s = None if s is None else s[0, 0, :1]
  v = q.values[0, 0].astype(q.dot_dtype)
  if q.zero_point is not None:  # Exact in float for integer values.
    z = jnp.broadcast_to(q.zero_point, q.values.shape)[0, 0, :1]
    v = v.astype(jnp.float32) - z
  return v, s


def _drhs(plan: RaggedPlan, res: Residuals, gs, g):
  """dR [G, K, N] = sum over each expert's tokens of L^T g."""
  raw, key = plan.config.drhs, res.rhs.key
  if not raw.quantized:
    q = res.lhs.q
    y_l = res.lhs.x if q is None else _dequantized(q, g.dtype)[0]
    return _float_grad(plan, Side.RHS, y_l, gs, g)
  if res.lhs.q is None:
    q_l, s_l = _token_operand(
      res.lhs.x, raw.rhs, residual_key(key), Slot.DRHS_RHS
    )
    q_g, s_g = _token_operand(g, raw.lhs, key, Slot.DRHS_LHS)
    return _token_contract(q_l, s_l, q_g, s_g, gs, raw, plan.precision)
  q_l = res.lhs.q  # [1, T, M, t]: per fwd tile j, q_L^T . (g * s_L).
  s_l = _row_scale(q_l)  # [T, M, 1]
  values, z_l = as_int8(q_l.values, q_l.zero_point)
  if z_l is not None:
    z_l = jnp.broadcast_to(z_l, q_l.values.shape[:3] + (1,))[0]  # [T, M, 1]
  parts = []
  for j in range(q_l.n_tiles):
    g_s = g.astype(jnp.float32) * s_l[j]
    q_g, s_g = _token_operand(g_s, raw.lhs, key, Slot.DRHS_LHS)
    a = values[0, j].astype(q_l.dot_dtype)
    part = _token_contract(a, None, q_g, s_g, gs, raw, plan.precision)
    if z_l is not None:  # sum_{i in e} z_L[i] (g s)[i, n], per expert.
      part = part - _token_contract(
        z_l[j], None, g_s, None, gs, raw, plan.precision
      )
    parts.append(part)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def ragged_bwd(plan: RaggedPlan, residuals, g):
  """(dL, dR, None, None): the two gradients as `config.dlhs/drhs` say."""
  res, gs = residuals
  dl = _dlhs(plan, res, gs, g)
  dr = _drhs(plan, res, gs, g)
  if res.lhs.mask is not None:
    dl = jnp.where(res.lhs.mask, dl, jnp.zeros_like(dl))
  if res.rhs.mask is not None:
    dr = jnp.where(res.rhs.mask, dr, jnp.zeros_like(dr))
  dl = dl.astype(plan.lhs[1])
  dr = dr.astype(plan.rhs[1])
  return dl, dr, None, None
