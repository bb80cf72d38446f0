"""The backward passes: one routine, symmetric in the side it differentiates.

With cotangent g in the output layout [B, M, N] = [B, F_L, F_R], the
gradient of operand X (partner Y) contracts g with Y over Y's free axis:

  dlhs:  dL [B, M, K] = g [B, M, N] . Y_R      (contract N = F_R)
  drhs:  dR           = g^T . Y_L              (contract M = F_L)

Y is the float residual, requantized with `config.<pass>.rhs`, or (reuse,
`use_fwd_quant` or a stored operand) the forward quantization q_Y, whose
scale is folded into g first: (g * s_Y) . q_Y == g . dequant(Y), one copy
of g per tile of Y (its scales differ per tile). g is quantized with
`config.<pass>.lhs`. The result is emitted directly in X's forward form:

  'fk' [B, F_X, K]:  g_X [B, F_X, F_Y] . Y  (g first; a 'kf' g is quantized
                     as it lies, then its int8 values copied transposed)
  'kf' [B, K, F_X]:  Y [B, K, F_Y] . g_X    ([K, N] weights: Y = q_L^T,
                     written by the forward pass)

so every dot's lhs contracts its last axis (XLA:CPU's fast int8 kernel).
A forward transform R (`config.fwd.*.transform`) changes nothing for a
float residual (the straight-through gradient of Q(x R) Q(R^T w) is
g w^T); a stored partner holds R^T y, so its values are rotated back (or,
reused, the gradient of x R is mapped back by R^T).
A reused affine Y subtracts (g s) . z_Y (`zero_point.reuse_term`).
Gradients pass straight through the rounding, masked by the forward
numerics' clip_gradient; the sparsity's SR-STE term is added after.

Internal API (used by `dot_general.py`): `backward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aqtr.core import geometry, prims
from aqtr.core.first_order import first_order_only
from aqtr.core.passes import (
  Operand,
  canonical_noise,
  dense_tiles,
  dequantized,
  flip,
  k_axis,
  merge_tiles,
  repeat_tiles,
  residual_key,
  rounding_noise,
  transform_key,
)
from aqtr.core.plan import Plan
from aqtr.core.residuals import Residuals
from aqtr.core.sharding import match_vma, zeros_varying
from aqtr.core.slot_state import learned_cotangent
from aqtr.core.slots import GRADIENT_SLOTS, SIDES, Side, Slot


def _float_grad(plan: Plan, side: Side, y, g, groups) -> jax.Array:
  """The gradient of lax's dot w.r.t. `side`, partner `y`, as JAX."""
  zero = zeros_varying(plan.operand(side).struct, plan.operand(side).vma)

  def f(x):
    args = (x, y) if side is Side.LHS else (y, x)
    return geometry.float_dot(plan, *args, groups)

  return jax.linear_transpose(f, zero)(g)[0]


def _stored_values(plan: Plan, y, q) -> jax.Array:
  """A stored (reused) partner's float values in its own layout, rotated
  back when the forward pass rotates (a frozen weight is stored as R^T w)."""
  v = q.dequantized(y.layout, y.dtype)
  tf = plan.config.fwd.transform
  if not tf.transforms:
    return v
  v3 = tf.inverse(y.layout.to_canonical(v, y.form), k_axis(y.form))
  return y.layout.from_canonical(v3, y.form).astype(y.dtype)


def operand_gradient(plan: Plan, side: Side, res: Residuals, g, gst):
  """(dX before masking, the gradient operand's new state or None).

  `gst`: the calibration state {'stats', 'learned'} of the pass's gradient
  operand g, or None.
  """
  pass_ = side.grad_pass
  raw = getattr(plan.config, pass_.value)
  y, y_res = plan.partner(side), res.side(side.other)
  t = raw.transform
  if not (raw.quantized or t.transforms):
    yv = y_res.x
    if y_res.q is not None:
      yv = _stored_values(plan, y, y_res.q)
    return _float_grad(plan, side, yv, g, res.groups), None
  lay = plan.layout
  g3 = g.reshape(lay.lhs.b, lay.lhs.f, lay.rhs.f)
  key = res.side(side).key  # The key of the pass differentiating `side`.
  noise = rounding_noise(raw.lhs, key, plan.out_shape)
  noise = None if noise is None else noise.reshape(g3.shape)
  g_form = 'fk' if side is Side.LHS else 'kf'  # F_Y last / first.
  fy_axis = 2 if side is Side.LHS else 1
  n = plan.grad_copies(side)
  reuse = plan.reuses(side)
  y_x = y_res.x
  if y_res.q is not None and not reuse:
    # A stored (frozen) Y in a rotating pass: rotate its dequantized values.
    y_x = _stored_values(plan, y, y_res.q)
  # A float g against a reused partner in tiles: g . dequant(Y), one dot.
  dense = reuse and n > 1 and not raw.lhs.quantized and dense_tiles()
  if dense:
    n = 1
    a = Operand(g3, g_form, raw.lhs, noise, state=gst)
    b = Operand(dequantized(y_res.q, jnp.float32), flip(y_res.q.form))
  elif reuse:  # (g * s_Y) . q_Y, per tile of Y.
    g_s, _ = geometry.fold_scale(plan, side, g3, y_res.q, fy_axis, res.groups)
    a = Operand(g_s, g_form, raw.lhs, repeat_tiles(noise, n), state=gst)
    b = y_res.q.as_partner()
  else:  # Requantize Y, contracting its free axis.
    ynoise = canonical_noise(raw.rhs, residual_key(key), y.layout, y.form)
    y3 = y.layout.to_canonical(y_x, y.form)
    if t.transforms:  # The same R on both, along this pass's contraction.
      tkey = transform_key(key)
      g3 = t.apply(g3, k_axis(g_form), tkey, Slot.of(pass_, Side.LHS).path)
      y3 = t.apply(
        y3, k_axis(flip(y.form)), tkey, Slot.of(pass_, Side.RHS).path
      )
    b = Operand(y3, flip(y.form), raw.rhs, ynoise)
    a = Operand(g3, g_form, raw.lhs, noise, state=gst)
  emit = plan.grad_form(side)
  tile = plan.tile(pass_)
  if emit == 'fk':
    out, st, _ = geometry.qdot(plan, a, b, raw, tile, res.groups)
  else:
    out, _, st = geometry.qdot(plan, b, a, raw, tile, res.groups)
  z = y_res.q.partner_zero_point() if reuse and not dense else None
  if z is not None:
    out = out - geometry.reuse_term(
      plan, side, a.x, z, fy_axis, emit, res.groups
    )
  out = merge_tiles(out, n, emit)
  if reuse and plan.config.fwd.transform.transforms:
    # q_Y holds R^T y: this is the gradient of x R; map it back by R^T.
    out = plan.config.fwd.transform.inverse(out, k_axis(emit))
  return plan.operand(side).layout.from_canonical(out, emit), st


def backward(plan: Plan, res: Residuals, g):
  """(dL, dR, None, state cotangent): the custom VJP's backward rule.

  No gradient reaches a stored QTensor (None). The state cotangent holds
  the gradient operands' new stats and the forward operands' learned
  parameters' gradients (`slot_state`).
  """
  plan.check_transforms()  # The gradient passes' sizes (trace time).
  if plan.ragged:
    geometry.check_ragged(plan)
  grads, raw_grads, new = {}, {}, {}
  for side in SIDES:
    op = plan.operand(side)
    if op.stored:
      grads[side] = raw_grads[side] = None
      continue
    gslot = Slot.of(side.grad_pass, Side.LHS)
    st = res.state.get(gslot)
    gst = None
    if st is not None and st.stats is not None:
      gst = {'stats': st.stats, 'learned': st.learned}
    d, new[gslot] = operand_gradient(plan, side, res, g, gst)
    raw_grads[side] = d
    r = res.side(side)
    if r.mask is not None:
      d = prims.where(r.mask, d, 0.0)
    if r.decay is not None:
      d = d + r.decay.astype(d.dtype)
    grads[side] = match_vma(d.astype(op.dtype), op.vma)
  cot = {}
  for slot, st in res.state.items():
    if slot in GRADIENT_SLOTS and new.get(slot) is not None:
      cot[slot] = st._replace(
        stats=new[slot]['stats'], learned=new[slot]['learned']
      )
    elif slot.is_forward:
      r = res.side(slot.side)
      cot[slot] = learned_cotangent(
        plan, slot, st, r.learned, raw_grads[slot.side]
      )
    else:
      cot[slot] = st
  # Differentiating again raises.
  return (*first_order_only(grads[Side.LHS], grads[Side.RHS]), None, cot)
