"""Fiddlers: switch an operand's algorithms by registry name.

A fiddler edits a Fiddle config in place. These take a path pattern (a
regex fully matched against the dotted paths of the operands, i.e. of the
TensorConfig nodes: `fwd.lhs`, `dlhs.lhs`, ..., or `layers[0].dot.fwd.rhs`
in a model config), a registry name and keyword fields for the new class;
fields not given take the class defaults. The new sub-config is built once
on the spot, so a bad name, field or value fails here with the path, the
valid names and the valid fields. Every match gets its own copy, and the
role tags (`aqtr.tags`) are refreshed.

They are the command line's way to pick algorithms (`set:` takes Python
literals only):

  --config="fiddler:use_calibration('fwd\\..*', 'constant', bound=3.0)"

Example:
  >>> import aqtr
  >>> cfg = aqtr.fiddle.config('int8')
  >>> use_calibration(cfg, r'fwd\\..*', 'constant', bound=3.0)
  >>> aqtr.fiddle.build(cfg).fwd.rhs.calibration
  Constant(po2_scale=False, bound=3.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import fiddle as fdl

from aqtr import (
  calibrations,
  freezers,
  numerics,
  sparsity,
  tags,
  tilings,
  transforms,
)
from aqtr.core.config import TensorConfig
from aqtr.core.registry import Registry
from aqtr.core.rounding import NearestEven, Rounding, Stochastic
from aqtr.fiddle import as_config
from aqtr.selectors import select_path

__all__ = [
  'set_fields',
  'set_tag',
  'use',
  'use_calibration',
  'use_freezer',
  'use_numerics',
  'use_rounding',
  'use_sparsity',
  'use_tiling',
  'use_transform',
]

# Rounding modes are not a registry family; they get names here.
roundings: Registry = Registry('roundings', Rounding)
roundings.register('nearest_even')(NearestEven)
roundings.register('stochastic')(Stochastic)

_FAMILIES: dict[str, Registry] = {
  'numerics': numerics.registry,
  'calibration': calibrations.registry,
  'tiling': tilings.registry,
  'sparsity': sparsity.registry,
  'rounding': roundings,
  'freezer': freezers.registry,
  'transform': transforms.registry,
}


def use(cfg: Any, path: str, field: str, name: str, /, **fields: Any) -> None:
  """Sets `field` of every operand matching `path` to registered `name`.

  Args:
    cfg: a Fiddle config tree holding TensorConfigs (edited in place).
    path: regex fully matched against the operands' dotted paths.
    field: 'numerics', 'calibration', 'tiling', 'sparsity', 'rounding',
      'transform' or 'freezer'.
    name: a name of that family's registry (e.g. 'constant').
    **fields: fields of the new class; the others take their defaults.

  Raises:
    ValueError: unknown field, no operand matches, or bad field values.
    aqtr.UnknownNameError: unknown name (lists the registered ones).
    TypeError: a keyword that the class has no field for (lists them).
  """
  family = _FAMILIES.get(field)
  if family is None:
    raise ValueError(
      f'field must be one of {sorted(_FAMILIES)}, got {field!r}.'
    )
  cls = family.get(name)
  valid = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(set(fields) - set(valid))
  if unknown:
    raise TypeError(
      f'{family.family} {name!r} ({cls.__qualname__}) has no field '
      f'{", ".join(unknown)}; valid fields: {", ".join(valid) or "(none)"}.'
    )
  operands = select_path(cfg, path, fn_or_cls=TensorConfig)
  if not len(operands):
    raise ValueError(
      f'No operand (TensorConfig) path fully matches {path!r}; operand '
      f'paths: {", ".join(select_path(cfg, ".*", TensorConfig).paths)}.'
    )
  try:
    value = cls(**fields)
  except (TypeError, ValueError) as e:
    raise type(e)(
      f'{field} {name!r} at {", ".join(operands.paths)}: {e}'
    ) from None
  operands.set(**{field: as_config(value)})


def use_numerics(cfg: Any, path: str, name: str, /, **fields: Any) -> None:
  """`use(cfg, path, 'numerics', name, **fields)`; names: numerics.names().

  Example:
    >>> import aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> use_numerics(cfg, 'fwd.rhs', 'fp8', dtype_name='float8_e5m2')
    >>> cfg.fwd.rhs.numerics.dtype_name
    'float8_e5m2'
  """
  use(cfg, path, 'numerics', name, **fields)


def use_calibration(cfg: Any, path: str, name: str, /, **fields: Any) -> None:
  """`use(cfg, path, 'calibration', name, **fields)`; calibrations.names()."""
  use(cfg, path, 'calibration', name, **fields)


def use_tiling(cfg: Any, path: str, name: str, /, **fields: Any) -> None:
  """`use(cfg, path, 'tiling', name, **fields)`; names: tilings.names()."""
  use(cfg, path, 'tiling', name, **fields)


def use_sparsity(cfg: Any, path: str, name: str, /, **fields: Any) -> None:
  """`use(cfg, path, 'sparsity', name, **fields)`; names: sparsity.names().

  Prune forward operands (fwd.lhs, fwd.rhs); their residual slots
  (drhs.rhs, dlhs.rhs) may repeat the same sparsity.

  Example:
    >>> import aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> use_sparsity(cfg, r'fwd\\.rhs|dlhs\\.rhs', 'n_m', n=2, m=4)
    >>> aqtr.fiddle.build(cfg).fwd.rhs.sparsity.n
    2
  """
  use(cfg, path, 'sparsity', name, **fields)


def use_rounding(cfg: Any, path: str, name: str, /, **fields: Any) -> None:
  """`use(cfg, path, 'rounding', name, **fields)`.

  Names: 'nearest_even', 'stochastic' (then the call needs `key=`).

  Example:
    >>> import aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> use_rounding(cfg, r'd.hs\\.lhs', 'stochastic')
    >>> aqtr.fiddle.build(cfg).drhs.lhs.rounding
    Stochastic(noise_sharing_axes=())
  """
  use(cfg, path, 'rounding', name, **fields)


def use_transform(cfg: Any, path: str, name: str, /, **fields: Any) -> None:
  """`use(cfg, path, 'transform', name, **fields)`; transforms.names().

  Both operands of a pass take the same transform (backward passes).

  Example:
    >>> import aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> set_fields(cfg, r'drhs', use_fwd_quant=False)
    >>> use_transform(cfg, r'drhs\\..*', 'hadamard', block_size=16)
    >>> aqtr.fiddle.build(cfg).drhs.rhs.transform.block_size
    16
  """
  use(cfg, path, 'transform', name, **fields)


def use_freezer(cfg: Any, path: str, name: str, /, **fields: Any) -> None:
  """`use(cfg, path, 'freezer', name, **fields)`; names: freezers.names()."""
  use(cfg, path, 'freezer', name, **fields)


def set_fields(cfg: Any, path: str, /, **values: Any) -> None:
  """Sets arguments of every node whose dotted path fully matches `path`.

  The command-line form of `aqtr.selectors.select_path(cfg, path).set()`.

  Example:
    >>> import aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> set_fields(cfg, r'd.hs\\.lhs\\.numerics', bits=4)
    >>> cfg.dlhs.lhs.numerics.bits, cfg.fwd.lhs.numerics.bits
    (4, 8)
  """
  select_path(cfg, path).set(**values)


def set_tag(cfg: Any, tag: str | type[fdl.Tag], value: Any, /) -> None:
  """`fdl.set_tagged` by tag name, then refreshes the role tags.

  Args:
    cfg: a Fiddle config tree (edited in place).
    tag: a tag of `aqtr.tags` or its name ('BwdBits').
    value: the new value (a deep copy per tagged slot).

  Example:
    >>> import aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> set_tag(cfg, 'FwdBits', 4)
    >>> cfg.fwd.rhs.numerics.bits, cfg.drhs.rhs.numerics.bits
    (4, 8)
  """
  if isinstance(tag, str):
    found = getattr(tags, tag, None)
    if not (isinstance(found, type) and issubclass(found, fdl.Tag)):
      valid = sorted(
        n
        for n, v in vars(tags).items()
        if isinstance(v, type) and issubclass(v, fdl.Tag) and v is not fdl.Tag
      )
      raise ValueError(f'Unknown tag {tag!r}; aqtr.tags: {", ".join(valid)}.')
    tag = found
  fdl.set_tagged(cfg, tag=tag, value=value)
  tags.tag_roles(cfg)
