"""Freezing one operand: quantize it exactly as a dot's forward pass would.

A QTensor made here can replace the float operand of `aqtr.dot_general` /
`aqtr.einsum` with bit-identical output (serving frozen weights).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import is_ragged
from aqtr.core.forward import forward_operand
from aqtr.core.passes import slot_keys
from aqtr.core.plan import Plan
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import check_float
from aqtr.core.rounding import as_typed_key
from aqtr.core.slot_state import SlotState, has_schedule, is_stateful
from aqtr.core.slots import Side, Slot
from aqtr.core.sparsify import Schedule, prune_operand


def quantize_operand(
  x: jax.Array,
  dimension_numbers,
  config: DotGeneralConfig,
  *,
  operand: str = 'rhs',
  other_shape=None,
  key: jax.Array | None = None,
  state: dict | None = None,
) -> QTensor:
  """Quantizes one operand exactly as the forward pass of `config` would.

  The result can be stored (e.g. frozen int8 weights) and passed to
  `dot_general` in place of the float operand: the output is bit-identical
  to running the float operand through the same config (pruned by its
  sparsity first, as the forward pass does).

  Args:
    x: the float operand.
    dimension_numbers: of the dot it will be used in (`aqtr.RAGGED` for
      `aqtr.ragged_dot`'s expert weights [G, K, N]).
    config: the DotGeneralConfig of that dot (its fwd.<operand> applies).
    operand: 'lhs' or 'rhs'.
    other_shape: shape of the other operand; default: inferred as needed
      (only the contraction/batch sizes matter, taken from `x`).
    key: PRNG key if the forward rounding is stochastic.
    state: with a stateful or learned calibration, the operand's state
      (`aqtr.state.init(...)['fwd.<operand>']`): frozen with the bound the
      forward pass uses at that state (LSQ's learned step, the delayed
      history's max). Required for a stateful calibration.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> dn = (((1,), (0,)), ((), ()))
    >>> w = aqtr.quantize_operand(jnp.ones((8, 2)), dn, aqtr.presets.int8())
    >>> aqtr.dot_general(jnp.ones((4, 8)), w, dn, aqtr.presets.int8())[0]
    Array([8., 8.], dtype=float32)
  """
  if operand not in ('lhs', 'rhs'):
    raise ValueError(f"operand must be 'lhs' or 'rhs', got {operand!r}.")
  if not isinstance(config, DotGeneralConfig):
    raise TypeError(f'config must be an aqtr.DotGeneralConfig, got {config!r}.')
  x = jnp.asarray(x)
  check_float(x, 'x')
  if other_shape is None and is_ragged(dimension_numbers):
    # Expert weights [G, K, N]: tokens [1, K] (lhs tokens: one expert).
    k = jnp.shape(x)[1] if jnp.ndim(x) > 1 else 1
    other_shape = (1, k) if operand == 'rhs' else (1, k, 1)
  if other_shape is None:  # A stand-in partner with matching sizes.
    (lc, rc), (lb, rb) = dimension_numbers
    mine, theirs = (
      ((lc, lb), (rc, rb)) if operand == 'lhs' else ((rc, rb), (lc, lb))
    )
    nd = len(theirs[0]) + len(theirs[1])
    other_shape = [1] * max(nd, 1 + max((*theirs[0], *theirs[1], -1)))
    for a, b in zip(
      (*mine[0], *mine[1]), (*theirs[0], *theirs[1]), strict=True
    ):
      other_shape[b] = x.shape[a]
  partner = jax.ShapeDtypeStruct(tuple(other_shape), x.dtype)
  pair = (x, partner) if operand == 'lhs' else (partner, x)
  plan = Plan.create(*pair, dimension_numbers, config)
  _check_state(plan.tensor(Slot.forward(Side(operand))), operand, state)
  return quantize_planned(x, plan, Side(operand), key=key, state=state)


def _check_state(t, operand: str, state) -> None:
  """One line when `state` does not fit the operand's calibration."""
  path = f'fwd.{operand}'
  init = f"aqtr.state.init(lhs, rhs, dimension_numbers, config)['{path}']"
  if state is None:
    if is_stateful(t):
      raise ValueError(
        f'quantize_operand: config.{path} calibrates with '
        f'{type(t.calibration).__name__}, which keeps state; pass '
        f'state={init} (or the trained state) to freeze it as the '
        'forward pass does at that state.'
      )
    return
  if not isinstance(state, Mapping) or not {'stats', 'learned'} <= set(state):
    hint = (
      f'the whole state tree; pass state[{path!r}]'
      if isinstance(state, Mapping) and path in state
      else f'{_keys(state)}; pass {init}'
    )
    raise ValueError(
      "quantize_operand: state must be the operand's entry {'stats': ..., "
      f"'learned': ...}}, got {hint}."
    )


def _keys(state) -> str:
  if isinstance(state, Mapping):
    return f'keys {sorted(map(str, state))}'
  return type(state).__name__


def quantize_planned(
  x: jax.Array,
  plan: Plan,
  side: Side,
  *,
  key: jax.Array | None = None,
  state: Mapping | None = None,
  schedule: Mapping | None = None,
) -> QTensor:
  """`quantize_operand` for a dot whose plan is known (the freezers'
  `DotCall` makes it once per call); `x` is the float `side` operand.

  Args:
    x: the float operand.
    plan: the dot's Plan.
    side: which forward operand `x` is.
    key: PRNG key if the forward rounding is stochastic.
    state: the operand's calibration state (its `aqtr.state.init` entry
      'fwd.<side>': {'stats', 'learned'}) when its calibration is stateful.
    schedule: its sparsity schedule's entry ('fwd.<side>.sparsity'):
      pruned with the mask the forward pass uses at that state; None: a
      mask made from `x`.
  """
  slot = Slot.forward(side)
  t = plan.tensor(slot)
  if not t.quantized:
    raise ValueError(f'config.{slot.path} is not quantized; nothing to freeze.')
  if not has_schedule(t):
    schedule = None  # The mask is made from `x`.
  st = SlotState(
    stats=None if state is None else state['stats'],
    learned=None if state is None else state['learned'],
    schedule=None if schedule is None else Schedule(**schedule['stats']),
  )
  return _quantize_jit(x, as_typed_key(key), st, plan=plan, side=side)


@functools.partial(jax.jit, static_argnames=('plan', 'side'))
def _quantize_jit(x, key, st: SlotState, *, plan: Plan, side: Side) -> QTensor:
  """Jitted like the engine's forward pass, so that XLA simplifies the
  scale arithmetic identically (an eager op-by-op run can differ by an ulp
  from the compiled one, and frozen weights must equal TRAIN's bit for
  bit)."""
  x, _, _, _ = prune_operand(plan, side, x, st.schedule)
  key = slot_keys(key).get(Slot.forward(side))
  q = forward_operand(plan, side, x, key, st)
  op = plan.operand(side)
  t = plan.tensor(Slot.forward(side))
  rotated = t.transform if t.rotated else None
  return QTensor(q.values, q.scale, op.layout, op.form, q.zero_point, rotated)
