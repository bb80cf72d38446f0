"""Quantize an existing model config by rules, without editing layer code.

`inject(model_cfg, rules)` walks a copy of the model's Fiddle config, finds
every op site (`aqtr.pax.paths`), and gives each op the config of the first
rule that matches it. A rule matches by any combination (all must hold) of

  path   a regex that fully matches the op's dotted path or one of its
         ancestors' (`'layers\\.0'` takes every op under layer 0);
         list indices may be written `layers[0]` (the `aqtr.selectors`
         syntax) or `layers.0`
  layer  a class (or tuple): the op or one of its enclosing layers is an
         instance (`aqtr.pax.Linear`, `aqtr.pax.Attention`, `ConvOp`)
  tag    a Fiddle tag (or tuple) on the op's field or its `config`
         argument (`aqtr.pax.tags.WeightOp`, `ActivationOp`)

and sets `config`: a DotGeneralConfig, a Fiddle config of one (deep-copied
per op), a preset name ('int8': `aqtr.fiddle.config('int8')`, a fresh
expanded Fiddle tree per op, so `aqtr.tags` / `aqtr.selectors` reach it
afterwards), or None (float: a way to exclude ops from later rules).
Ops no rule matches keep what they had. The input config is never changed.

Example:
  >>> import aqtr.pax
  >>> cfg = aqtr.pax.templates.transformer_lm(32, 16, 2, 2, 32)
  >>> rules = [Rule(None, path=r'layers\\.1\\..*'),
  ...          Rule('int8', layer=aqtr.pax.Linear),
  ...          Rule('fp8', tag=aqtr.pax.tags.ActivationOp, path='nowhere')]
  >>> new, report = inject(cfg, rules)
  >>> report.quantized_paths()[:2]
  ['layers[0].attention.q_proj.einsum', 'layers[0].attention.k_proj.einsum']
  >>> len(report.quantized_paths()), [r.label() for r in report.unused_rules]
  (6, ["Rule('fp8', path='nowhere', tag=ActivationOp)"])
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from aqtr import presets
from aqtr.core.config import DotGeneralConfig
from aqtr.pax import paths
from aqtr.pax.report import InjectionReport, OpEntry, describe

__all__ = ['Rule', 'inject']

_log = logging.getLogger(__name__)


def _as_tuple(value: Any) -> tuple[Any, ...]:
  return tuple(value) if isinstance(value, tuple | list) else (value,)


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
  """Set `config` on the ops matching all of `path`, `layer` and `tag`.

  A rule with no criterion matches every op.

  Attributes:
    config: DotGeneralConfig, Fiddle config of one, preset name, or None.
    path: regex over dotted op / ancestor paths (re.fullmatch).
    layer: class or tuple of classes of the op or an enclosing layer.
    tag: Fiddle tag or tuple of tags on the op's field.
    name: label used in the report (default: the criteria).

  Example:
    >>> Rule('int8', path='.*attention.*').label()
    "Rule('int8', path='.*attention.*')"
  """

  config: Any = None
  path: str | None = dataclasses.field(default=None, kw_only=True)
  layer: Any = dataclasses.field(default=None, kw_only=True)
  tag: Any = dataclasses.field(default=None, kw_only=True)
  name: str | None = dataclasses.field(default=None, kw_only=True)

  def __post_init__(self):
    c = self.config
    if isinstance(c, str):
      if c not in presets.__all__:
        raise ValueError(
          f'Rule.config: unknown preset {c!r}; presets: '
          f'{", ".join(presets.__all__)}.'
        )
    elif c is not None and not isinstance(c, DotGeneralConfig | fdl.Buildable):
      raise TypeError(
        'Rule.config must be a DotGeneralConfig, a Fiddle config of one, a '
        f'preset name or None, got {c!r}.'
      )
    if self.path is not None:
      try:
        re.compile(self.path)
      except re.error as e:
        raise ValueError(f'Rule.path {self.path!r} is not a regex: {e}.') from e
    for cls in _as_tuple(self.layer) if self.layer is not None else ():
      if not isinstance(cls, type):
        raise TypeError(f'Rule.layer must be a class or tuple, got {cls!r}.')
    for tag in _as_tuple(self.tag) if self.tag is not None else ():
      if not (isinstance(tag, type) and issubclass(tag, fdl.Tag)):
        raise TypeError(f'Rule.tag must be a fdl.Tag subclass, got {tag!r}.')

  def matches(self, site: paths.OpSite) -> bool:
    """Whether this rule selects the op at `site`."""
    if self.path is not None:
      rx = re.compile(self.path)
      names = (site.path, *site.prefixes)
      if not any(
        rx.fullmatch(n) or rx.fullmatch(paths.index_dotted(n)) for n in names
      ):
        return False
    if self.layer is not None:
      classes = _as_tuple(self.layer)
      owners = (*site.layers, site.op_cls)
      if not any(
        isinstance(f, type) and issubclass(f, classes) for f in owners
      ):
        return False
    if self.tag is not None and not set(_as_tuple(self.tag)) & site.tags:
      return False
    return True

  def label(self) -> str:
    """The rule's name, or its criteria in one line."""
    if self.name:
      return self.name
    parts = [_short(self.config)]
    if self.path is not None:
      parts.append(f'path={self.path!r}')
    for key in ('layer', 'tag'):
      value = getattr(self, key)
      if value is not None:
        names = [getattr(v, '__name__', repr(v)) for v in _as_tuple(value)]
        parts.append(f'{key}={"|".join(names)}')
    return f'Rule({", ".join(parts)})'


def _short(config: Any) -> str:
  if isinstance(config, fdl.Buildable):
    return f'<fdl.Config {fdl.get_callable(config).__name__}>'
  if isinstance(config, DotGeneralConfig):
    return f'<{describe(config)}>'
  return repr(config)


def _resolve(config: Any) -> Any:
  """A fresh value for one op: presets expanded, Fiddle configs copied."""
  if isinstance(config, str):
    return aqtr_fiddle.config(config)
  if isinstance(config, fdl.Buildable):
    return copy.deepcopy(config)
  return config


def _built(config: Any, where: str) -> Any:
  if not isinstance(config, fdl.Buildable):
    return config
  try:
    return aqtr_fiddle.build(config)
  except Exception as e:  # re-raised with the op path
    raise ValueError(f'{where}: the op config does not build: {e}') from e


def _as_rules(rules: Any) -> tuple[Rule, ...]:
  if isinstance(rules, Rule):
    rules = [rules]
  elif isinstance(rules, Mapping):
    rules = [Rule(c, path=p) for p, c in rules.items()]
  if not isinstance(rules, Sequence):
    raise TypeError(f'rules must be a list of Rule, got {rules!r}.')
  for r in rules:
    if not isinstance(r, Rule):
      raise TypeError(f'rules must hold aqtr.pax.Rule objects, got {r!r}.')
  return tuple(rules)


def inject(
  model_cfg: Any,
  rules: Sequence[Rule] | Mapping[str, Any] | Rule,
  *,
  strict: bool = False,
) -> tuple[Any, InjectionReport]:
  """Returns a copy of `model_cfg` with op configs set by `rules`.

  Args:
    model_cfg: a model's Fiddle config (not modified).
    rules: rules in priority order (the first matching rule wins), or a
      mapping {path regex: config}.
    strict: raise when a rule sets no op.

  Returns:
    (new config, report): the report lists every op path with its config
    and the rule that set it, and the rules that set nothing. It is also
    logged at INFO level (logger 'aqtr.pax.inject').

  Raises:
    ValueError: `strict` and some rule set no op; or a rule's config does
      not build (the message names the op path).

  Example:
    >>> import aqtr.pax
    >>> cfg = aqtr.pax.templates.feed_forward(8, 16)
    >>> new, report = inject(cfg, {r'wo': 'int8'})
    >>> report.configs()['wo.einsum'] == aqtr.presets.int8()
    True
    >>> cfg.wo.einsum.config is None  # the input is unchanged
    True
  """
  rules = _as_rules(rules)
  cfg = copy.deepcopy(model_cfg)
  unshared = paths.unshare(cfg)
  wins, hits = [0] * len(rules), [0] * len(rules)
  entries = []
  for site in paths.find_ops(cfg):
    chosen = None
    for i, rule in enumerate(rules):
      if rule.matches(site):
        hits[i] += 1
        chosen = i if chosen is None else chosen
    if chosen is not None:
      wins[chosen] += 1
      site.set_config(_resolve(rules[chosen].config))
    op = site.op
    current = op.__arguments__.get('config') if op is not None else None
    entries.append(
      OpEntry(
        path=site.path,
        op=site.op_cls.__name__,
        config=_built(current, site.path),
        rule=chosen,
      )
    )
  report = InjectionReport(
    ops=tuple(entries),
    rules=rules,
    wins=tuple(wins),
    hits=tuple(hits),
    unshared=tuple(unshared),
  )
  _log.info('aqtr.pax.inject:\n%s', report)
  if strict and report.unused_rules:
    raise ValueError(
      'aqtr.pax.inject(strict=True): rules that set no op:\n'
      f'{report.unused_text()}\nop paths: '
      f'{", ".join(e.path for e in report.ops)}'
    )
  return cfg, report
