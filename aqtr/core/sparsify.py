"""Pruning an operand before it is quantized (`TensorConfig.sparsity`).

Math: `x_s = M * x` with `M = sparsity.mask(x3, axis)`, computed on the
operand in the canonical layout the dot sees it in ([B, F, K] or
[B, K, F], `axis` its contraction K). The engine prunes the forward
operands once, at the start of the forward pass, so `x_s` is what every
pass sees (the forward dot and the backward residuals) and `Q(x_s)` is
what is stored and served. Gradient: straight-through to the dense `x`,
plus `decay * (1 - M) * x` with SR-STE (`Sparsity.decay > 0`; Zhou et al.
2021, arXiv 2102.04010), added by the custom VJP after the numerics'
gradient mask. That term does not depend on the output's cotangent: it is
added once per call whose VJP is taken (accumulating k micro-batches adds
it k times; scale `decay` accordingly).

Schedule: with `start_step > 0` or `update_step > 1` the mask is state
(`Schedule`, the `schedule` field of the operand's `SlotState`; spelled
'fwd.<side>.sparsity' in the user-facing tree, `aqtr.state`): a float32
0/1 mask and a step counter; the forward pass returns the next one
(`scheduled_prune`).

Internal API (used by `forward.py`, `operand.py`, `quantizer.py`,
`slot_state.py`): `Schedule`, `prune`, `decay_term`, `prune_operand`,
`scheduled_prune`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from aqtr.core.config import TensorConfig
from aqtr.core.dimension_numbers import OperandLayout
from aqtr.core.slots import Slot


class Schedule(NamedTuple):
  """A forward operand's sparsity schedule: the mask held and the step.

  Both float32 (a differentiable input of the VJP, like all state).
  """

  mask: jax.Array
  step: jax.Array


def _mask(x, t: TensorConfig, layout: OperandLayout, form: str, path: str):
  """The keep-mask of `x` (in its own layout) along the contraction."""
  try:
    t.sparsity.check_size(layout.k)
  except ValueError as e:
    raise ValueError(f'{path}.sparsity: {e}') from None
  x3 = layout.to_canonical(x, form).astype(jnp.float32)
  m3 = t.sparsity.mask(x3, 2 if form == 'fk' else 1)
  return layout.from_canonical(m3, form)


def prune(
  x: jax.Array,
  t: TensorConfig,
  layout: OperandLayout,
  form: str,
  path: str,
) -> tuple[jax.Array, jax.Array | None]:
  """(x_s, keep-mask or None) of one float operand.

  Args:
    x: the operand in its own layout.
    t: its TensorConfig (`t.sparsity` applies; 'none' returns `x`, None).
    layout: its OperandLayout in the dot.
    form: the canonical form the mask is computed in ('fk' / 'kf').
    path: e.g. 'config.fwd.rhs', for error messages.
  """
  if not t.sparse:
    return x, None
  mask = _mask(x, t, layout, form, path)
  return jnp.where(mask, x, jnp.zeros_like(x)), mask


def decay_term(
  x: jax.Array, t: TensorConfig, mask: jax.Array | None
) -> jax.Array | None:
  """SR-STE: `decay * (1 - M) * x`, added to x's gradient; None if unused."""
  if mask is None or not t.sparsity.decay:
    return None
  term = jnp.where(mask, jnp.zeros_like(x), x)
  return (t.sparsity.decay * term).astype(x.dtype)


def prune_operand(plan, side, x, schedule=None):
  """(x_s, keep-mask or None, SR-STE term or None, new schedule or None).

  One forward operand (`side`) of the dot `plan` describes, pruned in the
  form it is quantized in. A sparsity with a schedule (`has_schedule`)
  holds its mask in `schedule` (`slot_state.Schedule`) and returns the
  next one. A stored QTensor (pruned when made) is returned as it is.
  """
  slot = Slot.forward(side)
  t = plan.tensor(slot)
  op = plan.operand(side)
  if op.stored or not t.sparse:
    return x, None, None, None
  path = f'config.{slot.path}'
  new = None
  if schedule is not None:
    x_s, mask, new = scheduled_prune(x, t, op.layout, op.form, path, schedule)
  else:
    x_s, mask = prune(x, t, op.layout, op.form, path)
  return x_s, mask, decay_term(x, t, mask), new


# ------------------------------------------------------------------ schedule


def scheduled_prune(
  x: jax.Array,
  t: TensorConfig,
  layout: OperandLayout,
  form: str,
  path: str,
  schedule: Schedule,
) -> tuple[jax.Array, jax.Array, Schedule]:
  """(x_s, mask, new schedule): the mask as the schedule says at its step.

  Before `start_step` the mask is dense; at `start_step + j * update_step`
  it is made from `x`; in between the stored one is held. The new
  schedule holds the mask used and the next step.
  """
  s = t.sparsity
  step = schedule.step
  held = schedule.mask > 0.5
  fresh = _mask(x, t, layout, form, path)
  active = step >= s.start_step
  since = jnp.maximum(step - s.start_step, 0.0)
  refresh = active & (jnp.mod(since, float(s.update_step)) == 0)
  mask = jnp.where(refresh, fresh, held) | ~active
  new = Schedule(mask.astype(jnp.float32), step + 1.0)
  return jnp.where(mask, x, jnp.zeros_like(x)), mask, new
