"""Served projections of one input as one dot (Q, K and V of attention).

A served model's Q, K and V projections read the same input through
three quantized dots. XLA already computes the input's quantization once
for the three, but still runs three int8 dots, each with its own
dispatch and its own fusion boundary for the scales. `project` runs them
as one dot over the frozen weights concatenated along their output axis,
then splits the output. At batch 8 on XLA:CPU one [8, 512] x [512, 1536]
int8 dot took 75 us against 125 us for three [8, 512] x [512, 512] dots
(and 52 against 70 us at two rows); in a decode loop XLA concatenates the
loop-invariant weights once, outside the loop.

The values are the same bits as the separate projections': the
activation is quantized by the same code with the same config, each
output column is its own integer sum over the contraction, rescaled by its
own weight scale and the row's activation scale, and the biases are added
per column. The merge is taken only where that holds: every projection a
`Linear` whose einsum op (`aqtr.pax.EinsumOp` or `aqtr.flax.linen.Einsum`)
serves in `Mode.SERVE` with the same config, its weight
frozen by the `WeightsFreezer` with per-channel scales (nothing else
frozen, no calibration state, no random key), and each frozen array
concatenable along its output axis (the last one in the 'kf' view the
weight is quantized in, the one before it when stored with the
contraction minor, `aqtr.freezers.weights.minor_k`). Anything else (training,
float ops, calibrated activation bounds, tiled weights) runs the
projections one by one, as before.

Example:
  >>> import jax, jax.numpy as jnp, aqtr
  >>> from aqtr.pax.linear import Linear
  >>> lin = Linear(features=4, einsum=aqtr.pax.EinsumOp())
  >>> params = lin.init(jax.random.key(0), jnp.ones((1, 3)))
  >>> mergeable([lin, lin], [{}, {}])  # Float ops: no merge.
  False
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from aqtr.core import slot_state
from aqtr.core.qtensor import stored_form
from aqtr.flax import intercept
from aqtr.flax.common import FROZEN, einsum_plan
from aqtr.flax.linen import Einsum
from aqtr.flax.linen_convert import ops_mode
from aqtr.freezers import Mode, WeightsFreezer, lifecycle
from aqtr.pax import ops
from aqtr.pax.linear import add_bias
from aqtr.tilings.per_channel import PerChannel

__all__ = ['mergeable', 'project']

_EQN = '...d,df->...f'


def _config(module: nn.Module | None, linear: Any) -> Any:
  """The config of `linear`'s op when it serves frozen values, else None
  (`module`: a bound ancestor, whose root may set the ops' mode)."""
  op = getattr(linear, 'einsum', None)
  if not isinstance(op, ops.EinsumOp | Einsum):
    return None
  mode = op.mode if module is None else ops_mode(module, op.mode)
  return op.config if mode is Mode.SERVE else None


def _servable(config: Any) -> bool:
  """Whether `config` serves a frozen per-channel weight and nothing else
  frozen or stateful (then output columns are independent)."""
  if config is None or getattr(config, 'is_float', True):
    return False
  frozen = lifecycle.freezers(config)
  rhs = config.fwd.rhs
  return (
    set(frozen) == {'rhs'}
    and type(frozen['rhs']) is WeightsFreezer
    and isinstance(rhs.tiling, PerChannel)
    and not slot_state.paths(config)
    and not ops.needs_key(config)
  )


def mergeable(
  linears: Sequence[Any],
  entries: Sequence[Any],
  module: nn.Module | None = None,
) -> bool:
  """Whether `linears` (Linear modules of one input) serve as one dot.

  Args:
    linears: the projections.
    entries: each projection's frozen entry (`{'rhs': {part: array}}`).
    module: their bound parent (its root may set the ops' mode), or None.

  Returns:
    True when every projection serves a frozen weight with the same
    config and bias use, and the frozen parts concatenate along their
    last axis (the output features).
  """
  if len(linears) < 2 or len(entries) != len(linears):
    return False
  if intercept.recorder() is not None:  # PTQ records each op alone.
    return False
  configs = [_config(module, lin) for lin in linears]
  if not _servable(configs[0]) or any(c != configs[0] for c in configs):
    return False
  if len({lin.use_bias for lin in linears}) != 1:
    return False
  parts, axes = None, set()
  for lin, entry in zip(linears, entries, strict=True):
    rhs = entry.get('rhs') if isinstance(entry, Mapping) else None
    if not isinstance(rhs, Mapping) or set(entry) != {'rhs'}:
      return False
    if parts is None:
      parts = set(rhs)
    if set(rhs) != parts or 'scale' not in parts:
      return False
    axis = _features_axis(rhs)
    axes.add(axis)
    for v in rhs.values():
      if jnp.ndim(v) < 2 or jnp.shape(v)[axis] != lin.features:
        return False
  if len(axes) != 1:
    return False
  (axis,) = axes
  first = entries[0]['rhs']

  def others(v):
    shape = list(jnp.shape(v))
    del shape[axis]
    return shape

  return all(
    others(e['rhs'][k]) == others(first[k]) for e in entries for k in parts
  )


def _features_axis(rhs: Mapping) -> int:
  """The output-feature axis of a frozen [d, features] weight's parts: -1
  in the 'kf' view it is quantized in, -2 stored with its contraction
  minor ('fk', `aqtr.freezers.weights.minor_k`)."""
  return -2 if stored_form(jnp.shape(rhs['scale']), 'kf') == 'fk' else -1


def _entry(module: nn.Module, name: str, config: Any) -> Any:
  frozen = module.variables.get(FROZEN, {})
  entries = frozen.get(name, {}).get('einsum')
  if not entries:
    return None
  return dict(entries).get(lifecycle.entry_name(config))


def project(
  module: nn.Module, names: Sequence[str], x: jax.Array
) -> tuple[jax.Array, ...]:
  """The `Linear` children `names` of `module` applied to `x`.

  One dot over their concatenated frozen weights when `mergeable`, else
  each child called in turn; the same values either way.

  Args:
    module: a bound module whose attributes `names` are `Linear`s.
    names: the children, in output order.
    x: the shared input [..., d].

  Returns:
    One output [..., features] per child.
  """
  linears = [getattr(module, n) for n in names]
  config = _config(module, linears[0])
  entries = []
  if _servable(config) and not module.is_initializing():
    entries = [_entry(module, n, config) for n in names]
  if any(e is None for e in entries) or not mergeable(linears, entries, module):
    return tuple(lin(x) for lin in linears)
  sizes = [lin.features for lin in linears]
  axis = _features_axis(entries[0]['rhs'])
  frozen = {
    'rhs': {
      k: jnp.concatenate([e['rhs'][k] for e in entries], axis=axis)
      for k in entries[0]['rhs']
    }
  }
  lifecycle.validate(config)
  dn, perm = einsum_plan(_EQN, jnp.ndim(x), 2)
  rhs = jnp.zeros((x.shape[-1], sum(sizes)), x.dtype)  # Not read in SERVE.
  call = lifecycle.DotCall(x, rhs, dn, config)
  y = lifecycle.run(call, Mode.SERVE, frozen=frozen).out
  if perm is not None:
    y = y.transpose(perm)
  if linears[0].use_bias:
    params = module.variables['params']
    bias = [params[n]['bias'] for n in names]
    y = add_bias(y, jnp.concatenate(bias))
  cuts = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
  return tuple(jnp.split(y, cuts, axis=-1))
