"""Calibration state and sparsity schedules as typed pytrees, per slot.

A calibration may keep state across steps (an amax history, running
statistics) and learned parameters (an LSQ step, a PACT clip); a sparsity
may hold its mask for some steps (a schedule). Configs stay hashable and
hold no state: the state is an explicit pytree argument of
`aqtr.dot_general(..., state=s)`, which then returns `(out, new_state)`.

Inside the engine the state is `{Slot: SlotState}` with typed fields:

  SlotState.stats     the calibration's statistics (its `init_state`)
  SlotState.learned   the calibration's learned parameters
  SlotState.schedule  a forward operand's sparsity `Schedule(mask, step)`

The user-facing tree (`aqtr.state`) spells the same thing with path keys
made by `Slot`: `{'fwd.lhs': {'stats': ..., 'learned': ...},
'fwd.rhs.sparsity': {'stats': {'mask', 'step'}, 'learned': {}}}`;
`from_tree` / `to_tree` convert at the boundary (pure restructuring). The
shapes every slot's state must have come from the plan (`Plan.view`), so
`aqtr.state.init` needs no trace of the backward pass.

The mechanism ("the cotangent carries the backward state"). The state is
a differentiable input of the one custom VJP, and:

  forward   out, new_state = dot(...): the forward operands' stats (and
            schedules) are updated in `new_state` (a primal output);
  backward  the cotangent returned for the state input holds, per slot,
            the gradient operands' NEW stats (dlhs.lhs, drhs.lhs: the
            gradient amax history is only known there) and, for the
            forward operands, the true gradient of the learned parameters
            (zeros for their stats and schedules).

`aqtr.state.split(state_grads)` separates the two; `aqtr.state.merge`
builds the next state. Why this and not a side channel: the backward state
leaves the VJP by the only pure road JAX has, so it works unchanged under
jit, scan, remat, vmap and sharding, and needs no mutable collection. It
is MaxText's "overwrite with gradient" made explicit and typed. Contract:
each state leaf feeds exactly one dot_general call (a shared leaf's
cotangents would add up) and the caller differentiates the loss w.r.t. the
state (else the backward stats are lost; documented, not an error).

Learned parameters get their real gradient from the same VJP: a learned
calibration gives `h = d xhat / d param` per element and the mask of its
own straight-through rule; d loss / d param = grad_scale * sum_G (dL/dxhat
* h), where dL/dxhat is the (unmasked) operand gradient.

Internal API: `SlotState`, `calibrated_slots`,
`scheduled_slots`, `from_tree`, `to_tree`, `expected`, `check_state`,
`learned_cotangent`, `is_stateful`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from aqtr.core.algorithms import StatefulCalibration
from aqtr.core.config import DotGeneralConfig, TensorConfig
from aqtr.core.qtensor import to_view
from aqtr.core.quantizer import calibration_view
from aqtr.core.slots import SIDES, Slot
from aqtr.core.sparsify import Schedule


class SlotState(NamedTuple):
  """The state of one operand slot (None: the slot keeps none of it)."""

  stats: Mapping | None = None
  learned: Mapping | None = None
  schedule: Schedule | None = None


def is_stateful(t: TensorConfig) -> bool:
  return t.quantized and isinstance(t.calibration, StatefulCalibration)


def has_schedule(t: TensorConfig) -> bool:
  """Whether the operand's sparsity mask needs state (start or hold)."""
  s = t.sparsity
  return s.prunes and (s.start_step > 0 or s.update_step > 1)


def calibrated_slots(
  config: DotGeneralConfig | None, stored=(False, False)
) -> tuple[Slot, ...]:
  """The slots of `config` whose calibration keeps state.

  A forward operand given as a stored QTensor (`stored`: lhs, rhs) is not
  quantized by the call, so its slot needs none.

  Raises:
    ValueError: a stateful calibration where none is supported (a
      requantized backward residual) or a learned one off the forward pass.
  """
  if config is None:
    return ()
  out = []
  for slot in Slot:
    t = slot.tensor(config)
    raw = getattr(config, slot.pass_.value)
    if not is_stateful(t) or (not slot.is_forward and not raw.quantized):
      continue
    if slot.is_forward and stored[SIDES.index(slot.side)]:
      continue
    name = type(t.calibration).__name__
    if not slot.is_forward and not slot.is_gradient:
      if raw.use_fwd_quant:
        continue  # Unused: the forward quantization is reused.
      raise ValueError(
        f'{slot.path}: a stateful calibration ({name}) on a requantized '
        'backward residual is not supported; set use_fwd_quant=True or use '
        'a stateless calibration there.'
      )
    if t.calibration.has_learned and not slot.is_forward:
      allowed = [s.path for s in Slot if s.is_forward]
      raise ValueError(
        f'{slot.path}: {name} learns parameters, which only forward '
        f'operands can; allowed paths: {allowed}.'
      )
    if t.numerics.asymmetric:
      raise ValueError(
        f'{slot.path}.calibration: {name} is stateful and gives a '
        f'symmetric bound; numerics {type(t.numerics).__name__} is '
        'asymmetric and needs a range; allowed: a stateless calibration.'
      )
    out.append(slot)
  return tuple(out)


def scheduled_slots(
  config: DotGeneralConfig | None, stored=(False, False)
) -> tuple[Slot, ...]:
  """The forward slots whose sparsity has a schedule (stored: none)."""
  if config is None:
    return ()
  return tuple(
    Slot.forward(side)
    for side, is_stored in zip(SIDES, stored, strict=True)
    if not is_stored and has_schedule(Slot.forward(side).tensor(config))
  )


def paths(config: DotGeneralConfig | None, stored=(False, False)) -> list:
  """Every key of a call's user-facing state tree, in order."""
  return [s.path for s in calibrated_slots(config, stored)] + [
    s.schedule_path for s in scheduled_slots(config, stored)
  ]


# ------------------------------------------------------------ the boundary


def from_tree(tree: Mapping) -> dict:
  """The user-facing tree (checked by `check_tree`) as {Slot: SlotState}."""
  out = {}
  for slot in Slot:
    entry, sched = tree.get(slot.path), tree.get(slot.schedule_path)
    if entry is None and sched is None:
      continue
    out[slot] = SlotState(
      stats=None if entry is None else entry['stats'],
      learned=None if entry is None else entry['learned'],
      schedule=None if sched is None else Schedule(**sched['stats']),
    )
  return out


def to_tree(state: Mapping) -> dict:
  """{Slot: SlotState} as the user-facing tree (`from_tree`'s inverse)."""
  out = {}
  for slot, st in sorted(state.items()):
    if st.stats is not None:
      out[slot.path] = {'stats': st.stats, 'learned': st.learned}
    if st.schedule is not None:
      out[slot.schedule_path] = {
        'stats': dict(st.schedule._asdict()),
        'learned': {},
      }
  return out


def _needs_state_message(config, first: str) -> str:
  for slot in scheduled_slots(config):
    if slot.schedule_path == first:
      return (
        f'config.{first}: {slot.tensor(config).sparsity!r} has a schedule '
        '(start_step > 0 or update_step > 1) and needs its mask state'
      )
  cal = type(Slot.parse(first).tensor(config).calibration).__name__
  return f'{first}: calibration {cal} is stateful and needs state'


def check_tree(
  config: DotGeneralConfig | None, tree, stored, dims='dimension_numbers'
) -> None:
  """Raises a clear error when `tree`'s keys do not match `config`
  (`dims`: how the error spells the dot's dimension numbers)."""
  want = paths(config, stored)
  if tree is None:
    if want:
      raise ValueError(
        f'{_needs_state_message(config, want[0])}: pass '
        f'state=aqtr.state.init(lhs, rhs, {dims}, config) and use '
        'the returned (out, new_state).'
      )
    return
  if not isinstance(tree, Mapping):
    raise TypeError(
      f'state must be a dict from aqtr.state.init, got {type(tree)}.'
    )
  missing = [p for p in want if p not in tree]
  extra = [p for p in tree if p not in want]
  for side, is_stored in zip(SIDES, stored, strict=True):
    slot = Slot.forward(side)
    if is_stored and slot.path in extra:
      cal = type(slot.tensor(config).calibration).__name__
      raise ValueError(
        f'{slot.path}: the operand is a stored QTensor (frozen, as in '
        f'SERVE), so its calibration {cal} has nothing to update or learn; '
        f'drop {slot.path!r} from the state (its frozen scale already holds '
        'it).'
      )
  if missing or extra:
    raise ValueError(
      f'state paths {sorted(tree)} do not match the config: missing '
      f'{missing}, unexpected {extra}; expected exactly {want}.'
    )
  for p in want:
    entry = tree[p]
    if not (isinstance(entry, Mapping) and {'stats', 'learned'} <= set(entry)):
      raise ValueError(
        f"{p}: malformed state entry {entry!r}; expected {{'stats': ..., "
        "'learned': ...}} as made by aqtr.state.init."
      )


# ------------------------------------------------------------------ shapes


def expected(plan, slot: Slot, x=None) -> SlotState:
  """The state `slot` starts with (arrays when `x`, the forward operand's
  view, is given; else ShapeDtypeStructs)."""
  t = plan.tensor(slot)
  shape, axes = calibration_view(plan.view(slot), t, plan.form(slot))
  cal = t.calibration

  def init(v):
    full = cal.init_state(v, axes, t.numerics)
    return SlotState(full['stats'], full['learned'])

  if x is not None:
    return init(x.reshape(shape))
  struct = jax.ShapeDtypeStruct(shape, jnp.float32)
  if cal.init_from_data:
    return jax.eval_shape(init, struct)
  return jax.tree.map(jnp.asarray, init(struct))


def _shapes(tree):
  return jax.tree.map(lambda a: (tuple(jnp.shape(a)), jnp.result_type(a)), tree)


def check_state(plan, state: Mapping) -> None:
  """Raises when a slot's state has other shapes than `plan` gives it."""
  for slot, st in state.items():
    if st.stats is not None:
      cal = type(plan.tensor(slot).calibration).__name__
      want = jax.eval_shape(lambda s=slot: expected(plan, s))
      got = SlotState(st.stats, st.learned)
      try:
        got_s = _shapes(got)
      except Exception as e:  # noqa: BLE001 - any malformed tree.
        raise ValueError(f'{slot.path}: malformed state {got!r}.') from e
      want_s = _shapes(want)
      if jax.tree.structure(got) != jax.tree.structure(want) or (
        got_s != want_s
      ):
        raise ValueError(
          f'{slot.path}: state of {cal} has the wrong shape: got '
          f'{got_s}, expected {want_s}; build it with aqtr.state.init for '
          'this dot and config.'
        )
    if st.schedule is not None:
      shape = plan.operand(slot.side).layout.shape
      got = tuple(jnp.shape(st.schedule.mask))
      if got != shape or jnp.shape(st.schedule.step) != ():
        raise ValueError(
          f'{slot.schedule_path}: the schedule state was made for an '
          f'operand of shape {got}, but this {slot.side.value} has shape '
          f'{shape}; build it with aqtr.state.init for this dot.'
        )


def schedule_init(x) -> Schedule:
  """A dense mask (1.0) shaped like `x` and step 0."""
  return Schedule(
    jnp.ones(jnp.shape(x), jnp.float32), jnp.zeros((), jnp.float32)
  )


# ---------------------------------------------------------------- backward


def learned_cotangent(plan, slot: Slot, st: SlotState, learned, d_raw):
  """A forward slot's cotangent: its learned parameters' gradient; zeros
  for its stats and schedule.

  d loss / d p = grad_scale * sum_G (dL/dxhat * d xhat / d p), with
  dL/dxhat the unmasked operand gradient `d_raw`, brought to the view.
  """
  zeros = jax.tree.map(jnp.zeros_like, st)
  if learned is None or d_raw is None:
    return zeros
  t = plan.tensor(slot)
  op = plan.operand(slot.side)
  d3 = op.layout.to_canonical(d_raw.astype(jnp.float32), op.form)
  d4 = to_view(d3, op.form, plan.fwd_tile)
  _, axes = calibration_view(d4.shape, t, op.form)
  group = math.prod(d4.shape[a] for a in axes)
  factor = t.calibration.grad_scale(group, t.numerics)
  grads = {
    name: (jnp.sum(d4 * h, axis=axes, keepdims=True) * factor).reshape(
      st.learned[name].shape
    )
    for name, h in learned.items()
  }
  return zeros._replace(learned=grads)
