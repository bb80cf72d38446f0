"""Op sites of a model config: every injectable op with its dotted path.

A site is a slot that holds (or may hold) an op: an op field of a layer
config (`Linear.einsum`, found from the field's annotation even when it is
unset) or any `fdl.Config` of an `Op` subclass inside a list or dict. Paths
use the syntax of `aqtr.selectors` (`aqtr.fiddle.path_str`):
`layers[0].attention.q_proj.einsum`.

`unshare` first makes every Buildable reachable by one path only (a second
reference becomes a deep copy), so setting an op at one path never changes
another: a template put into a list N times (`[block] * n`) becomes N
independent layers.

Example:
  >>> import aqtr.pax
  >>> cfg = aqtr.pax.templates.feed_forward(8, 16)
  >>> [site.path for site in find_ops(cfg)]
  ['wi.einsum', 'wo.einsum']
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import fiddle as fdl
from fiddle import daglish

from aqtr.fiddle import path_str
from aqtr.pax import tags as pax_tags
from aqtr.pax.ops import (
  ConvOp,
  DotGeneralOp,
  EinsumOp,
  Op,
  RaggedDotOp,
  op_fields,
)

__all__ = ['OpSite', 'find_ops', 'index_dotted', 'unshare']

_KINDS = (
  (EinsumOp, 'einsum'),
  (DotGeneralOp, 'dot_general'),
  (RaggedDotOp, 'ragged_dot'),
  (ConvOp, 'conv'),
)


def index_dotted(path: str) -> str:
  """`layers[0].ffn` -> `layers.0.ffn` (list indices as dotted parts).

  Example:
    >>> index_dotted('layers[10].attention.q_proj')
    'layers.10.attention.q_proj'
  """
  return re.sub(r'\[(\d+)\]', r'.\1', path)


def _is_op(value: Any) -> bool:
  fn = fdl.get_callable(value) if isinstance(value, fdl.Buildable) else None
  return isinstance(fn, type) and issubclass(fn, Op)


@dataclasses.dataclass(frozen=True, eq=False)
class OpSite:
  """One op slot of a config tree: what an `aqtr.pax.Rule` matches.

  Not a weight site (`aqtr.flax.sites.WeightSite`): a slot is matched
  before the template is built or traced, for every op, with or without a
  weight; it holds no parameter path.

  Attributes:
    path: dotted path of the op (`layers[0].ffn.wi.einsum`).
    parent: the container holding the op: a layer's Buildable, a list or
      a dict.
    key: the daglish path element of the op in `parent`.
    op_cls: the op class (from the node, else from the field annotation).
    layers: callables of the Buildables from the root down to `parent`.
    prefixes: dotted paths of the ancestors, outermost first (no root).
    tags: tags on the parent's field and on the op's `config` argument.
  """

  path: str
  parent: Any
  key: daglish.PathElement
  op_cls: type[Op]
  layers: tuple[Any, ...]
  prefixes: tuple[str, ...]
  tags: frozenset[Any]

  @property
  def kind(self) -> str | None:
    """The op kind a `Rule(op=...)` selects ('einsum', 'conv', ...)."""
    for cls, kind in _KINDS:
      if issubclass(self.op_cls, cls):
        return kind
    return None

  @property
  def weight(self) -> bool | None:
    """True / False when the op is tagged a weight / activation op."""
    if pax_tags.WeightOp in self.tags:
      return True
    if pax_tags.ActivationOp in self.tags:
      return False
    return None

  @property
  def op(self) -> fdl.Buildable | None:
    """The op's `fdl.Config`, or None when the field is unset (float)."""
    if isinstance(self.key, daglish.Attr):
      return self.parent.__arguments__.get(self.key.name)
    return self.key.follow(self.parent)

  def replace(self, node: fdl.Buildable) -> None:
    """Puts `node` in the op's slot (e.g. a subclass of the op)."""
    _put(self.parent, self.key, node)

  def set_config(self, config: Any) -> None:
    """Sets the op's `config`, creating the op node when it is unset."""
    op = self.op
    if op is None:
      if config is None:
        return
      _put(self.parent, self.key, fdl.Config(self.op_cls, config=config))
    else:
      op.config = config


def _put(parent: Any, key: daglish.PathElement, value: Any) -> None:
  if isinstance(key, daglish.Attr):
    setattr(parent, key.name, value)
  elif isinstance(key, daglish.Index):
    parent[key.index] = value
  else:
    parent[key.key] = value


def _children(value: Any) -> list[tuple[daglish.PathElement, Any]]:
  if isinstance(value, fdl.Buildable):
    return [
      (daglish.Attr(k) if isinstance(k, str) else daglish.Index(k), v)
      for k, v in value.__arguments__.items()
    ]
  if isinstance(value, list | tuple):
    return [(daglish.Index(i), v) for i, v in enumerate(value)]
  if isinstance(value, dict):
    return [(daglish.Key(k), v) for k, v in value.items()]
  return []


def unshare(cfg: Any) -> list[str]:
  """Deep-copies every second reference to a Buildable, list or dict.

  Args:
    cfg: a config tree, edited in place.

  Returns:
    The dotted paths that received a copy.

  Example:
    >>> import fiddle as fdl, aqtr.pax
    >>> ffn = aqtr.pax.templates.feed_forward(8, 16)
    >>> ffn.wo = ffn.wi
    >>> unshare(ffn), ffn.wo is ffn.wi
    (['wo'], False)
  """
  seen = {id(cfg)}
  copied: list[str] = []

  def visit(value: Any, path: daglish.Path) -> Any:
    changed = []
    for elem, child in _children(value):
      new = child
      if isinstance(child, fdl.Buildable | list | dict):
        if id(child) in seen:
          new = copy.deepcopy(child)
          copied.append(path_str(path + (elem,)))
        seen.add(id(new))
      new = visit(new, path + (elem,))
      if new is not child:
        changed.append((elem, new))
    if isinstance(value, tuple) and changed:
      items = list(value)
      for elem, new in changed:
        items[elem.index] = new
      return type(value)(*items) if hasattr(value, '_fields') else tuple(items)
    for elem, new in changed:
      _put(value, elem, new)
    return value

  visit(cfg, ())
  return copied


def find_ops(cfg: Any) -> list[OpSite]:
  """Every op site of `cfg`, in tree order.

  Args:
    cfg: a model config tree (Buildables, lists, tuples, dicts).

  Returns:
    The sites; op nodes are not descended into.

  Example:
    >>> import aqtr.pax
    >>> cfg = aqtr.pax.templates.attention(8, 2)
    >>> [s.path for s in find_ops(cfg)][-2:]
    ['qk_einsum', 'pv_einsum']
  """
  sites: list[OpSite] = []

  def visit(value: Any, path: daglish.Path, layers: tuple[Any, ...]):
    fields: dict[str, type[Op]] = {}
    if isinstance(value, fdl.Buildable):
      fn = fdl.get_callable(value)
      layers = (*layers, fn)
      if isinstance(fn, type):
        fields = op_fields(fn)
    children = _children(value)
    if isinstance(value, fdl.Buildable):
      unset = [f for f in fields if f not in value.__arguments__]
      children += [(daglish.Attr(f), None) for f in unset]
    for elem, child in children:
      here = path + (elem,)
      field = elem.name if isinstance(elem, daglish.Attr) else None
      if _is_op(child) or (child is None and field in fields):
        sites.append(_site(value, elem, here, child, fields, layers))
      else:
        visit(child, here, layers)

  visit(cfg, (), ())
  return sites


def _site(parent, elem, path, op, fields, layers) -> OpSite:
  op_cls = fdl.get_callable(op) if op is not None else fields[elem.name]
  tags = set()
  if isinstance(parent, fdl.Buildable) and isinstance(elem, daglish.Attr):
    tags |= fdl.get_tags(parent, elem.name)
  if op is not None:
    tags |= fdl.get_tags(op, 'config')
  prefixes = tuple(path_str(path[:i]) for i in range(1, len(path)))
  return OpSite(
    path=path_str(path),
    parent=parent,
    key=elem,
    op_cls=op_cls,
    layers=layers,
    prefixes=prefixes,
    tags=frozenset(tags),
  )
