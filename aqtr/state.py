"""Calibration state: build it, split its gradient, make the next state.

A config whose calibrations keep state (`delayed_scaling`, `ema_stats`,
`mean_absmax`) or learn parameters (`lsq`, `pact`) is called as
`out, new_state = aqtr.dot_general(..., config, state=state)`. The tree is
`{path: {'stats': {...}, 'learned': {...}}}` for the operand paths
('fwd.lhs', 'fwd.rhs', 'dlhs.lhs', 'drhs.lhs') that need it. Differentiate
the loss w.r.t. the state too: its "gradient" carries the backward passes'
new stats and the learned parameters' true gradient (the mechanism and its
reasons: `aqtr.core.stateful`).

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

from aqtr.core import stateful
from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import DotLayout
from aqtr.core.dot_general import raw_qdot
from aqtr.core.engine_state import (
  sparsity_paths,
  stateful_paths,
  tensor_config,
)
from aqtr.core.passes import common_tile
from aqtr.core.qtensor import ROLE_AXES, to_view
from aqtr.core.sparsify import SITE, schedule_init

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

_BWD = ('dlhs.lhs', 'drhs.lhs')


def _axes(t, form: str) -> tuple[int, ...]:
  return tuple(sorted(ROLE_AXES[form][r] for r in t.tiling.shared))


def init(lhs, rhs, dimension_numbers, config: DotGeneralConfig) -> dict:
  """The initial state tree of one `aqtr.dot_general` call.

  Forward operands are initialised from their values (LSQ's step and
  PACT's clip read them); gradient operands from their shapes, found by
  tracing the backward pass abstractly.

  Args:
    lhs, rhs: example operands (shapes and, for learned inits, values).
    dimension_numbers: of the dot.
    config: its DotGeneralConfig.

  Returns:
    {path: {'stats': {...}, 'learned': {...}}}; {} when nothing is stateful.
  """
  paths = stateful_paths(config)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  lay = DotLayout.create(lhs.shape, rhs.shape, dimension_numbers)
  tile = common_tile([config.fwd.lhs, config.fwd.rhs], lay.lhs.k)
  state = {}
  for path in sparsity_paths(config):  # Schedules: a dense mask, step 0.
    x = lhs if path == SITE.format(side='lhs') else rhs
    state[path] = {'stats': schedule_init(x), 'learned': {}}
  for path, x, layout, form in (
    ('fwd.lhs', lhs, lay.lhs, 'fk'),
    ('fwd.rhs', rhs, lay.rhs, lay.rhs.natural_form()),
  ):
    if path in paths:
      t = tensor_config(config, path)
      x4 = to_view(layout.to_canonical(x, form), form, tile)
      state[path] = t.calibration.init_state(
        x4.astype(jnp.float32), _axes(t, form), t.numerics
      )
  if not any(p in paths for p in _BWD):
    return state

  def backward(a, b):
    def f(a, b):
      return raw_qdot(a, b, state, lay.dimension_numbers, config)[0]

    out, vjp = jax.vjp(f, a, b)
    return vjp(jnp.ones_like(out))

  stateful.start_recording()
  try:
    jax.eval_shape(backward, lhs, rhs)
  finally:
    seen = stateful.stop_recording()
  for path, struct, axes in seen:
    if path in paths and path not in state:
      t = tensor_config(config, path)
      state[path] = jax.tree.map(
        jnp.asarray, t.calibration.init_state(struct, axes, t.numerics)
      )
  return state


def split(state_grads: dict) -> tuple[dict, dict]:
  """(learned-parameter gradients, backward-pass new stats).

  Args:
    state_grads: the gradient of the loss w.r.t. the state tree.

  Returns:
    ({path: {name: gradient}} of the forward operands' learned parameters,
    {path: new stats} of the gradient operands).
  """
  grads = {p: v['learned'] for p, v in state_grads.items() if p not in _BWD}
  stats = {p: v['stats'] for p, v in state_grads.items() if p in _BWD}
  return grads, stats


def merge(new_state: dict, state_grads: dict) -> dict:
  """The next state: forward stats and learned parameters from `new_state`
  (the call's output), backward stats from `state_grads`."""
  _, bwd = split(state_grads)
  out = dict(new_state)
  for p, st in bwd.items():
    out[p] = {'stats': st, 'learned': new_state[p]['learned']}
  return out


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
      a row (padding) out of the statistics.

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
  for p, v in state.items():
    if p not in stateful_paths(config):
      continue  # A sparsity schedule.
    cal = tensor_config(config, p).calibration
    if hasattr(cal, 'penalty'):
      total = total + cal.penalty(v)
  return total
