"""The `sparsity` registry: which elements of an operand are kept.

The base type `Sparsity` is the core's (`aqtr.core.algorithms`); this
module holds the registry.
"""

from __future__ import annotations

import dataclasses

from aqtr.core.algorithms import Sparsity
from aqtr.core.registry import Registry

__all__ = ['Sparsity', 'configure', 'get', 'names', 'register', 'registry']

registry: Registry = Registry('sparsity', Sparsity)
register = registry.register
get = registry.get
names = registry.names


def _as_sparsity(value, side: str) -> Sparsity | None:
  if value is None or isinstance(value, Sparsity):
    return value
  if isinstance(value, str):
    return get(value)()
  raise TypeError(
    f'{side} must be a Sparsity, a registered sparsity name '
    f'({", ".join(names())}) or None, got {value!r}.'
  )


# Operand -> the config paths that hold its sparsity (the forward operand
# and its residual slot in the backward pass that reads it).
_PATHS = {
  'lhs': (('fwd', 'lhs'), ('drhs', 'rhs')),
  'rhs': (('fwd', 'rhs'), ('dlhs', 'rhs')),
}


def configure(config, *, lhs=None, rhs=None):
  """Returns `config` with the sparsity of its operands set.

  `lhs` (activations) goes to fwd.lhs and its residual slot drhs.rhs;
  `rhs` (weights) to fwd.rhs and dlhs.rhs (the slots the role tags
  `ActivationSparsity` / `WeightSparsity` name).

  Args:
    config: an aqtr.DotGeneralConfig.
    lhs, rhs: a Sparsity, a registry name ('none', 'n_m', 'magnitude') or
      None to keep the operand's sparsity.

  Returns:
    The new config (configs are frozen; `config` is unchanged).

  Example:
    >>> import aqtr
    >>> cfg = configure(aqtr.presets.int8(), rhs='n_m')
    >>> cfg.fwd.rhs.sparsity.n, cfg.dlhs.rhs.sparsity.m
    (2, 4)
  """
  for side, value in (('lhs', lhs), ('rhs', rhs)):
    s = _as_sparsity(value, side)
    if s is None:
      continue
    for pass_name, operand in _PATHS[side]:
      raw = getattr(config, pass_name)
      t = dataclasses.replace(getattr(raw, operand), sparsity=s)
      raw = dataclasses.replace(raw, **{operand: t})
      config = dataclasses.replace(config, **{pass_name: raw})
  return config
