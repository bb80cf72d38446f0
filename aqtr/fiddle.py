"""Fiddle configs of the config tree: expand, build, print, serialize.

`config('int8')` is the preset as a fully expanded `fdl.Config` tree: every
dataclass in it (DotGeneralConfig, the three DotGeneralRaw, the six
TensorConfig and each one's numerics, calibration, tiling, rounding, ...)
becomes an `fdl.Config` with every field set, because Fiddle selectors
cannot see dataclass defaults. The tree is made by converting the built
preset (`as_config`), so it is complete by construction and
`fdl.build(config(name)) == getattr(aqtr.presets, name)()`. Role tags
(`aqtr.tags`) are added by position.

`build` is `fdl.build` with errors that name the dotted path of the node
that failed (`BuildError`); the dataclasses validate themselves in
`__post_init__`. Shape-dependent checks (sub-channel tiles dividing the
contraction) are in `aqtr.validation.check_shapes`.

Example:
  >>> import aqtr
  >>> from fiddle import selectors
  >>> cfg = aqtr.fiddle.config('int8')
  >>> selectors.select(cfg, aqtr.calibrations.AbsMax).set(clip_scale=0.9)
  >>> aqtr.fiddle.build(cfg).drhs.rhs.calibration.clip_scale
  0.9
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Callable
from typing import Any

import fiddle as fdl
from fiddle import daglish
from fiddle.experimental import serialization

from aqtr import presets, tags
from aqtr.core.config import DotGeneralConfig

__all__ = [
  'BuildError',
  'as_config',
  'build',
  'config',
  'dumps',
  'loads',
  'path_str',
  'to_text',
  'value_text',
]

Preset = str | Callable[..., DotGeneralConfig] | DotGeneralConfig


def as_config(value: Any) -> Any:
  """Converts a tree of dataclass instances into `fdl.Config`s, all fields set.

  Dataclasses become `fdl.Config(type(value), **fields)` with every init
  field given explicitly; lists, tuples and dicts are converted element by
  element; anything else is kept as it is. No node is shared between two
  positions, so an edit at one path never shows up at another. Role tags are
  added to every DotGeneralConfig in the result (`aqtr.tags.tag_roles`).

  Args:
    value: a built config (e.g. `aqtr.presets.int8()`) or any tree of them.

  Returns:
    The equivalent Fiddle config; `fdl.build(as_config(v)) == v`.

  Example:
    >>> import aqtr
    >>> as_config(aqtr.presets.fp8()).dlhs.lhs.numerics.dtype_name
    'float8_e5m2'
  """
  out = _convert(value)
  tags.tag_roles(out)
  return out


def _convert(value: Any) -> Any:
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    fields = {
      f.name: _convert(getattr(value, f.name))
      for f in dataclasses.fields(value)
      if f.init
    }
    return fdl.Config(type(value), **fields)
  if isinstance(value, list | tuple) and not hasattr(value, '_fields'):
    return type(value)(_convert(v) for v in value)
  if isinstance(value, dict):
    return {k: _convert(v) for k, v in value.items()}
  return value


def config(preset: Preset = 'int8', *args: Any, **kwargs: Any) -> fdl.Config:
  """A preset as a fully expanded, role-tagged `fdl.Config` tree.

  Args:
    preset: a name in `aqtr.presets.__all__`, a function returning a
      DotGeneralConfig, or a DotGeneralConfig.
    *args: passed to the preset function.
    **kwargs: passed to the preset function.

  Returns:
    `fdl.Config(DotGeneralConfig)` down to every leaf of fwd.lhs, fwd.rhs,
    dlhs.lhs, dlhs.rhs, drhs.lhs and drhs.rhs.

  Example:
    >>> config('fully_quantized', fwd_bits=4).fwd.lhs.numerics.bits
    4
  """
  if isinstance(preset, str):
    if preset not in presets.__all__:
      raise ValueError(
        f'Unknown preset {preset!r}; presets: {", ".join(presets.__all__)}.'
      )
    preset = getattr(presets, preset)
  value = preset(*args, **kwargs) if callable(preset) else preset
  if not isinstance(value, DotGeneralConfig):
    raise TypeError(f'preset must give a DotGeneralConfig, got {value!r}.')
  return as_config(value)


class BuildError(ValueError):
  """A config node failed to build; `path` is its dotted path."""

  def __init__(self, path: str, node: str, message: str):
    super().__init__(f'{path or "<root>"} ({node}): {message}')
    self.path = path


def build(cfg: Any) -> Any:
  """`fdl.build(cfg)`, with errors naming the dotted path that failed.

  Args:
    cfg: a Fiddle config tree (a non-Buildable is returned as it is).

  Returns:
    The built value, e.g. a frozen DotGeneralConfig.

  Raises:
    BuildError: a node's constructor rejected its arguments. The message
      names the innermost failing node (`dlhs.lhs (TensorConfig): ...`)
      and keeps the class's own explanation of the fix.

  Example:
    >>> import aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> cfg.fwd.use_fwd_quant = True
    >>> build(cfg)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    aqtr.fiddle.BuildError: <root> (DotGeneralConfig): ...fwd.use_fwd_quant...
  """
  try:
    return fdl.build(cfg)
  except Exception as e:  # Re-raised with the path.
    failed = _innermost_failure(cfg)
    if failed is None:
      raise
    path, node, err = failed
    raise BuildError(path, node, _message(err)) from e


def _innermost_failure(cfg: Any):
  """(path, class name, error) of the deepest node that fails to build."""
  nodes = [
    (p, v)
    for v, p in daglish.iterate(cfg, memoized=False)
    if isinstance(v, fdl.Buildable)
  ]
  for p, node in sorted(nodes, key=lambda pv: -len(pv[0])):
    try:
      fdl.build(node)
    except Exception as e:  # Reported to the caller.
      name = getattr(fdl.get_callable(node), '__name__', repr(node))
      return path_str(p), name, e
  return None


def _message(err: Exception) -> str:
  # fdl.build re-raises with a "Fiddle context" note; keep the cause only.
  text = str(err.args[0]) if err.args else str(err)
  return text.split('\n\nFiddle context:')[0]


def path_str(path: daglish.Path) -> str:
  """A daglish path as a dotted string: `fwd.lhs.numerics`, `layers[0].w`."""
  return daglish.path_str(path).removeprefix('.')


def dumps(cfg: Any) -> str:
  """Serializes a Fiddle config to JSON (fiddle.experimental.serialization).

  Classes, tags and registered user algorithms are stored by import path,
  so `loads` needs the module that defines them importable.

  Example:
    >>> import fiddle as fdl, aqtr
    >>> cfg = aqtr.fiddle.config('fp8')
    >>> fdl.build(loads(dumps(cfg))) == aqtr.presets.fp8()
    True
  """
  return serialization.dump_json(cfg, indent=1)


def loads(text: str) -> Any:
  """The Fiddle config serialized by `dumps` (tags included)."""
  return serialization.load_json(text)


def to_text(cfg: Any, *, show_tags: bool = False) -> str:
  """The config as text: one line per node (`path: Class`) or leaf (`=`).

  A built config is converted with `as_config` first. The rhs of a backward
  pass that reuses the forward quantization is marked unused.

  Args:
    cfg: a Fiddle config tree or a built config.
    show_tags: append each field's tags (`# FwdBits, Bits`).

  Returns:
    Lines like `fwd.lhs.calibration: AbsMax` and
    `fwd.lhs.numerics.bits = 8`, in tree order; functions by dotted name
    (`value_text`), so equal configs give equal text.

  Example:
    >>> import aqtr
    >>> print(to_text(aqtr.presets.int8()).splitlines()[2])
    fwd.lhs.numerics: IntSymmetric
  """
  if not isinstance(cfg, fdl.Buildable):
    cfg = as_config(cfg)
  unused = _unused_paths(cfg)
  lines, plain = [], []  # plain: containers printed whole (no Buildable)
  for value, p in daglish.iterate(cfg, memoized=False):
    if not p or any(p[: len(q)] == q for q in plain):
      continue
    path = path_str(p)
    if isinstance(value, fdl.Buildable):
      line = f'{path}: {_class_name(fdl.get_callable(value))}'
      if path in unused:
        line += '  # unused: use_fwd_quant=True'
    elif _holds_buildable(value):
      continue
    else:
      line = f'{path} = {value_text(value)}'
      plain.append(p)
    if show_tags and isinstance(p[-1], daglish.Attr):
      parent = daglish.follow_path(cfg, p[:-1])
      found = fdl.get_tags(parent, p[-1].name)
      if found:
        line += '  # ' + ', '.join(sorted(t.__name__ for t in found))
    lines.append(line)
  return '\n'.join(lines)


def value_text(value: Any) -> str:
  """`repr(value)`, with functions and classes by dotted name, no address.

  A function prints as the public name it is reachable by (`jax.nn.gelu`,
  not `<function gelu at 0x7f...>`): the first of its module's non-private
  parents that holds it, else its defining module. `functools.partial`,
  lists, tuples and dicts are printed element by element, and any
  remaining ` at 0x...` address is dropped, so equal configs print equal.

  Example:
    >>> import functools, jax
    >>> value_text(functools.partial(jax.nn.gelu, approximate=False))
    'functools.partial(jax.nn.gelu, approximate=False)'
  """
  if isinstance(value, functools.partial):
    parts = [value_text(value.func), *map(value_text, value.args)]
    parts += [f'{k}={value_text(v)}' for k, v in value.keywords.items()]
    return f'functools.partial({", ".join(parts)})'
  if isinstance(value, list | tuple) and not hasattr(value, '_fields'):
    inner = ', '.join(map(value_text, value))
    if isinstance(value, list):
      return f'[{inner}]'
    return f'({inner},)' if len(value) == 1 else f'({inner})'
  if isinstance(value, dict):
    items = (f'{value_text(k)}: {value_text(v)}' for k, v in value.items())
    return '{' + ', '.join(items) + '}'
  if callable(value) and hasattr(value, '__qualname__'):
    return _dotted_name(value)
  return re.sub(r' at 0x[0-9a-fA-F]+>', '>', repr(value))


def _dotted_name(fn: Any) -> str:
  module = getattr(fn, '__module__', None) or ''
  name = fn.__qualname__
  public = [m for m in module.split('.') if not m.startswith('_')]
  for i in range(len(public), 0, -1):
    parent = sys.modules.get('.'.join(public[:i]))
    if parent is not None and getattr(parent, name, None) is fn:
      return f'{parent.__name__}.{name}'
  return f'{module}.{name}' if module else name


def _holds_buildable(value: Any) -> bool:
  return any(isinstance(v, fdl.Buildable) for v, _ in daglish.iterate(value))


def _class_name(fn: Any) -> str:
  name = getattr(fn, '__qualname__', repr(fn))
  module = getattr(fn, '__module__', '') or ''
  return name if module.startswith('aqtr.') else f'{module}.{name}'


def _unused_paths(cfg: Any) -> set[str]:
  """Paths of backward rhs operands that use_fwd_quant leaves unused."""
  unused = set()
  for value, p in daglish.iterate(cfg, memoized=False):
    if not tags.is_config_of(value, DotGeneralConfig):
      continue
    for pass_ in ('dlhs', 'drhs'):
      raw = getattr(value, pass_, None)
      if getattr(raw, 'use_fwd_quant', False) is True:
        unused.add(path_str((*p, daglish.Attr(pass_), daglish.Attr('rhs'))))
  return unused
