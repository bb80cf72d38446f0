"""Quantize an existing model config by rules, without editing layer code.

`inject(model_cfg, rules)` (rules: `aqtr.rules.Rule`, the type the Flax
interception takes too) walks a copy of the model's Fiddle config, finds
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
  op     an op kind: 'einsum', 'dot_general', 'ragged_dot', 'conv'
  weight True / False: the op is tagged WeightOp / ActivationOp

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
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from aqtr import rules as rules_lib
from aqtr.pax import paths
from aqtr.pax.report import InjectionReport, OpEntry
from aqtr.rules import Rule

__all__ = ['Rule', 'inject']

_log = logging.getLogger(__name__)


def _as_rules(rules: Any) -> tuple[Rule, ...]:
  if isinstance(rules, Mapping) and not isinstance(rules, dict):
    rules = dict(rules)
  if isinstance(rules, Sequence) and not isinstance(rules, list | tuple):
    rules = list(rules)
  return rules_lib.as_rules(rules, 'aqtr.pax.inject')


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
      site.set_config(rules_lib.resolve(rules[chosen].config))
    op = site.op
    current = op.__arguments__.get('config') if op is not None else None
    entries.append(
      OpEntry(
        path=site.path,
        op=site.op_cls.__name__,
        config=rules_lib.built(current, site.path),
        kind=site.kind,
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
