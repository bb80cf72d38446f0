"""The engine's side of calibration state: checks and learned gradients.

Internal API of `dot_general.py`: `check_state_tree` (before the call) and
`learned_cotangent` (in the backward pass). The state tree also holds the
sparsity schedules' masks (`sparsity_paths`, `core.sparsify`). The
mechanism is described in `aqtr.core.stateful`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from aqtr.core.config import DotGeneralConfig, TensorConfig
from aqtr.core.dimension_numbers import DotLayout
from aqtr.core.passes import common_tile
from aqtr.core.qtensor import ROLE_AXES, to_view
from aqtr.core.sparsify import SITE, has_schedule
from aqtr.core.stateful import ALL_PATHS, LEARNED_PATHS, is_stateful


def tensor_config(config: DotGeneralConfig, path: str) -> TensorConfig:
  """The TensorConfig at an operand path such as 'dlhs.lhs' (or at a
  sparsity schedule's path such as 'fwd.rhs.sparsity')."""
  pass_, side = path.split('.')[:2]
  return getattr(getattr(config, pass_), side)


def sparsity_paths(
  config: DotGeneralConfig | None, stored: tuple[bool, bool] = (False, False)
) -> list[str]:
  """'fwd.<side>.sparsity' of the forward operands whose sparsity has a
  schedule (`core.sparsify.has_schedule`); stored QTensors need none."""
  if config is None:
    return []
  return [
    SITE.format(side=side)
    for side, is_stored in zip(('lhs', 'rhs'), stored, strict=True)
    if not is_stored and has_schedule(getattr(config.fwd, side))
  ]


def state_paths(
  config: DotGeneralConfig | None, stored: tuple[bool, bool] = (False, False)
) -> list[str]:
  """Every path of a call's state tree: the stateful calibrations'
  (`stateful_paths`) and the sparsity schedules' (`sparsity_paths`)."""
  return stateful_paths(config, stored) + sparsity_paths(config, stored)


def stateful_paths(
  config: DotGeneralConfig | None, stored: tuple[bool, bool] = (False, False)
) -> list[str]:
  """The operand paths of `config` whose calibration needs state.

  A forward operand given as a stored QTensor (`stored`: lhs, rhs) is not
  quantized by the call, so its path needs no state.

  Raises:
    ValueError: a stateful calibration where none is supported (a
      requantized backward residual) or a learned one off the forward pass.
  """
  if config is None:
    return []
  out = []
  for path in ALL_PATHS:
    pass_, side = path.split('.')
    raw = getattr(config, pass_)
    t = getattr(raw, side)
    if not (t.quantized and is_stateful(t.calibration)):
      continue
    if pass_ != 'fwd' and not raw.quantized:
      continue
    if pass_ == 'fwd' and stored[0 if side == 'lhs' else 1]:
      continue
    if pass_ != 'fwd' and side == 'rhs':
      if raw.use_fwd_quant:
        continue  # Unused: the forward quantization is reused.
      raise ValueError(
        f'{path}: a stateful calibration '
        f'({type(t.calibration).__name__}) on a requantized backward '
        'residual is not supported; set use_fwd_quant=True or use a '
        'stateless calibration there.'
      )
    if t.calibration.has_learned and path not in LEARNED_PATHS:
      raise ValueError(
        f'{path}: {type(t.calibration).__name__} learns parameters, which '
        f'only forward operands can; allowed paths: {LEARNED_PATHS}.'
      )
    out.append(path)
  return out


def check_state_tree(
  config: DotGeneralConfig | None, state, stored=(False, False)
) -> None:
  """Raises a clear error when `state` does not match `config`'s paths."""
  paths = state_paths(config, stored)
  if state is None:
    if paths and paths[0].endswith('.sparsity'):
      t = tensor_config(config, paths[0])
      raise ValueError(
        f'config.{paths[0]}: {t.sparsity!r} has a schedule (start_step > '
        '0 or update_step > 1) and needs its mask state: pass '
        'state=aqtr.state.init(lhs, rhs, dimension_numbers, config) and use '
        'the returned (out, new_state).'
      )
    if paths:
      raise ValueError(
        f'{paths[0]}: calibration '
        f'{type(tensor_config(config, paths[0]).calibration).__name__} is '
        'stateful and needs state: pass state=aqtr.state.init(lhs, rhs, '
        'dimension_numbers, config) and use the returned (out, new_state).'
      )
    return
  if not isinstance(state, dict):
    raise TypeError(
      f'state must be a dict from aqtr.state.init, got {type(state)}.'
    )
  missing = [p for p in paths if p not in state]
  extra = [p for p in state if p not in paths]
  for side, is_stored in zip(('lhs', 'rhs'), stored, strict=True):
    path = f'fwd.{side}'
    if is_stored and path in extra:
      cal = type(tensor_config(config, path).calibration).__name__
      raise ValueError(
        f'{path}: the operand is a stored QTensor (frozen, as in SERVE), '
        f'so its calibration {cal} has nothing to update or learn; drop '
        f'{path!r} from the state (its frozen scale already holds it).'
      )
  if missing or extra:
    raise ValueError(
      f'state paths {sorted(state)} do not match the config: missing '
      f'{missing}, unexpected {extra}; expected exactly {paths}.'
    )


def learned_cotangent(site, learned, d_raw, cfg, lay: DotLayout, side: str):
  """The state cotangent of a forward operand: its learned parameters'
  gradient; zeros for its stats.

  d loss / d p = grad_scale * sum_G (dL/dxhat * d xhat / d p), with
  dL/dxhat the unmasked operand gradient `d_raw`, brought to the view.
  """
  zeros = jax.tree.map(jnp.zeros_like, site)
  if learned is None or d_raw is None:
    return zeros
  t = getattr(cfg.fwd, side)
  layout = getattr(lay, side)
  form = 'fk' if side == 'lhs' else layout.natural_form()
  tile = common_tile([cfg.fwd.lhs, cfg.fwd.rhs], lay.lhs.k)
  d4 = to_view(layout.to_canonical(d_raw.astype(jnp.float32), form), form, tile)
  axes = tuple(sorted(ROLE_AXES[form][r] for r in t.tiling.shared))
  group = math.prod(d4.shape[a] for a in axes)
  factor = t.calibration.grad_scale(group, t.numerics)
  grads = {
    name: (jnp.sum(d4 * h, axis=axes, keepdims=True) * factor).reshape(
      site['learned'][name].shape
    )
    for name, h in learned.items()
  }
  return {'stats': zeros['stats'], 'learned': grads}


def forward_state(out, state: dict, q_lhs, q_rhs, res):
  """((out, new_state), res): forward sites' new state into the residuals.

  `res` (a `core.residuals.Residuals`) keeps the state and the learned
  calibrations' derivatives for the backward pass.
  """
  new_state = dict(state)
  for path, q in (('fwd.lhs', q_lhs), ('fwd.rhs', q_rhs)):
    if path in state and q is not None and q.state is not None:
      new_state[path] = q.state
  res = dataclasses.replace(
    res,
    state=state,
    learned_lhs=None if q_lhs is None else q_lhs.learned,
    learned_rhs=None if q_rhs is None else q_rhs.learned,
  )
  return (out, new_state), res


def state_cotangent(res, st_l, st_r, dl_raw, dr_raw, cfg, lay) -> dict:
  """The state input's cotangent (see `aqtr.core.stateful`).

  It carries the backward sites' new state (st_l, st_r) and the learned
  parameters' gradients.
  """
  st = dict(res.state)
  for path, new in (('dlhs.lhs', st_l), ('drhs.lhs', st_r)):
    if path in st and new is not None:
      st[path] = new
  for side in ('lhs', 'rhs'):  # Sparsity schedules: forward-only state.
    path = SITE.format(side=side)
    if path in st:
      st[path] = jax.tree.map(jnp.zeros_like, st[path])
  if 'fwd.lhs' in st:
    st['fwd.lhs'] = learned_cotangent(
      st['fwd.lhs'], res.learned_lhs, dl_raw, cfg, lay, 'lhs'
    )
  if 'fwd.rhs' in st:
    st['fwd.rhs'] = learned_cotangent(
      st['fwd.rhs'], res.learned_rhs, dr_raw, cfg, lay, 'rhs'
    )
  return st
