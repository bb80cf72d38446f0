"""Fold maps: the exact float rewrite that moves per-channel input scales.

A weight op reading `x` computes `x W`. For any positive `s` over x's
channels, `(x / s) (diag(s) W) = x W`. AWQ (arXiv 2306.00978) and
SmoothQuant (arXiv 2211.10438) pick `s` to make `diag(s) W` (and `x / s`)
easier to quantize; the float model stays the same when `1 / s` is folded
into the op that produces `x`:

  a norm       y = n(x) * scale (+ bias): divide scale (and bias) by s
  a linear     y = h V (+ b), feeding x through a channel-wise map (the
               attention's probs . v, SwiGLU's silu(g) * up): divide V's
               output columns (and b) by s

A `FoldGroup` names the source parameters and axes (divided by s) and the
consumer weights and their input axes (multiplied by s): every weight op
reading the same input shares one s (q/k/v after one norm; gate/up after
one norm). A consumer axis may hold each group channel `repeat` times
(grouped-query attention: the output projection reads kv_heads x groups x
head_dim channels made from kv_heads x head_dim values of `v`): its
entries are [outer, repeat, inner] over the group's [outer, inner].

`FoldMap` lists the groups and the weight ops left without one (e.g. the
projection after a GELU, the tied logits table). Models register their
map next to their code (`register`, keyed by the model class or a
predicate on the parameters): the job's stock nnx LM in
`aqtr.train.stock_lm`, the Pax LM in `aqtr.train.models`, Hugging Face
Flax Llama / Mistral / GPT-2 / OPT / BLOOM and DeepMind's Gemma in
`aqtr.ptq.hf_fold`; `find` picks one for a model, `detect` from a
parameter tree alone. Paths are
'/'-joined keys of the nested parameter dict (`nnx.to_pure_dict` trees,
with integer list keys written as digits, or linen variables).

Example:
  >>> import jax.numpy as jnp
  >>> p = {'n': {'scale': jnp.ones(2)}, 'w': {'kernel': jnp.ones((2, 3))}}
  >>> g = FoldGroup(name='n', sources=(Axis(path='n/scale'),),
  ...               consumers=(Axis(path='w/kernel'),))
  >>> q = apply(p, g, jnp.array([2.0, 4.0]))
  >>> q['n']['scale'].tolist(), q['w']['kernel'][:, 0].tolist()
  ([0.5, 0.25], [2.0, 4.0])
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from aqtr.ptq.stats import LayerStats

__all__ = [
  'Axis',
  'Entry',
  'FoldGroup',
  'FoldMap',
  'along',
  'apply',
  'check',
  'check_field',
  'check_inputs',
  'children',
  'detect',
  'expand',
  'find',
  'get',
  'linear_sources',
  'names',
  'norm_sources',
  'reduce',
  'register',
  'replace',
  'scale_stats',
  'unregister',
]

KINDS = ('norm', 'linear')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Axis:
  """One parameter's axis whose entries line up with a group's channels.

  Attributes:
    path: '/'-joined keys of the parameter in the nested params dict.
    axis: the axis (a source's output channels, a consumer's input rows).
    repeat: each group channel appears `repeat` times along the axis,
      laid out [outer, repeat, inner] over the group's [outer, inner].
    inner: the `inner` size of that layout (used when repeat > 1).
    offset: a source the model reads as `offset + value` (Gemma's
      RMSNorm multiplies by `1 + scale`: offset 1.0); folding divides
      `offset + value` by s.
  """

  path: str = ''
  axis: int = 0
  repeat: int = 1
  inner: int = 1
  offset: float = 0.0

  def __post_init__(self):
    if not isinstance(self.path, str) or not self.path:
      raise ValueError(f'Axis.path must be a non-empty str, got {self.path!r}.')
    for name in ('repeat', 'inner'):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f'Axis.{name} must be an int >= 1, got {v!r}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class FoldGroup:
  """Consumers sharing one input and the sources that produce it.

  Attributes:
    name: label of the group (reports, errors).
    sources: parameters divided by s along their axis.
    consumers: weights multiplied by s along their input axis.
    kind: 'norm' (the sources are a norm's scale/bias) or 'linear' (a
      previous linear's output columns/bias).
  """

  name: str = ''
  sources: tuple[Axis, ...] = ()
  consumers: tuple[Axis, ...] = ()
  kind: str = 'norm'

  def __post_init__(self):
    if not self.sources or not self.consumers:
      raise ValueError(
        f'FoldGroup {self.name!r}: sources and consumers must each name at '
        'least one Axis.'
      )
    if self.kind not in KINDS:
      raise ValueError(
        f'FoldGroup.kind must be one of {KINDS}, got {self.kind!r}.'
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FoldMap:
  """The fold groups of a model and the weight ops left without one.

  Attributes:
    groups: applied in order (a later group may scale a parameter an
      earlier one scaled along another axis).
    unfolded: weight parameters with no fold, input axis 0 (unsmoothed;
      AWQ still searches their clip).
    keep: parameters no solver may change (a tied embedding table, read
      by the lookup as well as by the logits op).
  """

  groups: tuple[FoldGroup, ...] = ()
  unfolded: tuple[str, ...] = ()
  keep: tuple[str, ...] = ()

  def __post_init__(self):
    names = [g.name for g in self.groups]
    if len(set(names)) != len(names):
      raise ValueError(f'FoldMap.groups: duplicate group names in {names}.')


def check_field(field: str, fold_map: Any) -> None:
  """One line unless `fold_map` (the method field `field`) is a FoldMap
  or None."""
  if fold_map is not None and not isinstance(fold_map, FoldMap):
    raise TypeError(
      f'{field} must be an aqtr.ptq.fold.FoldMap or None, got '
      f'{type(fold_map).__name__}.'
    )


def _key(tree: Mapping, part: str) -> Any:
  if part in tree:
    return part
  if part.isdigit() and int(part) in tree:
    return int(part)
  return None


def get(params: Mapping, path: str) -> jax.Array:
  """The leaf of `params` at the '/'-joined `path` (one-line KeyError)."""
  node = params
  for i, part in enumerate(path.split('/')):
    key = _key(node, part) if isinstance(node, Mapping) else None
    if key is None:
      have = sorted(map(str, node)) if isinstance(node, Mapping) else []
      where = '/'.join(path.split('/')[:i]) or '<root>'
      raise KeyError(
        f'parameter {path!r} does not exist: {where!r} has no {part!r} '
        f'(it has: {", ".join(have[:12]) or "no keys"}).'
      )
    node = node[key]
  return node


def replace(params: Mapping, path: str, value: jax.Array) -> dict:
  """A copy of `params` with the leaf at `path` replaced (others shared)."""
  part, _, rest = path.partition('/')
  key = _key(params, part)
  if key is None:
    get(params, path)  # Raises the one-line error.
  out = dict(params)
  out[key] = replace(params[key], rest, value) if rest else value
  return out


def _size(params: Mapping, group: FoldGroup, ax: Axis) -> int:
  w = get(params, ax.path)
  if not -w.ndim <= ax.axis < w.ndim:
    raise ValueError(
      f'fold group {group.name!r}: {ax.path!r} has shape {w.shape}, no axis '
      f'{ax.axis}.'
    )
  return w.shape[ax.axis]


def check(params: Mapping, fold_map: FoldMap) -> dict[str, int]:
  """Checks every path and size of `fold_map`; returns channels per group.

  Raises:
    KeyError / ValueError: one line naming the group, the parameter and
      the size it should have.
  """
  out = {}
  for g in fold_map.groups:
    n = _size(params, g, g.sources[0])
    for ax in g.sources + g.consumers:
      size = _size(params, g, ax)
      want = n * ax.repeat
      if size != want or (ax.repeat > 1 and n % ax.inner):
        raise ValueError(
          f'fold group {g.name!r}: {ax.path!r} axis {ax.axis} has {size} '
          f'entries, the group has {n} channels (from '
          f'{g.sources[0].path!r}) x repeat {ax.repeat}.'
        )
    out[g.name] = n
  for path in fold_map.unfolded + fold_map.keep:
    get(params, path)
  return out


def check_inputs(
  params: Mapping, fold_map: FoldMap, contracting: Mapping[str, tuple]
) -> None:
  """Checks that each consumer's op contracts exactly its `Axis.axis`.

  Args:
    params: the parameters.
    fold_map: the map.
    contracting: {weight parameter path: the op's contracting dims} of
      the calibrated ops (consumers without an op are not checked).
  """
  for g in fold_map.groups:
    for ax in g.consumers:
      if ax.path not in contracting:
        continue
      ndim = get(params, ax.path).ndim
      dims = tuple(sorted(int(d) % ndim for d in contracting[ax.path]))
      if dims != (ax.axis % ndim,):
        raise ValueError(
          f'fold group {g.name!r}: the op reading {ax.path!r} contracts '
          f'axes {dims}, the fold map says axis {ax.axis}; fix the map.'
        )


def expand(s: jax.Array, ax: Axis) -> jax.Array:
  """Group channels [n] -> the axis' entries [n * repeat] (see `Axis`)."""
  if ax.repeat == 1:
    return s
  s3 = s.reshape(-1, 1, ax.inner)
  return jnp.broadcast_to(s3, (s3.shape[0], ax.repeat, ax.inner)).reshape(-1)


def reduce(v: jax.Array, ax: Axis, how: str = 'max') -> jax.Array:
  """The axis' entries [n * repeat] -> group channels [n] by max or mean."""
  if ax.repeat == 1:
    return v
  v3 = v.reshape(-1, ax.repeat, ax.inner)
  return (jnp.max if how == 'max' else jnp.mean)(v3, axis=1).reshape(-1)


def along(s: jax.Array, ndim: int, axis: int) -> jax.Array:
  """`s` [n] shaped to broadcast along `axis` of a rank-`ndim` array."""
  shape = [1] * ndim
  shape[axis] = s.shape[0]
  return s.reshape(shape)


def apply(params: Mapping, group: FoldGroup, s: jax.Array) -> dict:
  """Folds `s` [channels]: sources / s, consumers * s (float unchanged)."""
  out = dict(params)
  for ax, sign in [(a, -1) for a in group.sources] + [
    (a, 1) for a in group.consumers
  ]:
    w = get(out, ax.path)
    f = along(expand(s, ax), w.ndim, ax.axis % w.ndim)
    f = f.astype(w.dtype)
    if sign < 0:
      new = (w + ax.offset) / f - ax.offset if ax.offset else w / f
    else:
      new = w * f
    out = replace(out, ax.path, new)
  return out


def scale_stats(stats: LayerStats, s: jax.Array) -> LayerStats:
  """Stats of `x / s` from those of `x` (s over the op's d_in channels)."""
  r = 1.0 / s.astype(jnp.float32)
  return LayerStats(
    stats.xtx * r[:, None] * r[None, :],
    stats.absmax * r,
    stats.abssum * r,
    stats.count,
  )


def children(tree: Mapping, prefix: str) -> list[str]:
  """The keys `<prefix><i>` of `tree`, in the order of i ('layers_0', ...)."""
  rx = re.compile(re.escape(prefix) + r'(\d+)$')
  found = [(int(m.group(1)), str(k)) for k in tree if (m := rx.match(str(k)))]
  return [k for _, k in sorted(found)]


def linear_sources(lin: str, params: Mapping) -> tuple[Axis, ...]:
  """A linear's output columns (kernel axis 1) and its bias, if any."""
  out = [Axis(path=f'{lin}/kernel', axis=1)]
  if 'bias' in get(params, lin):
    out.append(Axis(path=f'{lin}/bias'))
  return tuple(out)


def norm_sources(norm: str, params: Mapping) -> tuple[Axis, ...]:
  """A norm's 'scale' / 'weight' and 'bias' parameters (those it has)."""
  node = get(params, norm)
  names = ('scale', 'weight', 'bias')
  return tuple(Axis(path=f'{norm}/{p}') for p in names if p in node)


# A fold map builder: (params, root, model) -> FoldMap. `root` is the
# '/'-joined path of the matched model's parameters in `params` ('' at the
# top); `model` the matched module (None when found from the parameters).
Builder = Callable[[Mapping, str, Any], FoldMap]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
  """One registered fold map (see `register`)."""

  name: str
  build: Builder
  model: type | str | None = None
  predicate: Callable[[Mapping], bool] | None = None


_ENTRIES: dict[str, Entry] = {}


def register(
  name: str,
  build: Builder,
  *,
  model: type | str | None = None,
  predicate: Callable[[Mapping], bool] | None = None,
) -> Entry:
  """Registers the fold map of a model class (or of a parameter tree).

  Models register their map next to their code; `aqtr.ptq`'s AWQ and
  SmoothQuant find it (`find`) when no `fold_map=` is given.

  Args:
    name: the entry's name (errors, `names`); registering it again
      replaces the entry (a module reloaded).
    build: (params, root, model) -> the FoldMap.
    model: the model class, or its 'module.QualName' (no import needed):
      matches the model, a subclass (a model quantized by rules), or a
      linen submodule held in a field (found at its attribute path).
    predicate: params -> whether the tree is this model's (`detect`, and
      models no class matched).

  Returns:
    The entry.

  Example:
    >>> e = register('toy', lambda p, root, m: FoldMap(),
    ...              predicate=lambda p: 'toy' in p)
    >>> detect({'toy': {}}) == FoldMap()
    True
    >>> _ = unregister('toy')
  """
  if model is None and predicate is None:
    raise ValueError(f'fold.register({name!r}): give model= or predicate=.')
  entry = Entry(name=name, build=build, model=model, predicate=predicate)
  _ENTRIES[name] = entry
  return entry


def unregister(name: str) -> Entry | None:
  """Removes the entry `name` (returns it; None if there was none)."""
  return _ENTRIES.pop(name, None)


def names() -> tuple[str, ...]:
  """The registered fold maps' names, sorted."""
  return tuple(sorted(_ENTRIES))


def _is(cls: type, model: type | str) -> bool:
  if isinstance(model, type):
    return issubclass(cls, model)
  return any(f'{c.__module__}.{c.__qualname__}' == model for c in cls.__mro__)


def _submodules(model: Any, path: tuple[str, ...] = (), depth: int = 0):
  """(path, module) of `model` and the modules in its dataclass fields."""
  yield path, model
  if depth >= 4 or not dataclasses.is_dataclass(model):
    return
  for f in dataclasses.fields(model):
    if f.name in ('parent', 'name'):
      continue
    value = getattr(model, f.name, None)
    if dataclasses.is_dataclass(value) and hasattr(value, 'apply'):
      yield from _submodules(value, (*path, f.name), depth + 1)


def find(model: Any, params: Mapping) -> FoldMap:
  """The registered fold map of `model` (its class, else its parameters).

  Args:
    model: the model (a module, a quantized one, a Fiddle template) or
      None.
    params: its parameters: an nnx pure dict, or linen variables.

  Raises:
    ValueError: one line: nothing registered matches; pass a FoldMap.
  """
  if model is not None:
    cls = model.__fn_or_cls__ if hasattr(model, '__fn_or_cls__') else None
    is_template = isinstance(cls, type)
    for path, sub in _submodules(model) if not is_template else [((), None)]:
      kind = cls if is_template else type(sub)
      for e in _ENTRIES.values():
        if e.model is not None and _is(kind, e.model):
          root = '/'.join(('params', *path) if 'params' in params else path)
          return e.build(params, root, sub if sub is not None else model)
  return detect(params, _model=model)


def detect(params: Mapping, *, _model: Any = None) -> FoldMap:
  """The fold map whose registered predicate accepts `params`.

  Raises:
    ValueError: no registered predicate accepts the tree; pass your own
      `FoldMap`.
  """
  for e in _ENTRIES.values():
    if e.predicate is not None and e.predicate(params):
      return e.build(params, '', _model)
  what = f' of {type(_model).__name__}' if _model is not None else ''
  raise ValueError(
    f'fold: no fold map known for these parameters{what} (top-level keys: '
    f'{", ".join(sorted(map(str, params))[:8])}; registered: '
    f'{", ".join(names()) or "none"}); pass the method '
    'fold_map=aqtr.ptq.fold.FoldMap(...), or register one '
    '(aqtr.ptq.fold.register).'
  )
