"""The forward pass of the quantized dot: quantize each operand once,
contract, keep the residuals.

  out[b, m, n] = sum_j (q_L[b, j, m, :] . q_R[b, j, n, :]) s_L[b,j,m] s_R[b,j,n]

Each forward operand is pruned by its sparsity (`core.sparsify`), then
quantized in the form the plan gives it (calibration -> scale -> numerics
-> rounding; a stored QTensor is checked and used as it is), contracted by
the one contraction core (`passes.contract`), and kept as a residual: its
q where the other operand's gradient pass reuses it, else its float value.

Internal API (used by `dot_general.py` and `operand.py`):
`forward_operand`, `forward`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from aqtr.core import geometry
from aqtr.core.boundary import fusion_boundary
from aqtr.core.passes import (
  Operand,
  QuantizedOperand,
  canonical_noise,
  k_axis,
  quantize_tiled,
  slot_keys,
)
from aqtr.core.plan import Plan
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import scale_problems
from aqtr.core.residuals import Residuals, SideResidual
from aqtr.core.sharding import keep_on_shards
from aqtr.core.slot_state import SlotState
from aqtr.core.slots import SIDES, Side, Slot
from aqtr.core.sparsify import prune_operand


def _stored_operand(plan: Plan, side: Side, x: QTensor) -> QuantizedOperand:
  """A stored QTensor as a forward operand, checked against the plan."""
  slot = Slot.forward(side)
  cfg = plan.tensor(slot)
  op = plan.operand(side)
  numerics = cfg.numerics
  view = plan.view(slot)
  problems = []
  if not cfg.quantized:
    problems.append(f'config.{slot.path} is not quantized')
  elif jnp.dtype(x.qvalue.dtype) != jnp.dtype(numerics.dtype):
    problems.append(
      f'qvalue dtype {x.qvalue.dtype} != config numerics dtype {numerics.dtype}'
    )
  natural = 'fk' if side is Side.LHS else op.layout.natural_form()
  # A rhs may also be stored with its contraction minor ('fk').
  if x.form not in {natural, 'fk'}:
    problems.append(f"layout {x.layout}/{x.form} != the dot's form {natural}")
  if tuple(x.qvalue.shape) != view:
    problems.append(f'qvalue shape {x.qvalue.shape} != expected {view}')
  rotated = cfg.transform if cfg.rotated else None
  if x.transform != rotated:
    problems.append(
      f'it was frozen with transform {x.transform!r}, but '
      f'config.{slot.path}.transform is {rotated!r} (freeze it with the '
      "dot's config)"
    )
  if numerics.asymmetric != (x.zero_point is not None):
    problems.append('zero_point missing or unexpected for the numerics')
  if x.scale is None or jnp.ndim(x.scale) != 4:
    problems.append('scale missing or not in the tiled view')
  elif cfg.quantized:
    problems += scale_problems(x.scale, view, cfg, x.form)
  if problems:
    raise ValueError(
      f'the QTensor given as {side.value} does not match this dot and '
      'config: ' + '; '.join(problems) + '. Quantize it with '
      'aqtr.quantize_operand(x, dimension_numbers, config, operand=...) '
      'using the same config and dimension numbers.'
    )
  dot_dtype = jnp.dtype(numerics.dot_dtype)
  packed = x.packed if x.form == 'fk' and x.qvalue.dtype == jnp.int4 else None
  if packed is not None and packed.shape != (*view[:-1], view[-1] // 2):
    packed = None  # Not the qvalue's bytes: the dot reads qvalue.
  return QuantizedOperand(
    x.qvalue, x.scale, None, x.form, dot_dtype, x.zero_point, packed=packed
  )


def forward_operand(plan: Plan, side: Side, x, key, st: SlotState | None):
  """One forward operand quantized in its form (`st`: its state or None).

  A float `x` is quantized with `config.fwd.<side>` (noise drawn from
  `key`); a stored QTensor is checked against the plan and used as it is.
  """
  if isinstance(x, QTensor):
    return _stored_operand(plan, side, x)
  slot = Slot.forward(side)
  cfg = plan.tensor(slot)
  op = plan.operand(side)
  state = None
  if st is not None and st.stats is not None:
    state = {'stats': st.stats, 'learned': st.learned}
  x3 = op.layout.to_canonical(x, op.form)
  if cfg.rotated:  # x R (lhs) / R^T w (rhs) along K: the product is kept.
    x3 = cfg.transform.apply(x3, k_axis(op.form), None, slot.path)
  noise = canonical_noise(cfg, key, op.layout, op.form)
  operand = Operand(x3, op.form, cfg, noise, None, state)
  return quantize_tiled(operand, plan.fwd_tile)


def _pinned(
  q: dict, transpose_lhs: bool, conditional: bool
) -> tuple[dict, tuple | None]:
  """({side: q} with the scales and zero points behind a fusion boundary,
  (q_L's values, q_L^T) written by it or None).

  Training computes them from the float operands, serving loads them:
  from here on both programs run the same code on the same arrays (the
  contraction's rescale and tile sum), which XLA then fuses alike. One
  boundary for both sides (each one costs compile time), which also
  writes q_L^T for the weight gradient when `transpose_lhs`;
  `conditional`: the differentiated forward's (cheaper to compile), else
  a loop (faster in a decoding step; `boundary.fusion_boundary`).
  """
  sides = [s for s in SIDES if q[s].scale is not None]
  parts = [(q[s].scale, q[s].zero_point) for s in sides]
  copied = None
  if transpose_lhs:
    parts, values, values_t = fusion_boundary(
      parts, q[Side.LHS].values, conditional=conditional
    )
    copied = None if values_t is None else (values, values_t)
  else:
    parts = fusion_boundary(parts, conditional=conditional)
  out = dict(q)
  for s, (scale, zero_point) in zip(sides, parts, strict=True):
    out[s] = dataclasses.replace(q[s], scale=scale, zero_point=zero_point)
  return out, copied


def _residual(plan: Plan, side: Side, x, q, kept, key, decay):
  """What the backward keeps of one forward operand: `x` or `kept` (q, or
  q_L^T for a [K, N] weight's drhs), q's mask and learned derivatives,
  the gradient pass's `key` and the SR-STE term `decay`."""
  op = plan.operand(side)
  quantized = q.scale is not None
  # A rotated forward passes the gradient straight through, unmasked.
  masked = quantized and not plan.tensor(Slot.forward(side)).rotated
  return SideResidual(
    x=None if op.reused else x,
    q=kept.without_mask() if op.reused else None,
    mask=q.grad_mask(op.layout) if masked else None,
    key=key,
    decay=decay,
    learned=q.learned if quantized else None,
  )


def forward(
  plan: Plan, lhs, rhs, key, state: dict, residuals: bool = True, groups=None
):
  """((out, new_state), Residuals) of the quantized forward dot.

  `residuals=False` (the primal call, no VJP): no residuals (None), and
  no transposed copy of q_L written for them. `groups`: a ragged plan's
  group sizes (`core.geometry`).
  """
  keys = slot_keys(key)
  xs, decay, new = {}, {}, dict(state)
  for side, x in zip(SIDES, (lhs, rhs), strict=True):
    slot = Slot.forward(side)
    st = state.get(slot)
    sched = None if st is None else st.schedule
    xs[side], _, decay[side], sched = prune_operand(plan, side, x, sched)
    if sched is not None:
      new[slot] = new[slot]._replace(schedule=sched)
  grad_keys = {s: keys.get(Slot.of(s.grad_pass, Side.LHS)) for s in SIDES}
  if not plan.quantizes_forward:
    out = geometry.float_dot(plan, xs[Side.LHS], xs[Side.RHS], groups)
    res = {
      s: SideResidual(x=xs[s], key=grad_keys[s], decay=decay[s]) for s in SIDES
    }
    return (out, new), Residuals(res[Side.LHS], res[Side.RHS], state, groups)
  q = {
    s: forward_operand(
      plan, s, xs[s], keys.get(Slot.forward(s)), state.get(Slot.forward(s))
    )
    for s in SIDES
  }
  transpose_lhs = plan.transposed_lhs and residuals
  q, copied = _pinned(keep_on_shards(q, plan), transpose_lhs, residuals)
  kept = dict(q)
  if transpose_lhs:
    q[Side.LHS], kept[Side.LHS] = q[Side.LHS].with_transposed(copied)
  out = geometry.contract(
    plan, q[Side.LHS], q[Side.RHS], plan.config.fwd, groups
  )
  for s in SIDES:
    slot = Slot.forward(s)
    if slot in state and q[s].state is not None:
      new[slot] = new[slot]._replace(
        stats=q[s].state['stats'], learned=q[s].state['learned']
      )
  out = out.reshape(plan.out_shape).astype(plan.out_dtype)
  if not residuals:
    return (out, new), None
  res = {
    s: _residual(plan, s, xs[s], q[s], kept[s], grad_keys[s], decay[s])
    for s in SIDES
  }
  return (out, new), Residuals(res[Side.LHS], res[Side.RHS], state, groups)
