"""Freezing one operand: quantize it exactly as a dot's forward pass would.

A QTensor made here can replace the float operand of `aqtr.dot_general` /
`aqtr.einsum` with bit-identical output (serving frozen weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import DotLayout, OperandLayout
from aqtr.core.passes import PassKeys, common_tile, forward_operand
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import check_float
from aqtr.core.rounding import as_typed_key
from aqtr.core.sparsify import has_schedule, prune, scheduled_prune


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
    dimension_numbers: of the dot it will be used in.
    config: the DotGeneralConfig of that dot (its fwd.<operand> applies).
    operand: 'lhs' or 'rhs'.
    other_shape: shape of the other operand; default: inferred as needed
      (only the contraction/batch sizes matter, taken from `x`).
    key: PRNG key if the forward rounding is stochastic.
    state: with a stateful or learned calibration, the operand's state
      (`aqtr.state.init(...)['fwd.<operand>']`): frozen with the bound the
      forward pass uses at that state (LSQ's learned step, the delayed
      history's max).

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
  (lc, rc), (lb, rb) = dimension_numbers
  mine, theirs = (
    ((lc, lb), (rc, rb)) if operand == 'lhs' else ((rc, rb), (lc, lb))
  )
  if other_shape is None:  # A stand-in partner with matching sizes.
    nd = len(theirs[0]) + len(theirs[1])
    other_shape = [1] * max(nd, 1 + max((*theirs[0], *theirs[1], -1)))
    for a, b in zip(
      (*mine[0], *mine[1]), (*theirs[0], *theirs[1]), strict=True
    ):
      other_shape[b] = x.shape[a]
  shapes = (
    (x.shape, other_shape) if operand == 'lhs' else (other_shape, x.shape)
  )
  lay = DotLayout.create(*shapes, dimension_numbers)
  return quantize_in_layout(
    x, getattr(lay, operand), config, operand=operand, key=key, state=state
  )


def quantize_in_layout(
  x: jax.Array,
  layout: OperandLayout,
  config: DotGeneralConfig,
  *,
  operand: str,
  key: jax.Array | None = None,
  state: dict | None = None,
  sparsity_state: dict | None = None,
) -> QTensor:
  """`quantize_operand` for an operand whose layout in the dot is known.

  For callers that already hold the dot's `DotLayout` (the freezers'
  `OperandCall` makes it once per call); `x` must be a float array of
  `layout.shape`.

  Args:
    x: the float operand.
    layout: its OperandLayout in the dot (`DotLayout.lhs` / `.rhs`).
    config: the dot's DotGeneralConfig (its fwd.<operand> applies).
    operand: 'lhs' or 'rhs'.
    key: PRNG key if the forward rounding is stochastic.
    state: the operand's calibration state (its `aqtr.state.init` entry
      'fwd.<operand>') when its calibration is stateful.
    sparsity_state: the operand's sparsity schedule state (the 'stats' of
      its entry 'fwd.<operand>.sparsity'): pruned with the mask the
      forward pass uses at that state; None: a mask made from `x`.
  """
  cfg = getattr(config.fwd, operand)
  if not cfg.quantized:
    raise ValueError(
      f'config.fwd.{operand} is not quantized; nothing to freeze.'
    )
  return _quantize_jit(
    x,
    as_typed_key(key),
    state,
    sparsity_state if has_schedule(cfg) else None,
    layout=layout,
    config=config,
    operand=operand,
  )


@functools.partial(jax.jit, static_argnames=('layout', 'config', 'operand'))
def _quantize_jit(x, key, state, site, *, layout, config, operand) -> QTensor:
  """Jitted like the engine's forward pass, so that XLA simplifies the
  scale arithmetic identically (an eager op-by-op run can differ by an ulp
  from the compiled one, and frozen weights must equal TRAIN's bit for
  bit)."""
  cfg = getattr(config.fwd, operand)
  form = 'fk' if operand == 'lhs' else layout.natural_form()
  path = f'config.fwd.{operand}'
  if site is not None:  # The mask the schedule holds at this state.
    x = scheduled_prune(x, cfg, layout, form, path, site)[0]
  else:
    x, _ = prune(x, cfg, layout, form, path)
  tile = common_tile([config.fwd.lhs, config.fwd.rhs], layout.k)
  keys = PassKeys.split(key)
  key = keys.fwd_lhs if operand == 'lhs' else keys.fwd_rhs
  q = forward_operand(x, cfg, layout, form, tile, key, operand, state)
  return QTensor(q.values, q.scale, layout, form, q.zero_point)
