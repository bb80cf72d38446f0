"""Select config nodes by a regex over their dotted path.

Fiddle selects by class (`fdl.select(cfg, AbsMax)`) and by tag; this adds
selection by position. Every node of a tree of Buildables, lists, tuples and
dicts has a dotted path (`fwd.lhs.numerics.bits`, `layers[0].attention`);
`select_path(cfg, pattern)` matches `re.fullmatch(pattern, path)`. It knows
nothing about aqtr's tree, so it serves model configs as well
(`'.*attention.*\\.dot_general'`).

Unlike `fdl.select(...).set`, which shares one value object across all
matches, both `set` and `replace` here put a fresh deep copy at every match,
so a later edit at one path never leaks into another. After a change the
aqtr role tags are refreshed (`aqtr.tags.tag_roles`).

Example:
  >>> import aqtr
  >>> cfg = aqtr.fiddle.config('int8')
  >>> sel = select_path(cfg, r'(dlhs|drhs)\\.lhs\\.numerics')
  >>> sel.paths
  ('dlhs.lhs.numerics', 'drhs.lhs.numerics')
  >>> sel.set(bits=4)
  >>> cfg.drhs.lhs.numerics.bits, cfg.drhs.rhs.numerics.bits
  (4, 8)
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import fiddle as fdl
from fiddle import daglish, selectors

from aqtr import tags
from aqtr.fiddle import path_str

__all__ = ['PathSelection', 'paths', 'select_path']


def paths(cfg: Any) -> dict[str, Any]:
  """Every node of `cfg` by dotted path (the root, '', left out), in order.

  Example:
    >>> import aqtr
    >>> list(paths(aqtr.fiddle.config('int8')))[:3]
    ['fwd', 'fwd.lhs', 'fwd.lhs.numerics']
  """
  return {path_str(p): v for v, p in daglish.iterate(cfg, memoized=False) if p}


@dataclasses.dataclass(frozen=True)
class PathSelection(selectors.Selection):
  """The nodes of `cfg` whose dotted path fully matches `pattern`.

  Attributes:
    cfg: the root config (mutated in place by `set` / `replace`).
    pattern: a regular expression matched against whole dotted paths.
    fn_or_cls: if given, only Buildables of this callable (or subclass).
  """

  cfg: Any
  pattern: str
  fn_or_cls: Any = None

  def _matches(self) -> list[tuple[daglish.Path, Any]]:
    regex = re.compile(self.pattern)
    found = []
    for value, p in daglish.iterate(self.cfg, memoized=False):
      if not p or not regex.fullmatch(path_str(p)):
        continue
      if self.fn_or_cls is not None and not _is_of(value, self.fn_or_cls):
        continue
      found.append((p, value))
    return found

  @property
  def paths(self) -> tuple[str, ...]:
    """The dotted paths of the matches, in tree order."""
    return tuple(path_str(p) for p, _ in self._matches())

  def __iter__(self) -> Iterator[Any]:
    return iter([v for _, v in self._matches()])

  def __len__(self) -> int:
    return len(self._matches())

  def get(self, name: str) -> Iterator[Any]:
    """The value of argument `name` of every matched Buildable."""
    for p, value in self._matches():
      yield getattr(_buildable(p, value), name)

  def set(self, /, **kwargs: Any) -> None:
    """Sets arguments on every matched Buildable (deep copies per match).

    Raises:
      ValueError: nothing matched (the message lists nearby paths).
      TypeError: a match is a plain value, not a Buildable.
      AttributeError: a matched Buildable has no such argument.
    """
    nodes = [_buildable(p, value) for p, value in self._nonempty()]
    for node in nodes:
      for name, v in kwargs.items():
        setattr(node, name, copy.deepcopy(v))
    tags.tag_roles(self.cfg)

  def replace(self, value: Any, deepcopy: bool = True) -> None:
    """Replaces every match by `value` (a deep copy per match by default).

    When matches nest, the outermost one is replaced. Values inside tuples
    cannot be replaced (tuples are immutable); select the tuple instead.
    """
    done: list[daglish.Path] = []
    for p, _ in self._nonempty():
      if any(p[: len(q)] == q for q in done):
        continue
      parent = daglish.follow_path(self.cfg, p[:-1])
      new = copy.deepcopy(value) if deepcopy else value
      _put(parent, p[-1], new, path_str(p))
      done.append(p)
    tags.tag_roles(self.cfg)

  def _nonempty(self) -> list[tuple[daglish.Path, Any]]:
    found = self._matches()
    if not found:
      known = ', '.join(list(paths(self.cfg))[:40])
      kind = f' of {self.fn_or_cls!r}' if self.fn_or_cls is not None else ''
      raise ValueError(
        f'No path{kind} fully matches {self.pattern!r}; paths are: {known}'
        f'{", ..." if len(paths(self.cfg)) > 40 else ""}.'
      )
    return found


def select_path(cfg: Any, pattern: str, fn_or_cls: Any = None) -> PathSelection:
  """Selects the nodes of `cfg` whose dotted path fully matches `pattern`.

  Args:
    cfg: a Fiddle config tree (Buildables, lists, tuples, dicts).
    pattern: regular expression over whole dotted paths, e.g. `'dlhs\\..*'`
      or `'.*\\.rhs'`. Paths have no leading dot; list items are `[i]`.
    fn_or_cls: keep only Buildables of this class (or a subclass), e.g.
      `aqtr.TensorConfig`.

  Returns:
    A `PathSelection` (iterate it, `.paths`, `.set(**kw)`, `.replace(v)`).

  Example:
    >>> import fiddle as fdl, aqtr
    >>> cfg = aqtr.fiddle.config('int8')
    >>> select_path(cfg, r'.*\\.rhs').paths
    ('fwd.rhs', 'dlhs.rhs', 'drhs.rhs')
  """
  re.compile(pattern)  # Fail early on a bad regex.
  return PathSelection(cfg, pattern, fn_or_cls)


def _is_of(value: Any, fn_or_cls: Any) -> bool:
  if not isinstance(value, fdl.Buildable):
    return False
  fn = fdl.get_callable(value)
  if isinstance(fn, type) and isinstance(fn_or_cls, type):
    return issubclass(fn, fn_or_cls)
  return fn is fn_or_cls


def _buildable(p: daglish.Path, value: Any) -> fdl.Buildable:
  if not isinstance(value, fdl.Buildable):
    raise TypeError(
      f'{path_str(p)} is the value {value!r}, not a config with arguments; '
      'use .replace(new_value) to change it.'
    )
  return value


def _put(parent: Any, elem: daglish.PathElement, value: Any, where: str):
  if isinstance(elem, daglish.Attr):
    setattr(parent, elem.name, value)
  elif isinstance(parent, list | dict):
    parent[elem.key if isinstance(elem, daglish.Key) else elem.index] = value
  else:
    raise TypeError(
      f'Cannot replace {where}: {type(parent).__name__} is immutable; select '
      'and replace the container instead.'
    )
