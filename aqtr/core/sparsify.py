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
(`'fwd.<side>.sparsity'` in the call's state tree, `aqtr.state`): a
float32 0/1 mask and a step counter; the forward pass returns the next
one (`scheduled_prune`).

Internal API (used by `dot_general.py`, `engine_state.py`, `operand.py`,
`quantizer.py`, `aqtr.state`, the freezer lifecycle):
`prune`, `decay_term`, `prune_operands`, `has_schedule`, `schedule_init`,
`scheduled_prune`, `sites_of`, `site_entries`, `SITE`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aqtr.core.config import DotGeneralConfig, TensorConfig
from aqtr.core.dimension_numbers import DotLayout, OperandLayout
from aqtr.core.qtensor import QTensor


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


def prune_operands(lhs, rhs, lay: DotLayout, cfg: DotGeneralConfig, sites=None):
  """Both forward operands pruned: (lhs_s, rhs_s, terms, new sites).

  `terms` are the SR-STE gradient terms (`decay_term`, or None) of lhs and
  rhs. A sparsity with a schedule (`has_schedule`) reads its mask state
  from `sites` ({'lhs': site, 'rhs': site}, see `schedule_init`) and
  returns the next one in `new sites`; without a site it raises. Stored
  QTensor operands (`aqtr.quantize_operand`, pruned when made) are
  returned as they are.
  """
  sites = sites or {}
  out, terms, new = {}, [], {}
  for side, x, form in (
    ('lhs', lhs, 'fk'),
    ('rhs', rhs, lay.rhs.natural_form()),
  ):
    t = getattr(cfg.fwd, side)
    if isinstance(x, QTensor) or not t.sparse:
      out[side] = x
      terms.append(None)
      continue
    path, layout = f'config.fwd.{side}', getattr(lay, side)
    if has_schedule(t):
      site = sites.get(side)
      if site is None:
        raise ValueError(
          f'{path}.sparsity: {t.sparsity!r} has a schedule (start_step > 0 '
          'or update_step > 1) and needs its mask state: call '
          'aqtr.dot_general(..., state=aqtr.state.init(lhs, rhs, '
          'dimension_numbers, config)).'
        )
      out[side], mask, new[side] = scheduled_prune(
        x, t, layout, form, path, site
      )
    else:
      out[side], mask = prune(x, t, layout, form, path)
    terms.append(decay_term(x, t, mask))
  return out['lhs'], out['rhs'], terms, new


# ------------------------------------------------------------------ schedule


def schedule_init(x: jax.Array) -> dict:
  """The schedule state of an operand shaped like `x`: a dense mask (1.0)
  and step 0 (float32, so it can be a differentiable input)."""
  return {
    'mask': jnp.ones(jnp.shape(x), jnp.float32),
    'step': jnp.zeros((), jnp.float32),
  }


def has_schedule(t: TensorConfig) -> bool:
  """Whether the operand's mask needs state (a start or held steps)."""
  s = t.sparsity
  return s.prunes and (s.start_step > 0 or s.update_step > 1)


def scheduled_prune(
  x: jax.Array,
  t: TensorConfig,
  layout: OperandLayout,
  form: str,
  path: str,
  site: dict,
) -> tuple[jax.Array, jax.Array, dict]:
  """(x_s, mask, new site): the mask as the schedule says at `site['step']`.

  Before `start_step` the mask is dense; at `start_step + j * update_step`
  it is made from `x`; in between the stored one is held. The new site
  holds the mask used and the next step.
  """
  s = t.sparsity
  step = site['step']
  held = site['mask'] > 0.5
  fresh = _mask(x, t, layout, form, path)
  active = step >= s.start_step
  since = jnp.maximum(step - s.start_step, 0.0)
  refresh = active & (jnp.mod(since, float(s.update_step)) == 0)
  mask = jnp.where(refresh, fresh, held) | ~active
  new = {'mask': mask.astype(jnp.float32), 'step': step + 1.0}
  return jnp.where(mask, x, jnp.zeros_like(x)), mask, new


# The state path of a forward operand's sparsity schedule, e.g.
# 'fwd.rhs.sparsity': {'stats': {'mask', 'step'}, 'learned': {}}.
SITE = 'fwd.{side}.sparsity'


def sites_of(state: dict | None) -> dict:
  """{side: schedule site} of a call's state tree (`aqtr.state`)."""
  state = state or {}
  out = {}
  for side in ('lhs', 'rhs'):
    entry = state.get(SITE.format(side=side))
    if entry is not None:
      out[side] = entry['stats']
  return out


def site_entries(sites: dict) -> dict:
  """{state path: entry} of the new schedule sites `prune_operands` gave."""
  return {
    SITE.format(side=side): {'stats': site, 'learned': {}}
    for side, site in sites.items()
  }
