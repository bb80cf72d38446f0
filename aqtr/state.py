"""Calibration state: build it, split its gradient, make the next state.

A config whose calibrations keep state (`delayed_scaling`, `ema_stats`,
`mean_absmax`) or learn parameters (`lsq`, `pact`) is called as
`out, new_state = aqtr.dot_general(..., config, state=state)`. The tree is
`{path: {'stats': {...}, 'learned': {...}}}` for the operand paths
('fwd.lhs', 'fwd.rhs', 'dlhs.lhs', 'drhs.lhs') that need it. Differentiate
the loss w.r.t. the state too: its "gradient" carries the backward passes'
new stats and the learned parameters' true gradient (the mechanism and its
reasons: `aqtr.core.slot_state`).

Example:
  >>> import jax, jax.numpy as jnp, aqtr
  >>> cfg = aqtr.presets.fp8_delayed(history_length=4)
  >>> dn = (((1,), (0,)), ((), ()))
  >>> x, w = jnp.ones((2, 8)), jnp.ones((8, 3))
  >>> s = aqtr.state.init(x, w, dn, cfg)
  >>> def loss(w, s):
  ...   out, new = aqtr.dot_general(x, w, dn, cfg, state=s)
  ...   return out.sum(), new
  >>> (l, new), (gw, gs) = jax.value_and_grad(
  ...     loss, argnums=(0, 1), has_aux=True)(w, s)
  >>> s = aqtr.state.merge(new, gs)
  >>> bool(s['dlhs.lhs']['stats']['history'][0].max() > 0)
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aqtr.core import slot_state
from aqtr.core.config import DotGeneralConfig
from aqtr.core.eager import compiled_when_eager
from aqtr.core.plan import Plan
from aqtr.core.qtensor import to_view
from aqtr.core.slots import GRADIENT_SLOTS, Side, Slot

__all__ = [
  'init',
  'learned',
  'merge',
  'merge_tree',
  'penalty',
  'split',
  'with_example_weights',
  'with_learned',
]

_BWD = tuple(s.path for s in GRADIENT_SLOTS)


@compiled_when_eager
def init(lhs, rhs, dimension_numbers, config: DotGeneralConfig) -> dict:
  """The initial state tree of one `aqtr.dot_general` call.

  Forward operands are initialised from their values (LSQ's step and
  PACT's clip read them); gradient operands from their shapes, which the
  call's plan gives (`core.plan.Plan.view`). Every other state (delayed
  scaling's history, EMA statistics, sparsity schedules) depends on the
  shapes only: `lhs` and `rhs` may then be `jax.ShapeDtypeStruct`s (to
  lower or export a stateful dot from shapes alone; `jax.eval_shape` gives
  the state's shapes for any config).

  Args:
    lhs, rhs: example operands: arrays, or `jax.ShapeDtypeStruct`s unless
      a forward calibration initialises from values (LSQ, PACT).
    dimension_numbers: of the dot.
    config: its DotGeneralConfig.

  Returns:
    {path: {'stats': {...}, 'learned': {...}}}; {} when nothing is stateful.

  Example:
    >>> import jax, jax.numpy as jnp, aqtr
    >>> x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    >>> w = jax.ShapeDtypeStruct((8, 3), jnp.float32)
    >>> dn = (((1,), (0,)), ((), ()))
    >>> s = init(x, w, dn, aqtr.presets.fp8_delayed(history_length=4))
    >>> s['fwd.lhs']['stats']['history'].shape
    (4, 1, 1, 1, 1)
  """
  lhs, rhs = _example(lhs), _example(rhs)
  slots = slot_state.calibrated_slots(config)
  scheduled = slot_state.scheduled_slots(config)
  if not (slots or scheduled):
    return {}
  plan = Plan.create(lhs, rhs, dimension_numbers, config)
  state = {}
  for slot in slots:
    x = None
    v = lhs if slot.side is Side.LHS else rhs
    if slot.is_forward and not isinstance(v, jax.ShapeDtypeStruct):
      op = plan.operand(slot.side)
      x3 = op.layout.to_canonical(v.astype(jnp.float32), op.form)
      x = to_view(x3, op.form, plan.fwd_tile)
    elif slot.is_forward and plan.tensor(slot).calibration.init_from_data:
      cal = type(plan.tensor(slot).calibration).__name__
      name = slot.side.value
      raise ValueError(
        f'aqtr.state.init: {name} is a jax.ShapeDtypeStruct, but {cal} '
        f'({slot.path}) initialises its state from the values; pass an '
        f'example array as {name} (jax.eval_shape(init, ...) gives the '
        'shapes only).'
      )
    state[slot] = slot_state.expected(plan, slot, x)
  for slot in scheduled:
    x = lhs if slot.side is Side.LHS else rhs
    st = state.get(slot, slot_state.SlotState())
    state[slot] = st._replace(schedule=slot_state.schedule_init(x))
  return slot_state.to_tree(state)


def _example(x):
  """An operand of `init`: a ShapeDtypeStruct as it is, else an array."""
  return x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x)


def split(state_grads: dict) -> tuple[dict, dict]:
  """(learned-parameter gradients, backward-pass new stats).

  Args:
    state_grads: the gradient of the loss w.r.t. the state tree.

  Returns:
    ({path: {name: gradient}} of the forward operands' learned parameters,
    {path: new stats} of the gradient operands).
  """
  _check_tree(state_grads, 'state_grads')
  grads = {p: v['learned'] for p, v in state_grads.items() if p not in _BWD}
  stats = {p: v['stats'] for p, v in state_grads.items() if p in _BWD}
  return grads, stats


def _check_tree(tree, name: str) -> None:
  """Raises unless `tree` is a state tree ({path: {'stats', 'learned'}})."""
  if not isinstance(tree, dict):
    raise TypeError(
      f'{name} must be a state tree {{path: {{"stats": ..., "learned": '
      f'...}}}} (aqtr.state.init, or its gradient), got {type(tree).__name__}.'
      ' Pass the gradient w.r.t. the state, not w.r.t. the weights.'
    )
  known = {s.path for s in Slot}
  known |= {s.schedule_path for s in Slot if s.is_forward}
  for p, v in tree.items():
    if p not in known:
      raise ValueError(
        f'{name}: {p!r} is not an operand path of a state tree; allowed: '
        f'{sorted(known)}. Is this a parameter tree?'
      )
    if not (isinstance(v, dict) and {'stats', 'learned'} <= set(v)):
      raise ValueError(
        f"{name}[{p!r}] must be {{'stats': ..., 'learned': ...}}, got "
        f'{type(v).__name__}.'
      )


def merge(new_state: dict, state_grads: dict) -> dict:
  """The next state: forward stats and learned parameters from `new_state`
  (the call's output), backward stats from `state_grads`."""
  _check_tree(new_state, 'new_state')
  _, bwd = split(state_grads)
  if set(state_grads) != set(new_state):
    raise ValueError(
      f'state_grads has the paths {sorted(state_grads)} but new_state has '
      f'{sorted(new_state)}: they come from different configs or calls; '
      'merge the output state of one call with the gradient w.r.t. the '
      'state given to that same call.'
    )
  out = dict(new_state)
  for p, st in bwd.items():
    want = jax.tree.structure(new_state[p]['stats'])
    if jax.tree.structure(st) != want or _shapes(st) != _shapes(
      new_state[p]['stats']
    ):
      raise ValueError(
        f'{p}: the stats in state_grads do not match new_state (got '
        f'{_shapes(st)}, expected {_shapes(new_state[p]["stats"])}); they '
        'come from different configs or dots.'
      )
    out[p] = {'stats': st, 'learned': new_state[p]['learned']}
  return out


def _shapes(tree):
  return jax.tree.map(lambda a: tuple(jnp.shape(a)), tree)


def merge_tree(updated, state_grads):
  """`merge` for a whole model's state: any pytree holding state trees.

  The Flax adapters keep each op's stats as `{path: stats}` (linen
  collection 'aqtr_state', nnx `CalibState` variables). After
  `grads = jax.grad(loss)(..., state_vars)` with the model's updated
  variables `updated`, the next state takes each leaf under a gradient
  path ('dlhs.lhs', 'drhs.lhs') from `state_grads` and every other leaf
  from `updated`.

  Args:
    updated: the state variables after the forward pass (e.g. the
      `mutable=['aqtr_state']` output of linen's apply).
    state_grads: the gradient of the loss w.r.t. the same variables.

  Returns:
    The next state, shaped like `updated`.
  """

  def pick(path, new, grad):
    keys = {getattr(k, 'key', getattr(k, 'name', None)) for k in path}
    return grad if keys & set(_BWD) else new

  return jax.tree_util.tree_map_with_path(pick, updated, state_grads)


def with_example_weights(state: dict, path: str, weights) -> dict:
  """`state` with the per-row weights of `path`'s `EmaStats` replaced.

  Args:
    state: a state tree (`init`) whose `path` (a forward lhs, e.g.
      'fwd.lhs') has `EmaStats(example_weights=True)`.
    path: the operand path.
    weights: one weight >= 0 per row of the lhs (its batch and free axes,
      e.g. [batch, seq] for [batch, seq, features] activations); 0 leaves
      a row (padding) out of the statistics. Negative, NaN or inf weights
      raise (concrete weights; traced ones are not checked).

  Returns:
    The new state tree (the input is not modified).
  """
  site = state.get(path)
  if site is None or 'weights' not in site['stats']:
    raise ValueError(
      f'{path}: no per-example weights in the state; use '
      "EmaStats(example_weights=True) on a forward lhs ('fwd.lhs')."
    )
  want = site['stats']['weights'].shape
  w = jnp.asarray(weights, jnp.float32)
  try:
    bad = bool(jnp.any(~(w >= 0) | ~jnp.isfinite(w)))
  except jax.errors.ConcretizationTypeError:
    bad = False  # Traced: unchecked (documented).
  if bad:
    raise ValueError(
      f'{path}: example weights must be finite and >= 0 (0 leaves a row out '
      f'of the statistics), got {w.ravel().tolist()[:8]}.'
    )
  if w.size != want[0] * want[2]:
    raise ValueError(
      f"{path}: weights of shape {w.shape} do not match the operand's "
      f'{want[0] * want[2]} rows (its batch and free axes).'
    )
  stats = dict(site['stats'], weights=w.reshape(want))
  return dict(state, **{path: dict(site, stats=stats)})


def learned(state: dict) -> dict:
  """{path: {name: value}}: the learned parameters (to an optimizer)."""
  return {p: v['learned'] for p, v in state.items() if v['learned']}


def with_learned(state: dict, params: dict) -> dict:
  """`state` with its learned parameters replaced by `params`."""
  out = dict(state)
  for p, v in params.items():
    out[p] = {'stats': state[p]['stats'], 'learned': v}
  return out


def penalty(config: DotGeneralConfig, state: dict) -> jax.Array:
  """The sum of the learned calibrations' regularisers (PACT's L2 on the
  clip), to add to the loss."""
  total = jnp.float32(0)
  _check_tree(state, 'state')
  calibrated = {s.path: s for s in slot_state.calibrated_slots(config)}
  for p in calibrated:
    if p not in state:
      raise ValueError(
        f'state has no entry {p!r}, which the config needs; pass the state '
        'of this config (aqtr.state.init(lhs, rhs, dn, config)).'
      )
  for p, v in state.items():
    if p not in calibrated:
      continue  # A sparsity schedule.
    cal = calibrated[p].tensor(config).calibration
    if hasattr(cal, 'penalty'):
      try:
        total = total + cal.penalty(v)
      except KeyError as e:
        raise ValueError(
          f'{p}: {type(cal).__name__}.penalty needs the learned parameter '
          f'{e}, but the state holds {sorted(v["learned"])}; pass the state '
          'of this config.'
        ) from None
  return total
