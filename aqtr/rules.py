"""Quantization rules and their report, shared by every framework seam.

A `Rule` says which ops of an existing model run quantized and how; the
Pax injection (`aqtr.pax.inject`) and the Flax interception
(`aqtr.flax.quantize`) take the same rules and give the same `Report`.
A rule matches an op when all of its criteria hold (none: every op):

  path    a regex that fully matches the op's path or an ancestor's:
          '/' and '.' separate parts alike ('decoder/.*layers.*' and
          'decoder\\..*layers.*' are the same rule), list indices may be
          written `layers[0]`, `layers.0` or `layers/0`
  layer   a class (or tuple): the op's module or an enclosing one is one
  tag     a Fiddle tag (or tuple) on a Pax op's field
  op      an op kind (or tuple): 'dot_general' (also `jnp.matmul`, `@`,
          `jnp.dot`), 'einsum', 'conv', 'ragged_dot'
  weight  True: one operand is a module parameter (the weight); False:
          no operand is (activation x activation, e.g. attention)

The first matching rule wins; its `config` (a `DotGeneralConfig`, a Fiddle
config of one, a preset name, or None: keep the op float) is the op's.
When one operand is the weight, the config's `rhs` quantizes it (the
adapters swap operands when the weight is the dot's lhs), so
`aqtr.presets.int8_weight_only()` means what it says wherever the weight
sits.

Example:
  >>> r = Rule('int8', path='decoder/.*layers.*', weight=True)
  >>> r.matches_path('decoder.layers_0.mlp'), r.label()
  (True, "Rule('int8', path='decoder/.*layers.*', weight=True)")
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import fiddle as fdl

from aqtr import fiddle as aqtr_fiddle
from aqtr import presets
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig

__all__ = ['KINDS', 'OpEntry', 'Report', 'Rule', 'describe']

# The op kinds a rule can select.
KINDS = ('dot_general', 'einsum', 'conv', 'ragged_dot')


def as_tuple(value: Any) -> tuple[Any, ...]:
  """`value` as a tuple (a list or tuple as is, anything else alone)."""
  return tuple(value) if isinstance(value, tuple | list) else (value,)


def spellings(path: str) -> tuple[str, ...]:
  """The spellings of one path a rule's regex may match.

  Example:
    >>> spellings('layers[0]/attn')
    ('layers[0]/attn', 'layers.0/attn', 'layers[0].attn', 'layers.0.attn')
  """
  dotted = re.sub(r'\[(\d+)\]', r'.\1', path)
  out = [path, dotted, path.replace('/', '.'), dotted.replace('/', '.')]
  return tuple(dict.fromkeys(out))


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
  """Set `config` on the ops matching all of the criteria.

  A rule with no criterion matches every op.

  Attributes:
    config: DotGeneralConfig, Fiddle config of one, preset name, or None.
    path: regex over op / ancestor paths (re.fullmatch; '/' or '.').
    layer: class or tuple of classes of the op's module or an ancestor.
    tag: Fiddle tag or tuple of tags on the op's field (Pax).
    op: op kind or tuple of them (`KINDS`).
    weight: True (ops with a parameter operand), False (ops without), or
      None (either).
    name: label used in the report (default: the criteria).

  Example:
    >>> Rule('int8', path='.*attention.*').label()
    "Rule('int8', path='.*attention.*')"
  """

  config: Any = None
  path: str | None = dataclasses.field(default=None, kw_only=True)
  layer: Any = dataclasses.field(default=None, kw_only=True)
  tag: Any = dataclasses.field(default=None, kw_only=True)
  op: Any = dataclasses.field(default=None, kw_only=True)
  weight: bool | None = dataclasses.field(default=None, kw_only=True)
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
    for cls in as_tuple(self.layer) if self.layer is not None else ():
      if not isinstance(cls, type):
        raise TypeError(f'Rule.layer must be a class or tuple, got {cls!r}.')
    for tag in as_tuple(self.tag) if self.tag is not None else ():
      if not (isinstance(tag, type) and issubclass(tag, fdl.Tag)):
        raise TypeError(f'Rule.tag must be a fdl.Tag subclass, got {tag!r}.')
    for kind in as_tuple(self.op) if self.op is not None else ():
      if kind not in KINDS:
        raise ValueError(
          f'Rule.op: unknown op kind {kind!r}; allowed: {", ".join(KINDS)}.'
        )
    if self.weight not in (None, True, False):
      raise TypeError(
        f'Rule.weight must be True, False or None, got {self.weight!r}.'
      )

  def matches_path(self, *paths: str) -> bool:
    """Whether the path regex fully matches one of `paths` (or has none)."""
    if self.path is None:
      return True
    rx = re.compile(re.sub(r'\\\.|/', '[./]', self.path))
    return any(rx.fullmatch(s) for p in paths for s in spellings(p))

  def matches(self, site: Any) -> bool:
    """Whether this rule selects the op at `site`.

    `site` has `path`, `prefixes` (ancestor paths), `layers` (classes of
    enclosing modules), `op_cls`, `tags`, `kind` (op kind) and `weight`
    (whether an operand is a parameter; None: unknown, any rule matches).
    """
    if not self.matches_path(site.path, *site.prefixes):
      return False
    if self.layer is not None:
      classes = as_tuple(self.layer)
      owners = (*site.layers, site.op_cls)
      if not any(
        isinstance(f, type) and issubclass(f, classes) for f in owners
      ):
        return False
    if self.tag is not None and not set(as_tuple(self.tag)) & site.tags:
      return False
    if self.op is not None and site.kind not in as_tuple(self.op):
      return False
    weight = site.weight
    return self.weight is None or weight is None or weight == self.weight

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
        names = [getattr(v, '__name__', repr(v)) for v in as_tuple(value)]
        parts.append(f'{key}={"|".join(names)}')
    if self.op is not None:
      parts.append(f'op={"|".join(as_tuple(self.op))}')
    if self.weight is not None:
      parts.append(f'weight={self.weight}')
    return f'Rule({", ".join(parts)})'


def _short(config: Any) -> str:
  if isinstance(config, fdl.Buildable):
    return f'<fdl.Config {fdl.get_callable(config).__name__}>'
  if isinstance(config, DotGeneralConfig):
    return f'<{describe(config)}>'
  return repr(config)


def resolve(config: Any) -> Any:
  """A fresh value for one op: presets expanded, Fiddle configs copied."""
  if isinstance(config, str):
    return aqtr_fiddle.config(config)
  if isinstance(config, fdl.Buildable):
    return copy.deepcopy(config)
  return config


def built(config: Any, where: str) -> Any:
  """`config` built to a DotGeneralConfig (errors name the op `where`)."""
  if not isinstance(config, fdl.Buildable):
    return config
  try:
    return aqtr_fiddle.build(config)
  except Exception as e:  # re-raised with the op path
    raise ValueError(f'{where}: the op config does not build: {e}') from e


def as_rules(rules: Any, who: str) -> tuple[Rule, ...]:
  """`rules` (a Rule, a sequence of them, or {path: config}) as a tuple."""
  if isinstance(rules, Rule):
    rules = [rules]
  elif isinstance(rules, dict):
    rules = [Rule(c, path=p) for p, c in rules.items()]
  if not isinstance(rules, list | tuple):
    raise TypeError(f'{who}: rules must be a list of Rule, got {rules!r}.')
  for r in rules:
    if not isinstance(r, Rule):
      raise TypeError(f'{who}: rules must hold aqtr Rule objects, got {r!r}.')
  return tuple(rules)


# Configs are shown in one short line: a preset name when the config equals
# a preset, else per pass `lhs x rhs` with `f` (float), `i<bits>`, `e4m3` /
# `e5m2`, and `fq` for a backward residual that reuses the forward
# quantization; `@0.9` is an absmax clip scale, `/t128` a sub-channel tile,
# `~sr` stochastic rounding, `:2of4` N:M sparsity (`:magnitude` another).
_PRESETS = (
  'int8',
  'int8_sparse_2_4',
  'int8_fwd',
  'int8_weight_only',
  'int4_weight_only',
  'fp8',
  'fp8_full',
  'float',
)


def _sparsity(t: TensorConfig) -> str:
  sp = t.sparsity
  if not sp.prunes:
    return ''
  if hasattr(sp, 'n') and hasattr(sp, 'm'):
    return f':{sp.n}of{sp.m}'
  return f':{getattr(sp, "registered_name", type(sp).__name__)}'


def _tensor(t: TensorConfig) -> str:
  n = t.numerics
  if not n.quantizes:
    return 'f' + _sparsity(t)
  if n.kind == 'int' and hasattr(n, 'bits'):
    s = f'i{n.bits}'
  elif hasattr(n, 'dtype_name'):
    s = n.dtype_name.removeprefix('float8_').removesuffix('fn')
  else:
    s = type(n).__name__
  clip = getattr(t.calibration, 'clip_scale', 1.0)
  if clip != 1.0:
    s += f'@{clip:g}'
  tile = getattr(t.tiling, 'tile_size', 0) or getattr(t.tiling, 'tile_count', 0)
  if tile:
    s += f'/t{tile}'
  if t.rounding.stochastic:
    s += '~sr'
  return s + _sparsity(t)


def _raw(r: DotGeneralRaw) -> str:
  rhs = 'fq' if r.use_fwd_quant else _tensor(r.rhs)
  return f'{_tensor(r.lhs)}x{rhs}'


def describe(config: Any) -> str:
  """A one-line summary of an op config.

  Args:
    config: a DotGeneralConfig, None (float) or any other value.

  Returns:
    The preset name when `config` equals one, else a per-pass summary.

  Example:
    >>> import aqtr
    >>> describe(aqtr.presets.int8()), describe(None)
    ('int8', 'float')
    >>> describe(aqtr.presets.fully_quantized(4, 8))
    'fwd i4xi4 | dlhs i8xfq | drhs i8xfq'
  """
  if config is None:
    return 'float'
  if not isinstance(config, DotGeneralConfig):
    return repr(config)
  for name in _PRESETS:
    preset = getattr(presets, name, None)
    if preset is not None and config == preset():
      return name
  if config.is_float:
    return 'float'
  return ' | '.join(
    f'{p} {_raw(getattr(config, p))}' for p in ('fwd', 'dlhs', 'drhs')
  )


@dataclasses.dataclass(frozen=True)
class OpEntry:
  """One op of a quantized model.

  Attributes:
    path: the op's path (Pax: dotted op path; Flax: module path + op id).
    op: the op's name (Pax: op class; Flax: the intercepted function).
    config: the op's built config (None: float).
    rule: index of the rule that set it, or None (left as it was).
    kind: op kind (`KINDS`), when known.
    weight: which operand is a parameter ('lhs', 'rhs'), or None.
    shapes: the operands' shapes, when known.
  """

  path: str
  op: str
  config: Any
  rule: int | None
  kind: str | None = None
  weight: str | None = None
  shapes: tuple[tuple[int, ...], ...] | None = None

  @property
  def quantized(self) -> bool:
    """Whether the op runs quantized."""
    c = self.config
    return c is not None and not (
      isinstance(c, DotGeneralConfig) and c.is_float
    )

  def details(self) -> str:
    """Op name, shapes and weight side in a few words ('' for Pax ops)."""
    if self.shapes is None:
      return ''
    shapes = ' x '.join(str(list(s)) for s in self.shapes)
    w = f' weight={self.weight}' if self.weight else ''
    return f'  {self.op} {shapes}{w}'


@dataclasses.dataclass(frozen=True)
class Report:
  """Every op with its config, and which rules matched what.

  Attributes:
    ops: one entry per op, in the order met.
    rules: the rules, in order (first match wins).
    wins: per rule, the number of ops it set.
    hits: per rule, the number of ops it matched (including ops an earlier
      rule took).
    unshared: paths whose shared config node was replaced by a copy (Pax).
  """

  ops: tuple[OpEntry, ...]
  rules: tuple[Any, ...]
  wins: tuple[int, ...]
  hits: tuple[int, ...]
  unshared: tuple[str, ...] = ()

  @property
  def unused_rules(self) -> list[Any]:
    """The rules that set no op (matched nothing, or only shadowed ops)."""
    return [r for r, w in zip(self.rules, self.wins, strict=True) if not w]

  def configs(self) -> dict[str, Any]:
    """Op path -> built config (None: float)."""
    return {e.path: e.config for e in self.ops}

  def quantized_paths(self) -> list[str]:
    """The paths of the ops that run quantized, in order."""
    return [e.path for e in self.ops if e.quantized]

  def float_paths(self) -> list[str]:
    """The paths of the ops left float, in order."""
    return [e.path for e in self.ops if not e.quantized]

  def unused_text(self) -> str:
    """One line per unused rule, saying whether it matched at all."""
    lines = []
    for i, (r, w, h) in enumerate(
      zip(self.rules, self.wins, self.hits, strict=True)
    ):
      if w:
        continue
      why = (
        f'its {h} matching op(s) were taken by earlier rules'
        if h
        else 'matched no op'
      )
      lines.append(f'  rule {i} {r.label()}: {why}')
    return '\n'.join(lines)

  def __str__(self) -> str:
    width = max((len(e.path) for e in self.ops), default=0)
    lines = [f'{len(self.quantized_paths())}/{len(self.ops)} ops quantized']
    for e in self.ops:
      src = f'rule {e.rule}' if e.rule is not None else 'unchanged'
      lines.append(
        f'  {e.path:<{width}}  {describe(e.config)}  [{src}]{e.details()}'
      )
    if self.unshared:
      lines.append('shared nodes copied at: ' + ', '.join(self.unshared))
    unused = self.unused_text()
    if unused:
      lines.append('unused rules:\n' + unused)
    return '\n'.join(lines)
