"""KV caches by rule: a stock model's own cache variables, stored quantized.

A Flax model that decodes token by token keeps its keys and values in
cache variables: a linen model in its `'cache'` collection (Hugging Face
Flax LMs: `cached_key`, `cached_value`, `cache_index` per attention
module), an nnx model in `nnx.Cache` variables (`nnx.MultiHeadAttention`
with `decode=True`). `quantize_cache(model, rules)` stores the variables a
`CacheRule` matches as codes + scales, while the model's own code (and
its own decoding loop, e.g. a Hugging Face `generate`) runs unmodified:

  linen  a model of the same class lifted by `flax.linen.map_variables`
         on the 'cache' collection: each call reads the stored caches
         dequantized (trans_in) and stores what the model wrote quantized
         (trans_out). Its params tree is the original's.
  nnx    each matched `nnx.Cache` is replaced, in place, by a
         `QuantizedCache` variable holding the codes and scales: reading
         it (`cache[...]`, `.shape`) dequantizes, writing it quantizes.

Formats (`CacheRule.numerics`), quantized by the core quantizer
(`aqtr.core.quantizer.quantize`, the cache's last axis, the head size,
as the contraction: one scale per token and head):

  'none'  the float values as they are (the model's own decoding, bit
          for bit)
  'int8'  int8 codes in [-127, 127]
  'int4'  codes in [-7, 7], two packed per int8 byte along the head axis
          (the head size must be even)
  'fp8'   float8_e4m3fn codes (max 448)

Calibration: 'absmax' (`bound = max |x|` over the token's head) or
'static' (`bound = CacheRule.bound` for every token and head). Stored
bytes per token and head: h (int8, fp8) or h / 2 (int4) code bytes plus a
4-byte float32 scale, against 4 h for a float32 cache (0.27x at h = 64).

Each call stores the whole cache again from the values the model left:
a token's codes do not change (requantizing `codes * scale` gives the
same codes; its scale may move by a float32 rounding), and the cost is
one quantize and one dequantize pass over the cache per call.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=8,
  ...   qkv_features=8, decode=True, rngs=nnx.Rngs(0))
  >>> layer.init_cache((1, 4, 8))
  >>> _ = quantize_cache(layer, [CacheRule(numerics='int8')])
  >>> y = layer(jnp.ones((1, 1, 8)))
  >>> layer.cached_key.get_raw_value().codes.dtype
  dtype('int8')
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.typing import MISSING
from jax import lax

from aqtr import rules as rules_lib
from aqtr.calibrations import AbsMax, Constant
from aqtr.core import codecs
from aqtr.core.config import TensorConfig
from aqtr.core.quantizer import quantize
from aqtr.flax import kinds
from aqtr.flax.finite import check_finite
from aqtr.numerics import Fp8, IntSymmetric
from aqtr.tilings import PerChannel

__all__ = [
  'CALIBRATIONS',
  'BlockCache',
  'FORMATS',
  'CacheRule',
  'QuantizedCache',
  'StoredCache',
  'cache_bytes',
  'quantize_cache',
]

FORMATS = ('none', 'int8', 'int4', 'fp8')
CALIBRATIONS = ('absmax', 'static')


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheRule:
  """Store the cache variables it matches as `numerics` says.

  Attributes:
    numerics: one of `FORMATS`.
    path: regex that fully matches the path of the module holding the
      variable ('/' or '.' separate parts, as `aqtr.Rule.path`).
    names: the cache variables' names (Hugging Face and nnx attention:
      'cached_key', 'cached_value').
    calibration: 'absmax' or 'static'.
    bound: the static bound (calibration='static' only), finite and > 0.
    block: 0: one scale per token and head; B > 0: one scale per head
      and block of B slots (the cache's third-last axis, [..., S, n, h],
      must be a multiple of B): bytes per token and head h + 4 / B.

  Example:
    >>> rule = CacheRule(numerics='int4', path='.*attn')
    >>> rule.matches('h/0/attn', 'cached_key'), rule.matches('h/0', 'cache')
    (True, False)
  """

  numerics: str = 'int8'
  path: str = '.*'
  names: tuple[str, ...] = ('cached_key', 'cached_value')
  calibration: str = 'absmax'
  bound: float | None = None
  block: int = 0

  def __post_init__(self):
    if self.numerics not in FORMATS:
      raise ValueError(
        f'CacheRule.numerics must be one of {FORMATS}, got {self.numerics!r}.'
      )
    if self.calibration not in CALIBRATIONS:
      raise ValueError(
        f'CacheRule.calibration must be one of {CALIBRATIONS}, got '
        f'{self.calibration!r}.'
      )
    if (self.calibration == 'static') != (self.bound is not None):
      raise ValueError(
        "CacheRule.bound is set exactly when calibration='static' (got "
        f'calibration={self.calibration!r}, bound={self.bound!r}).'
      )
    if isinstance(self.names, str) or not all(
      isinstance(n, str) for n in self.names
    ):
      raise TypeError(
        f'CacheRule.names must be a tuple of strings, got {self.names!r}.'
      )
    try:
      re.compile(self.path)
    except re.error as e:
      raise ValueError(f'CacheRule.path {self.path!r} is no regex: {e}') from e
    b = self.block
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
      raise ValueError(
        f'CacheRule.block must be an int >= 0 (0: per-token scales), got {b!r}.'
      )
    self.tensor_config()  # Checks the static bound.

  def matches(self, module_path: str, name: str) -> bool:
    """Whether the variable `name` of the module at `module_path` is one."""
    return name in self.names and any(
      re.fullmatch(self.path, p) for p in rules_lib.spellings(module_path)
    )

  def tensor_config(self) -> TensorConfig | None:
    """The core quantizer's config of one cache (None: 'none')."""
    if self.numerics == 'none':
      return None
    if self.numerics == 'fp8':
      numerics = Fp8()
    else:
      numerics = IntSymmetric(
        bits=8 if self.numerics == 'int8' else 4,
        preserve_zero=True,
        preserve_max_val=True,
        clip_gradient=False,
      )
    cal = AbsMax() if self.bound is None else Constant(bound=self.bound)
    return TensorConfig(numerics=numerics, calibration=cal, tiling=PerChannel())


@dataclasses.dataclass(frozen=True)
class StoredCache:
  """One cache variable stored as codes + scales.

  Attributes:
    codes: int8 / float8_e4m3fn codes shaped like the cache ([..., h]);
      int4: two codes per int8 byte ([..., h / 2]).
    scale: float32 [...]: one scale per token and head (the cache's shape
      less its last axis).
    numerics: the format (static).
    dtype: the cache's float dtype, given back on reading (static).
  """

  codes: jax.Array
  scale: jax.Array
  numerics: str
  dtype: str

  def dequant(self) -> jax.Array:
    """`codes * scale` in the cache's layout and dtype."""
    c = _unpack(self.codes) if self.numerics == 'int4' else self.codes
    x = c.astype(jnp.float32) * self.scale[..., None]
    return x.astype(self.dtype)


jax.tree_util.register_dataclass(
  StoredCache,
  data_fields=['codes', 'scale'],
  meta_fields=['numerics', 'dtype'],
)


_INT4 = codecs.Int4()  # int4 codes, two per byte, low nibble first.


def _pack(codes: jax.Array) -> jax.Array:
  """int4 codes -> two per byte (the core's codec), held as int8."""
  return lax.bitcast_convert_type(_INT4.encode(codes)[_INT4.key], jnp.int8)


def _unpack(packed: jax.Array) -> jax.Array:
  """`_pack`'s bytes -> the int4 codes (as float32)."""
  raw = {_INT4.key: lax.bitcast_convert_type(packed, jnp.uint8)}
  return _INT4.decode(raw, dtype=jnp.float32)


def store(rule: CacheRule, x: jax.Array, where: str) -> Any:
  """The stored form of the cache `x` (`where`: its path, for errors)."""
  cfg = rule.tensor_config()
  if cfg is None:
    return x
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 2:
    raise ValueError(
      f'CacheRule matched {where}, a {x.dtype} array of shape {x.shape}: a '
      'key/value cache is a float array [..., head_size]; narrow the '
      "rule's path or names."
    )
  h = x.shape[-1]
  if rule.numerics == 'int4' and h % 2:
    raise ValueError(
      f"CacheRule(numerics='int4') packs two codes per byte along the head "
      f"axis, but {where} has head size {h} (odd): use numerics='int8' or "
      "'fp8'."
    )
  if rule.block:
    return _store_blocks(rule, cfg, x, where)
  qt = quantize(x.astype(jnp.float32), cfg, contracting_axes=(-1,))
  codes = qt.qvalue.reshape(x.shape)
  if rule.numerics == 'int4':
    codes = _pack(codes)
  scale = qt.scale.reshape(x.shape[:-1])
  return StoredCache(codes, scale, rule.numerics, jnp.dtype(x.dtype).name)


def load(value: Any) -> Any:
  """A cache variable as the model reads it (a StoredCache dequantized)."""
  return value.dequant() if isinstance(value, StoredCache) else value


def _rule_of(rules, module_path: str, name: str):
  for i, r in enumerate(rules):
    if r.matches(module_path, name):
      return i, r
  return None, None


def _check_used(rules, used: set[int], seen: list[str]) -> None:
  for i, r in enumerate(rules):
    if i not in used:
      raise ValueError(
        f'quantize_cache: rules[{i}] ({r}) matched no cache variable; the '
        f'model has {seen or "none"}. Fix its path or names.'
      )


def _as_rules(rules: Any) -> tuple[CacheRule, ...]:
  rules = (rules,) if isinstance(rules, CacheRule) else tuple(rules)
  if not rules or not all(isinstance(r, CacheRule) for r in rules):
    raise TypeError(
      'quantize_cache: rules must be a CacheRule or a non-empty sequence '
      f'of them, got {rules!r}.'
    )
  return rules


def _store_tree(rules, tree: Any) -> Any:
  """trans_out: the 'cache' collection with matched variables stored."""
  return {c: _store_collection(rules, t) for c, t in tree.items()}


def _store_collection(rules, tree: Any) -> Any:
  flat = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: isinstance(x, StoredCache)
  )[0]
  if not flat:
    return tree  # A call that keeps no cache.
  used, seen, out = set(), [], {}
  for keys, leaf in flat:
    parts = [str(getattr(k, 'key', getattr(k, 'idx', k))) for k in keys]
    module_path, name = '/'.join(parts[:-1]), parts[-1]
    seen.append('/'.join(parts))
    i, rule = _rule_of(rules, module_path, name)
    if rule is not None and not isinstance(leaf, StoredCache):
      used.add(i)
      leaf = store(rule, leaf, '/'.join(parts))
    out[tuple(parts)] = leaf
  _check_used(rules, used, seen)
  return _nest(out)


def _nest(flat: dict) -> dict:
  root: dict = {}
  for parts, leaf in flat.items():
    node = root
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = leaf
  return root


def _load_tree(tree: Any) -> Any:
  """trans_in: the 'cache' collection as the model reads it."""
  return jax.tree.map(load, tree, is_leaf=lambda x: isinstance(x, StoredCache))


def _linen(model: nn.Module, rules) -> nn.Module:
  cls = nn.map_variables(
    type(model),
    'cache',
    trans_in_fn=_load_tree,
    trans_out_fn=lambda tree: _store_tree(rules, tree),
    mutable=True,  # Not init=True: that runs the model twice on init.
  )
  fields = {
    f.name: getattr(model, f.name)
    for f in dataclasses.fields(model)
    if f.init and f.name not in ('parent', 'name')
  }
  return cls(**fields)


class QuantizedCache(nnx.Cache):
  """An `nnx.Cache` whose value is stored quantized (a `StoredCache`).

  Reading (`cache[...]`, `cache.get_value()`, `.shape`) dequantizes;
  writing (`cache[...] = x`, `set_value`) quantizes with the metadata's
  `rule`. Made by `quantize_cache`.
  """

  def get_value(self, *, index: Any = MISSING) -> Any:
    x = load(self.get_raw_value())
    return x if index is MISSING or index is Ellipsis else x[index]

  def set_value(self, value: Any, *, index: Any = MISSING) -> None:
    if index is not MISSING and index is not Ellipsis:
      value = self.get_value().at[index].set(value)
    where = self.get_metadata('where')
    self.set_raw_value(store(self.get_metadata('rule'), value, where))


def _nnx(model: nnx.Module, rules) -> nnx.Module:
  used, seen, found = set(), [], []
  for path, node in nnx.iter_graph(model):
    if not kinds.is_nnx(node):
      continue
    module_path = '/'.join(str(p) for p in path)
    for name, var in list(vars(node).items()):
      if not isinstance(var, nnx.Cache) or isinstance(var, QuantizedCache):
        continue
      where = f'{module_path}/{name}' if module_path else name
      seen.append(where)
      i, rule = _rule_of(rules, module_path, name)
      if rule is not None:
        used.add(i)
        found.append((node, name, var, rule, where))
  _check_used(rules, used, seen)
  for node, name, var, rule, where in found:
    stored = store(rule, var.get_value(), where)
    setattr(node, name, QuantizedCache(stored, rule=rule, where=where))
  return model


def quantize_cache(model: Any, rules: CacheRule | Sequence[CacheRule]):
  """Stores the cache variables the rules match quantized.

  The first matching rule wins; every rule must match some cache variable.

  Args:
    model: a linen Module (its 'cache' collection is mapped), an nnx
      Module whose caches exist (after `init_cache`; its `nnx.Cache`
      variables are replaced in place), or a Hugging Face Flax model (its
      linen `module`, which `generate` calls, is replaced in place).
    rules: a CacheRule or a sequence of them.

  Returns:
    linen: a model of the same class and fields whose calls store the
    cache quantized (use it for `init` and `apply` with the original's
    params). nnx and Hugging Face: `model` itself.

  Raises:
    ValueError: a parameter the model holds (nnx, Hugging Face) has NaN
      or inf values (one line naming it: decoding would give token 0 at
      every step). A linen module's variables come at `apply` (and a
      Hugging Face model made with `_do_init=False` holds none): unchecked.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> attn = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
    >>> q = quantize_cache(attn, CacheRule(numerics='fp8'))
    >>> v = q.init(jax.random.key(0), jnp.ones((1, 4, 8)))  # 4 slots
    >>> y, new = q.apply(v, jnp.ones((1, 1, 8)), mutable=['cache'])
    >>> new['cache']['cached_key'].codes.dtype, int(new['cache']['cache_index'])
    (dtype(float8_e4m3fn), 1)
  """
  rules = _as_rules(rules)
  who = 'aqtr.flax.quantize_cache'
  if kinds.is_linen(model):
    return _linen(model, rules)
  if kinds.is_nnx(model):
    for path, node in nnx.iter_graph(model):
      if isinstance(node, nnx.Param):
        check_finite(node.get_value(), who, '/'.join(map(str, path)))
    return _nnx(model, rules)
  if kinds.is_linen(getattr(model, 'module', None)) and hasattr(
    model, '_module'
  ):  # A Hugging Face Flax model: `generate` calls its linen `module`.
    if getattr(model, '_is_initialized', True):  # (Not `_do_init=False`.)
      check_finite(model.params, who, 'params')
    model._module = _linen(model.module, rules)
    return model
  raise TypeError(
    'quantize_cache: model must be a flax.linen or flax.nnx Module (or a '
    f'Hugging Face Flax model), got {type(model).__name__}.'
  )


def cache_bytes(tree: Any) -> int:
  """Bytes held by the arrays of a cache tree (a linen 'cache' collection,
  an `nnx.state(model, nnx.Cache)`, or any pytree).

  Example:
    >>> cache_bytes({'k': jnp.zeros((2, 3), jnp.int8)})
    6
  """
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class BlockCache(StoredCache):
  """A StoredCache with one scale per head and block of `block` slots.

  Attributes:
    block: slots per scale (static); `scale` is [..., S / block, n].
  """

  block: int

  def dequant(self) -> jax.Array:
    c = _unpack(self.codes) if self.numerics == 'int4' else self.codes
    scale = jnp.repeat(self.scale, self.block, axis=-2)  # [..., S, n]
    return (c.astype(jnp.float32) * scale[..., None]).astype(self.dtype)


jax.tree_util.register_dataclass(
  BlockCache,
  data_fields=['codes', 'scale'],
  meta_fields=['numerics', 'dtype', 'block'],
)


def _store_blocks(rule, cfg, x: jax.Array, where: str) -> BlockCache:
  """x [..., S, n, h] with one scale per head and block of slots."""
  b = rule.block
  if x.ndim < 3 or x.shape[-3] % b:
    raise ValueError(
      f'CacheRule(block={b}) scales blocks of {b} slots along the third-last '
      f'axis of [..., slots, heads, head_size], but {where} has shape '
      f'{x.shape}: use a block that divides {x.shape[-3:-2] or "its slots"}'
      ' or block=0.'
    )
  *lead, s, n, h = x.shape
  xb = x.astype(jnp.float32).reshape(*lead, s // b, b, n, h)
  rows = jnp.swapaxes(xb, -3, -2).reshape(*lead, s // b, n, b * h)
  qt = quantize(rows, cfg, contracting_axes=(-1,))
  codes = qt.qvalue.reshape(*lead, s // b, n, b, h)
  codes = jnp.swapaxes(codes, -3, -2).reshape(x.shape)
  if rule.numerics == 'int4':
    codes = _pack(codes)
  scale = qt.scale.reshape(*lead, s // b, n)
  return BlockCache(codes, scale, rule.numerics, jnp.dtype(x.dtype).name, b)
