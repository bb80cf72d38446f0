"""A fixed-size key/value cache for decoding, stored float or quantized.

Quantizing the cache cuts the memory that token-by-token decoding reads
at every step (KVQuant, Hooper et al. 2024, arXiv 2401.18079; KIVI, Liu
et al. 2024, arXiv 2402.02750; MaxText's `KVQuant` config).

Each layer keeps its keys and values for `length` token slots as codes +
scales (`Stored`). With `KVCacheConfig(numerics=...)`:

  'none'  float keys/values, no scales
  'int8'  int8 codes in [-127, 127]      (`IntSymmetric(bits=8)`)
  'int4'  int4 codes in [-7, 7], two packed per int8 byte along head_dim
  'fp8'   float8_e4m3fn codes            (`Fp8`, max 448)

The numerics come from the `numerics` registry. A scale covers one head of
one token (`scales='token'`, MaxText's KVQuant default: shape [b, n, S])
or one head over a block of `block_size` slots (`scales='block'`: [b, n,
S/B]). The layout is heads-major ([b, n, S, h]): the QK^T and PV dots of
one decode step then read each head's slots in place (no transpose of
the whole cache per step).

Calibration: `absmax` (`bound = max|x|` over the scale's group; a group
holding NaN or inf gets the bound inf and reads back NaN, as a float
cache would give NaN attention) or `static` (`bound =
KVCacheConfig.bound` for every group). Then
`s = bound / numerics.max_value` (bound 0 -> s = 1) and `codes =
numerics.quantize(x / s)`; reading gives `codes * s`.

Writing into a block that already holds tokens (absmax, `scales='block'`)
recomputes the block's bound over old and new values and requantizes the
block: old codes whose bound grew are rounded again.

Attention reads the cache by dequantizing (`read='dequantize'`), or for
int8 with integer dots (`read='int8_dots'`). The default `read='auto'`
takes integer dots for an int8 cache in a decode step (one query per
sequence) whose attention einsums are float, and dequantizes otherwise
(prefill, other numerics, quantized attention einsums): on XLA:CPU the
dequantizing read writes the float32 cache before its dots, so it moves
more bytes than a float cache. Integer dots: the query is quantized per
token and head, `logits = (q_c . k_c) * s_q * s_k` (int8 x int8 -> int32),
and for PV the value scales are folded into the probabilities, which are
quantized per row: `out = (p'_c . v_c) * s_p`, `p' = p * s_v`.

Example:
  >>> import jax.numpy as jnp
  >>> cfg = KVCacheConfig(numerics='int4')
  >>> layer = init_layer(cfg, batch=1, length=8, num_heads=2, head_dim=4)
  >>> layer.k.codes.shape, layer.k.codes.dtype, layer.k.scale.shape
  ((1, 2, 8, 2), dtype('int8'), (1, 2, 8))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from aqtr import numerics as numerics_lib
from aqtr.calibrations.absmax import AbsMax
from aqtr.core import codecs
from aqtr.core.boundary import fusion_boundary
from aqtr.core.quantizer import quantize_bound, quantize_scaled
from aqtr.core.scale import scale_from_bound
from aqtr.pax import ops

__all__ = [
  'CALIBRATIONS',
  'NUMERICS',
  'READS',
  'SCALES',
  'Cache',
  'KVCacheConfig',
  'LayerCache',
  'Stored',
  'attend',
  'init_layer',
  'nbytes',
  'read',
  'reads_int8',
  'write',
]

NUMERICS = ('none', 'int8', 'int4', 'fp8')
SCALES = ('token', 'block')
CALIBRATIONS = ('absmax', 'static')
READS = ('auto', 'dequantize', 'int8_dots')


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
  """How the decoding cache stores keys and values, and how it is read.

  Attributes:
    numerics: 'none' (float), 'int8', 'int4' (packed two per byte) or
      'fp8' (e4m3fn); each maps to a `numerics` registry entry.
    scales: 'token' (one scale per token and head) or 'block' (one per
      head over `block_size` slots).
    block_size: slots per scale when `scales='block'`.
    calibration: 'absmax' (the group's max |x|) or 'static' (`bound`).
    bound: the static bound (> 0), used when `calibration='static'`.
    read: 'dequantize', 'int8_dots' (int8 only): integer QK^T and PV,
      or 'auto': int8 dots for an int8 cache in decode steps (one query)
      with float attention einsums, else dequantize (`reads_int8`).

  Example:
    >>> KVCacheConfig(numerics='int8', read='int8_dots').quantized
    True
  """

  numerics: str = 'none'
  scales: str = 'token'
  block_size: int = 16
  calibration: str = 'absmax'
  bound: float = 0.0
  read: str = 'auto'

  def __post_init__(self):
    for name, allowed in (
      ('numerics', NUMERICS),
      ('scales', SCALES),
      ('calibration', CALIBRATIONS),
      ('read', READS),
    ):
      if getattr(self, name) not in allowed:
        raise ValueError(
          f'KVCacheConfig.{name} must be one of {allowed}, got '
          f'{getattr(self, name)!r}.'
        )
    b = self.block_size
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
      raise ValueError(
        f'KVCacheConfig.block_size must be an int >= 1, got {b!r}.'
      )
    if self.calibration == 'static' and not (
      isinstance(self.bound, int | float)
      and math.isfinite(self.bound)
      and self.bound > 0
    ):
      raise ValueError(
        'KVCacheConfig.bound must be a finite number > 0 with '
        f"calibration='static', got {self.bound!r}."
      )
    if self.read == 'int8_dots' and self.numerics != 'int8':
      raise ValueError(
        "KVCacheConfig.read='int8_dots' needs numerics='int8', got "
        f"{self.numerics!r}; use read='dequantize'."
      )

  @property
  def quantized(self) -> bool:
    """Whether keys and values are stored as codes + scales."""
    return self.numerics != 'none'

  def numerics_of(self) -> numerics_lib.Numerics:
    """The registry numerics of the codes (`NoNumerics` for 'none')."""
    if self.numerics == 'fp8':
      return numerics_lib.get('fp8')(dtype_name='float8_e4m3fn')
    if self.numerics in ('int8', 'int4'):
      bits = 8 if self.numerics == 'int8' else 4
      return numerics_lib.get('int_symmetric')(bits=bits)
    return numerics_lib.get('none')()


class Stored(NamedTuple):
  """Keys or values of one layer: codes [b, n, S, h'] and scales.

  h' = h/2 for packed int4; `scale` is [b, n, S] ('token'), [b, n, S/B]
  ('block'), or None for a float cache.
  """

  codes: jax.Array
  scale: jax.Array | None


class LayerCache(NamedTuple):
  """The keys and values of one attention layer."""

  k: Stored
  v: Stored


class Cache(NamedTuple):
  """The cache of a whole LM: every layer's, and where to write next.

  Prompts are left-padded: sequence i's tokens start at slot `start[i]`,
  and every sequence writes its next token at the same slot `index`.

  Attributes:
    layers: one LayerCache per attention layer.
    index: int32 scalar, the next slot to write (= slots filled).
    start: int32 [b], the first real slot of each sequence.
  """

  layers: tuple[LayerCache, ...]
  index: jax.Array
  start: jax.Array


def _check_shape(cfg: KVCacheConfig, length: int, head_dim: int) -> None:
  if cfg.numerics == 'int4' and head_dim % 2:
    raise ValueError(
      f"KVCacheConfig.numerics='int4' packs two codes per byte along "
      f'head_dim, which must be even, got {head_dim}.'
    )
  if cfg.quantized and cfg.scales == 'block' and length % cfg.block_size:
    raise ValueError(
      f'cache length {length} must be a multiple of KVCacheConfig.'
      f"block_size={cfg.block_size} with scales='block'."
    )


def init_layer(
  cfg: KVCacheConfig,
  *,
  batch: int,
  length: int,
  num_heads: int,
  head_dim: int,
  dtype: Any = jnp.float32,
) -> LayerCache:
  """An empty (all-zero) cache of one layer for `length` slots.

  Args:
    cfg: the cache config.
    batch, length, num_heads, head_dim: the cache's sizes.
    dtype: the float dtype of a 'none' cache.

  Returns:
    A LayerCache of zeros.
  """
  _check_shape(cfg, length, head_dim)
  if not cfg.quantized:
    z = jnp.zeros((batch, num_heads, length, head_dim), dtype)
    return LayerCache(Stored(z, None), Stored(z, None))
  h = head_dim // 2 if cfg.numerics == 'int4' else head_dim
  dt = jnp.int8 if cfg.numerics != 'fp8' else cfg.numerics_of().dtype
  groups = length if cfg.scales == 'token' else length // cfg.block_size
  one = Stored(
    jnp.zeros((batch, num_heads, length, h), dt),
    jnp.zeros((batch, num_heads, groups), jnp.float32),
  )
  return LayerCache(one, one)


_INT4 = codecs.Int4()  # int4 codes two per byte (stored bitcast to int8).


def _codes(cfg: KVCacheConfig, x: jax.Array, scale: jax.Array) -> jax.Array:
  """Codes of x [b, n, t, h] with per-(b, n, t) scales (the core's
  quantizer; int4 packed by the core's codec)."""
  q = quantize_scaled(x, scale[..., None], cfg.numerics_of())
  if cfg.numerics != 'int4':
    return q
  return lax.bitcast_convert_type(_INT4.encode(q)[_INT4.key], jnp.int8)


def _values(cfg: KVCacheConfig, s: Stored) -> jax.Array:
  """Codes as float32 [b, n, S, h], not yet scaled."""
  if cfg.numerics != 'int4':
    return s.codes.astype(jnp.float32)
  packed = lax.bitcast_convert_type(s.codes, jnp.uint8)
  return _INT4.decode({_INT4.key: packed}, dtype=jnp.float32)


# The core's absmax: a group holding NaN or inf gets the bound inf (then
# the scale NaN, so the group reads back NaN, as a float cache would);
# `jnp.max` alone may skip a NaN on XLA:CPU (its library reduction).
_ABSMAX = AbsMax()


def _scale_of(cfg: KVCacheConfig, bound: jax.Array) -> jax.Array:
  """The core's scale: bound / max_value, kept normal, 1 for a zero
  group, NaN for a non-finite bound (`aqtr.core.scale`)."""
  return scale_from_bound(bound.astype(jnp.float32), cfg.numerics_of())


def _per_token(cfg: KVCacheConfig, scale: jax.Array) -> jax.Array:
  """Scales [b, n, G] -> per slot [b, n, S]."""
  if cfg.scales == 'token':
    return scale
  return jnp.repeat(scale, cfg.block_size, axis=2)


def read(cfg: KVCacheConfig, s: Stored, dtype: Any = jnp.float32) -> jax.Array:
  """Dequantized keys or values [b, n, S, h] (the codes when float)."""
  if not cfg.quantized:
    return s.codes
  scale = _per_token(cfg, s.scale)
  return (_values(cfg, s) * scale[..., None]).astype(dtype)


def _write_tokens(cfg: KVCacheConfig, s: Stored, x, index) -> Stored:
  if cfg.calibration == 'static':
    bound = jnp.full(x.shape[:-1], cfg.bound, jnp.float32)
  else:
    bound = _ABSMAX.calibrate(x.astype(jnp.float32), (3,))[..., 0]
  scale = _scale_of(cfg, bound)
  codes = lax.dynamic_update_slice_in_dim(
    s.codes, _codes(cfg, x, scale), index, axis=2
  )
  return Stored(
    codes, lax.dynamic_update_slice_in_dim(s.scale, scale, index, 2)
  )


def _write_blocks(cfg: KVCacheConfig, s: Stored, x, index) -> Stored:
  """Requantizes the blocks that `x` (t slots from `index`) touches."""
  b, n, t, _ = x.shape
  size = cfg.block_size
  blocks = s.scale.shape[2]
  nb = min((t - 1) // size + 2, blocks)
  first = jnp.clip(index // size, 0, blocks - nb)
  start = first * size
  region = Stored(
    lax.dynamic_slice_in_dim(s.codes, start, nb * size, axis=2),
    lax.dynamic_slice_in_dim(s.scale, first, nb, axis=2),
  )
  old = read(cfg, region)
  new = lax.dynamic_update_slice_in_dim(
    old, x.astype(jnp.float32), index - start, axis=2
  )
  grouped = new.reshape(b, n, nb, size, -1)
  if cfg.calibration == 'static':
    bound = jnp.full((b, n, nb), cfg.bound, jnp.float32)
  else:
    bound = _ABSMAX.calibrate(grouped, (3, 4))[..., 0, 0]
  scale = _scale_of(cfg, bound)
  codes = _codes(cfg, new, jnp.repeat(scale, size, axis=2))
  return Stored(
    lax.dynamic_update_slice_in_dim(s.codes, codes, start, axis=2),
    lax.dynamic_update_slice_in_dim(s.scale, scale, first, axis=2),
  )


def write(
  cfg: KVCacheConfig, layer: LayerCache, k: jax.Array, v: jax.Array, index
) -> LayerCache:
  """Stores `k`, `v` [b, t, n, h] into slots index .. index + t - 1.

  Args:
    cfg: the cache config.
    layer: the layer's cache.
    k, v: new keys and values.
    index: the first slot (an int32 scalar, the same for the batch).

  Returns:
    The updated LayerCache.
  """

  def one(s: Stored, x: jax.Array) -> Stored:
    x = jnp.swapaxes(x, 1, 2)  # [b, n, t, h]
    if not cfg.quantized:
      x = x.astype(s.codes.dtype)
      return Stored(lax.dynamic_update_slice_in_dim(s.codes, x, index, 2), None)
    if cfg.scales == 'token':
      return _write_tokens(cfg, s, x, index)
    return _write_blocks(cfg, s, x, index)

  return _written_once(LayerCache(one(layer.k, k), one(layer.v, v)))


@jax.custom_jvp
def _written_once(tree: Any) -> Any:
  """`tree` behind a fusion boundary; the identity to differentiation.

  XLA fuses a cache's update into each of its readers (the next step's
  state and the attention's read: transposed for a float cache, merged
  batch and head axes for int8 dots) and copies the whole cache for each
  (three to four copies of every array per decode step on CPU: a float
  cache's arrays, and an int8 cache's codes); behind a fusion boundary it
  is written once, in place. The boundary is a one-trip while loop on CPU
  (faster in a decode step than a conditional), which reverse mode cannot
  differentiate: the rule below passes tangents straight through.
  """
  return fusion_boundary(tree)


@_written_once.defjvp
def _written_once_jvp(primals, tangents):
  return _written_once(primals[0]), tangents[0]


_INT8 = numerics_lib.get('int_symmetric')(bits=8)


def _int8_rows(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """int8 codes and absmax scales of x over `axis` (kept as size 1)."""
  return quantize_bound(x, _ABSMAX.calibrate(x, (axis,)), _INT8)


def _int_dot(a: jax.Array, b: jax.Array, b_contract: int) -> jax.Array:
  """int8 x int8 -> int32 [b, n, t, F] of a [b, n, t, K] and the cache's
  b [b, n, S, h] (contracting its axis `b_contract`: 3 for K = h, 2 for
  K = S).

  The lhs contracts its minor axis (XLA:CPU's fast integer dot layout). A
  one-query `a` (t = 1, decoding) runs as two queries: XLA:CPU emits an
  integer dot with a one-row operand as a plain loop over int32-widened
  operands, several times slower than the library kernel it runs for two
  rows (docs/performance.md); integer sums are exact, so the zero row
  changes nothing but the speed.
  """
  one = a.shape[2] == 1
  if one:
    a = jnp.concatenate([a, jnp.zeros_like(a)], axis=2)
  dn = (((3,), (b_contract,)), ((0, 1), (0, 1)))
  out = lax.dot_general(a, b, dn, preferred_element_type=jnp.int32)
  return out[:, :, :1] if one else out


def _float_op(op: Any) -> bool:
  return op is None or getattr(op, 'config', None) is None


def reads_int8(
  cfg: KVCacheConfig,
  queries: int,
  qk_op: ops.EinsumOp | None = None,
  pv_op: ops.EinsumOp | None = None,
) -> bool:
  """Whether `attend` reads the cache with int8 x int8 dots.

  `read='int8_dots'`: always. `read='auto'`: for an int8 cache when each
  sequence has one query (a decode step) and the attention einsums are
  float (a quantized einsum op keeps its own numerics on the dequantized
  cache).

  Example:
    >>> reads_int8(KVCacheConfig(numerics='int8'), queries=1)
    True
    >>> reads_int8(KVCacheConfig(numerics='int8'), queries=8)
    False
  """
  if cfg.read != 'auto':
    return cfg.read == 'int8_dots'
  return (
    cfg.numerics == 'int8'
    and queries == 1
    and _float_op(qk_op)
    and _float_op(pv_op)
  )


def attend(
  cfg: KVCacheConfig,
  layer: LayerCache,
  q: jax.Array,
  mask: jax.Array,
  qk_op: ops.EinsumOp | None = None,
  pv_op: ops.EinsumOp | None = None,
) -> jax.Array:
  """Attention of queries q [b, t, n, h] (scaled) over the cache.

  Args:
    cfg: the cache config.
    layer: the layer's cache (S slots).
    q: queries, already multiplied by head_dim^-1/2.
    mask: [b, 1, t, S] bool, True where a query may read a slot.
    qk_op, pv_op: the attention's einsum ops (used when dequantizing; a
      quantized one keeps `read='auto'` dequantizing).

  Returns:
    [b, t, n, h] attention output, q's dtype.
  """
  neg = jnp.finfo(jnp.float32).min
  if reads_int8(cfg, q.shape[1], qk_op, pv_op):
    qc, qs = _int8_rows(q.astype(jnp.float32), axis=-1)  # [b, t, n, 1]
    kc = layer.k.codes
    dots = _int_dot(jnp.transpose(qc, (0, 2, 1, 3)), kc, 3)  # [b, n, t, S]
    ks = _per_token(cfg, layer.k.scale)  # [b, n, S]
    logits = dots.astype(jnp.float32) * (
      jnp.transpose(qs, (0, 2, 1, 3)) * ks[:, :, None, :]
    )
    probs = jax.nn.softmax(jnp.where(mask, logits, neg), axis=-1)
    vs = _per_token(cfg, layer.v.scale)  # [b, n, S]
    pc, ps = _int8_rows(probs * vs[:, :, None, :], -1)
    out = _int_dot(pc, layer.v.codes, 2).transpose(0, 2, 1, 3)  # [b, t, n, h]
    return (out.astype(jnp.float32) * jnp.transpose(ps, (0, 2, 1, 3))).astype(
      q.dtype
    )
  k = read(cfg, layer.k, q.dtype)
  v = read(cfg, layer.v, q.dtype)
  logits = ops.einsum(qk_op, 'btnh,bnsh->bnts', q, k).astype(jnp.float32)
  probs = jax.nn.softmax(jnp.where(mask, logits, neg), axis=-1)
  return ops.einsum(pv_op, 'bnts,bnsh->btnh', probs.astype(v.dtype), v)


def nbytes(tree: Any) -> int:
  """Bytes held by the arrays of a cache (any pytree).

  Example:
    >>> cfg = KVCacheConfig(numerics='int8')
    >>> nbytes(init_layer(cfg, batch=1, length=4, num_heads=1, head_dim=8))
    96
  """
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
