"""The geometries of the one quantized dot: dense and ragged.

A plan (`core.plan.Plan`) runs its three passes (forward, dlhs, drhs) on
canonical operands; the few steps that depend on how the operands meet
live here, dispatched on `plan.ragged`:

  float_dot    the float dot (`lax.dot_general` / `lax.ragged_dot`)
  contract     the quantized contraction of two tiled-view operands
  qdot         a backward dot: quantize both operands, contract
  fold_scale   g * s_Y: a reused partner's scale folded into g
  reuse_term   (g s) . z_Y: a reused affine partner's zero-point term

Dense (`aqtr.dot_general`): the batched dot of `passes`.

Ragged (`aqtr.ragged_dot`, dimension numbers `RAGGED`). Rows of L [M, K]
are split into G consecutive groups by `group_sizes`; row i belongs to
group e(i), and R [G, K, N] holds one matrix per group (its batch axis):

  fwd:   out[i, n]    = sum_k L[i, k] R[e(i), k, n]     (rows)
  dlhs:  dL[i, k]     = sum_n g[i, n] R[e(i), k, n]     (rows)
  drhs:  dR[e, k, n]  = sum_{i in e} L[i, k] g[i, n]    (tokens)

Each operand is quantized by the plan exactly as for dot_general (L as
[1, M, K], R as [G, K, N], g as [1, M, N]; calibration, tiling, state,
rounding noise, sparsity), so their scales are constant along each pass's
contraction and factor out of the low-precision dot. The 'rows'
contraction (`lax.ragged_dot_general` with R's group axis) applies the
ungrouped operand's scale per row and the grouped one's per group and
channel, gathered per row: s_a[i] s_b[e(i), n]. The 'tokens' contraction
contracts the ragged M within each group, with both scales per channel
over all tokens (constant along M). A reused forward quantization folds
its scale into g (gathered per row for R) and reused affine operands
subtract (g s) . z per row (R) or per group (L). Copies of g, one per
tile of the reused partner (`Plan.grad_copies`), lead the grouped
operand's batch: [G * n, ...], group major.

What the ragged geometry cannot do is refused in one place,
`check_ragged`, with one line naming the config field.

Internal API (used by `plan.py`, `forward.py`, `backward.py`,
`ragged_dot.py`): the names below without a leading underscore.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core import passes, prims, zero_point
from aqtr.core.config import DotGeneralRaw
from aqtr.core.lowering import low_precision
from aqtr.core.passes import QuantizedOperand, quantize_tiled
from aqtr.core.slots import Side, Slot

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


def check_ragged(plan, backward: bool = True) -> None:
  """Raises, naming the config field, where a ragged plan cannot follow.

  The one place of every ragged refusal: a stored lhs (only the grouped
  weights are frozen), a drhs transform (its rotation along the token
  axis would mix the tokens of different groups), and, with `backward`,
  a tiling of drhs's contraction: the token axis M, whose tiles would
  straddle groups (block formats tile it too).
  """
  if plan.lhs.stored:
    raise ValueError(
      'ragged_dot: lhs is a stored QTensor; only the grouped rhs (expert '
      'weights) can be stored: pass the float tokens as lhs.'
    )
  cfg = plan.config
  t = cfg.drhs.transform
  if t.transforms:
    raise ValueError(
      f'config.{Slot.DRHS_LHS.path}.transform: drhs contracts the token '
      'axis per group, which a rotation would mix across groups; got '
      f"{t!r}; allowed there: NoTransform() ('none')."
    )
  if not backward or not cfg.drhs.quantized:
    return
  m = plan.lhs.layout.f
  slots = [Slot.DRHS_LHS] + ([] if plan.reuses(Side.RHS) else [Slot.DRHS_RHS])
  for slot in slots:
    t = slot.tensor(cfg)
    try:
      tiled = t.quantized and t.tiling.tile(m) is not None
    except ValueError:
      tiled = True
    if tiled:
      raise ValueError(
        f'ragged_dot: config.{slot.path}.tiling ({type(t.tiling).__name__}) '
        'splits the token axis, which drhs contracts per group; use '
        'per_channel or per_tensor tiling (and numerics without blocks) '
        'there.'
      )


def group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
  """e(i) for each of the m rows: [M] int32 (rows past the sum: last)."""
  g = group_sizes.shape[0]
  return jnp.repeat(
    jnp.arange(g, dtype=jnp.int32), group_sizes, total_repeat_length=m
  )


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


# --------------------------------------------------------------- dispatch


def float_dot(plan, lhs, rhs, groups) -> jax.Array:
  """The float dot of the plan's geometry (lax's values and gradients)."""
  if plan.ragged:
    return prims.ragged_dot(
      lhs,
      rhs,
      groups,
      precision=plan.precision,
      preferred_element_type=plan.preferred,
    )
  return prims.dot_general(
    lhs,
    rhs,
    plan.dimension_numbers,
    precision=plan.precision,
    preferred_element_type=plan.preferred,
  )


def contract(
  plan, a: QuantizedOperand, b: QuantizedOperand, raw, groups
) -> jax.Array:
  """`passes.contract` in the plan's geometry -> [B, F_a, F_b] float32.

  Ragged: an 'fk' `a` [n, T, M, t] against the grouped `b` [G*n, ...]
  contracts rows ([n, M, F_b]); a 'kf' `a` [n, 1, M, F_a] against g
  [n, 1, M, F_b] contracts tokens per group ([G*n, F_a, F_b]).
  """
  if not plan.ragged:
    return passes.contract(a, b, raw, plan.precision)
  if a.form == 'fk':
    return _rows(a, b, groups, raw, plan.precision)
  return _tokens(a, b, groups, raw, plan.precision)


def qdot(plan, a, b, raw: DotGeneralRaw, tile, groups):
  """`passes.qdot` in the plan's geometry: (out, a's state, b's state).

  Ragged operands are contracted as they lie (a 'kf' lhs is the tokens
  contraction's, not transposed).
  """
  if not plan.ragged:
    return passes.qdot(a, b, raw, plan.precision, tile)
  qa, qb = quantize_tiled(a, tile), quantize_tiled(b, tile)
  return contract(plan, qa, qb, raw, groups), qa.state, qb.state


def fold_scale(plan, side: Side, g3, q: QuantizedOperand, axis: int, groups):
  """`passes.fold_scale` of the pass differentiating `side` against the
  reused partner `q`: (g * s_q as [B*T, ., .], T).

  Ragged dlhs (partner R, one scale per group): g [1, M, N] times each
  row's group's scale, per tile of R: [T, M, N].
  """
  if not (plan.ragged and side is Side.LHS):
    return passes.fold_scale(g3, q, axis)
  n_groups, n = q.values.shape[:2]
  f = q.values.shape[3] if q.form == 'kf' else q.values.shape[2]
  ids = group_ids(groups, g3.shape[1])
  s = jnp.broadcast_to(q.free_scale(), (n_groups, n, f))[ids]  # [M, T, N]
  return g3.astype(jnp.float32) * s.transpose(1, 0, 2), n


def reuse_term(plan, side: Side, g_s, z, axis: int, form: str, groups):
  """`zero_point.reuse_term` in the plan's geometry: (g s) . z_Y.

  Ragged: z per group and channel of R (dlhs: [G*T, N], gathered per
  row, zero past sum(group_sizes)) or per row of L (drhs: [T, M], summed
  over each group's tokens).
  """
  if not plan.ragged:
    return zero_point.reuse_term(g_s, z, axis, form)
  n, m = g_s.shape[0], g_s.shape[1]
  if side is Side.LHS:  # g_s [T, M, N], z [G*T, N] -> [T, M, 1].
    zz = z.reshape(-1, n, z.shape[-1])[group_ids(groups, m)]  # [M, T, N]
    term = jnp.sum(g_s * zz.transpose(1, 0, 2), axis=2, keepdims=True)
    valid = (jnp.arange(m) < jnp.sum(groups))[None, :, None]
    return jnp.where(valid, term, 0.0)
  raw = DotGeneralRaw()  # A float contraction of float operands.
  dot = _ragged(groups, _DN_TOKENS)
  parts = [
    low_precision(z[c][:, None], g_s[c], dot, raw, plan.precision)
    for c in range(n)
  ]  # Each [G, 1, N].
  return jnp.stack(parts, axis=1).reshape((-1,) + parts[0].shape[1:])


# ---------------------------------------------------------------- ragged


def _zero_terms(za, zb, ids, valid, b_form):
  """`low_precision`'s zero-point functions for one tile of a rows dot.

  za [M] (per row) and zb [G, F] (per group and channel), either None:
  sum_k (a - za)(b - zb) = a.b - za sum_k b - zb sum_k a + t za zb, the
  correction terms kept at zero for rows past sum(group_sizes).
  """
  if za is None and zb is None:
    return None
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
    fixed = out
    if zai is not None:
      fixed = fixed - zai * jnp.sum(qb, axis=k_axis, dtype=jnp.int32)[ids]
    if zbi is not None:
      fixed = fixed - zbi * jnp.sum(qa, axis=1, dtype=jnp.int32)[:, None]
    if zai is not None and zbi is not None:
      fixed = fixed + t * zai * zbi
    return jnp.where(valid[:, None], fixed, out)

  return subtract, correct


def _free(q: QuantizedOperand, x: jax.Array, shape) -> jax.Array:
  """A scale or zero point `x` (view-shaped) per free index: `shape`."""
  x = x[..., 0] if q.form == 'fk' else x[:, :, 0, :]
  return jnp.broadcast_to(x, shape)


def _rows(a: QuantizedOperand, b: QuantizedOperand, gs, raw, precision):
  """sum_tiles (q_a - z_a) . (q_b - z_b)[e(i)] * s_a[i] * s_b[e(i)].

  `a` is 'fk' [n, T, M, t]; `b` holds one operand per group and copy,
  [G*n, T, t, F] ('kf') or [G*n, T, F, t] ('fk'). Returns [n, M, F].
  """
  n, tiles, m, _ = a.values.shape
  g = b.values.shape[0] // n
  f = b.values.shape[3] if b.form == 'kf' else b.values.shape[2]
  ids = group_ids(gs, m)
  valid = jnp.arange(m) < jnp.sum(gs)
  va, za = zero_point.as_int8(a.values, a.zero_point)
  vb, zb = zero_point.as_int8(b.values, b.zero_point)
  vb = vb.reshape((g, n) + vb.shape[1:])
  s_a = None if a.scale is None else _free(a, a.scale, (n, tiles, m))
  s_b = None
  if b.scale is not None:  # Per row: [M, n, T, F], gathered once (one
    # gather with `fold_scale`'s of the same scale, for XLA to share).
    s_b = _free(b, b.scale, (g * n, tiles, f))
    s_b = s_b[ids][:, None] if n == 1 else s_b.reshape(g, n, tiles, f)[ids]
  za = None if za is None else _free(a, za, (n, tiles, m))
  if zb is not None:
    zb = _free(b, zb, (g * n, tiles, f)).reshape(g, n, tiles, f)
  dot = _ragged(gs, _DN_KF if b.form == 'kf' else _DN_FK)
  outs = []
  for c in range(n):
    out = None
    for j in range(tiles):
      zero = _zero_terms(
        None if za is None else za[c, j],
        None if zb is None else zb[:, c, j],
        ids,
        valid,
        b.form,
      )
      qa = va[c, j].astype(a.dot_dtype)
      qb = vb[:, c, j].astype(b.dot_dtype)
      o = low_precision(qa, qb, dot, raw, precision, zero)
      if s_a is not None:
        o = o * s_a[c, j][:, None]
      if s_b is not None:
        o = o * s_b[:, c, j]
      out = o if out is None else out + o
    outs.append(out)
  return outs[0][None] if n == 1 else jnp.stack(outs)


def _token_values(q: QuantizedOperand):
  """A 'kf' tokens operand [n, 1, M, F]: (q - z as [n, M, F], s [n, F])."""
  v = q.values[:, 0]
  if q.zero_point is None:
    v = v.astype(q.dot_dtype)
  else:  # Subtracted in float: exact for integer values.
    z = jnp.broadcast_to(q.zero_point, q.values.shape)[:, 0]
    v = v.astype(jnp.float32) - z
  s = None
  if q.scale is not None:
    s = jnp.broadcast_to(q.scale, q.values.shape)[:, 0, 0, :]
  return v, s


def _tokens(a: QuantizedOperand, b: QuantizedOperand, gs, raw, precision):
  """sum_{i in e} (a[i] s_a)^T (b[i] s_b) per group -> [G*n, F_a, F_b].

  Both 'kf' [n, 1, M, F] with scales per channel (constant along the
  ragged contraction M).
  """
  va, sa = _token_values(a)
  vb, sb = _token_values(b)
  dot = _ragged(gs, _DN_TOKENS)
  outs = []
  for c in range(va.shape[0]):
    o = low_precision(va[c], vb[c], dot, raw, precision)
    if sa is not None:
      o = o * sa[c][None, :, None]
    if sb is not None:
      o = o * sb[c][None, None, :]
    outs.append(o)
  if len(outs) == 1:
    return outs[0]
  return jnp.stack(outs, axis=1).reshape((-1,) + outs[0].shape[1:])
