"""One canonical quantized dot: operands, tiles, quantization, contraction.

The machinery `dot_general.py`'s custom VJP applies to each of its three
passes (fwd, dlhs, drhs). An operand is a canonical 3-D array, [B, F, K]
('fk') or [B, K, F] ('kf'); tiles split K into a batch axis; a quantized
operand is kept in the tiled view [B, T, F, t] / [B, T, t, F] with a scale
broadcastable to it. `contract` runs the low-precision dot (int8 x int8 ->
int32, fp8 x fp8 -> f32) and applies the scales on the output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core.config import DotGeneralRaw, TensorConfig
from aqtr.core.qtensor import QTensor, from_view, to_view
from aqtr.core.quantizer import quantize_view


@dataclasses.dataclass
class _Operand:
  """One operand of a canonical dot.

  x: canonical 3-D array, [B, F, K] ('fk') or [B, K, F] ('kf').
  cfg: how to quantize it, or None when `x` enters the dot as it is
    (already quantized with its scale folded elsewhere, or float).
  noise: rounding noise shaped like x, or None.
  """

  x: jax.Array
  form: str
  cfg: TensorConfig | None = None
  noise: jax.Array | None = None


@dataclasses.dataclass
class _Q:
  """A prepared operand: tiled view values, scale (or None), grad mask."""

  q: jax.Array
  s: jax.Array | None
  mask: jax.Array | None
  form: str


jax.tree_util.register_dataclass(
  _Q, data_fields=['q', 's', 'mask'], meta_fields=['form']
)


def _tile(ops: list[_Operand], k: int) -> int | None:
  tiles = {
    op.cfg.tiling.tile(k)
    for op in ops
    if op.cfg is not None and op.cfg.quantized
  } - {None}
  if len(tiles) > 1:
    raise ValueError(
      f'the lhs and rhs tilings ask for different tile sizes {sorted(tiles)} '
      f'along the same contraction of size {k}; use one tile size.'
    )
  return tiles.pop() if tiles else None


def _prepare(op: _Operand, tile: int | None) -> _Q:
  x4 = to_view(op.x, op.form, tile)
  if op.cfg is None or not op.cfg.quantized:
    return _Q(x4, None, None, op.form)
  noise = None if op.noise is None else to_view(op.noise, op.form, tile)
  q, s, z, mask = quantize_view(x4, op.cfg, op.form, noise)
  if z is not None:
    raise NotImplementedError('zero points in the engine: not yet.')
  return _Q(q, s, mask, op.form)


def _is_int(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.integer)


def _is_fp8(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _contract(a: _Q, b: _Q, raw: DotGeneralRaw, precision) -> jax.Array:
  """sum_tiles (a . b) * s_a * s_b^T -> [B, Fa, Fb] float32."""
  bsz, n, fa, t = a.q.shape
  qa = a.q.reshape(bsz * n, fa, t)
  qb = b.q.reshape((bsz * n,) + b.q.shape[2:])
  fb = qb.shape[1] if b.form == 'fk' else qb.shape[2]
  rc = 2 if b.form == 'fk' else 1
  dn = (((2,), (rc,)), ((0,), (0,)))
  da, db = qa.dtype, qb.dtype
  if _is_int(da) and _is_int(db) and raw.accumulator != 'float32':
    qa, qb = (
      x.astype(jnp.int8) if x.dtype == jnp.int4 else x for x in (qa, qb)
    )
    qa, qb = lax.optimization_barrier((qa, qb))
    out = lax.dot_general(qa, qb, dn, preferred_element_type=jnp.int32)
    out = out.astype(jnp.float32)
  elif _is_fp8(da) and _is_fp8(db) and raw.accumulator != 'int32':
    qa, qb = lax.optimization_barrier((qa, qb))
    out = lax.dot_general(qa, qb, dn, preferred_element_type=jnp.float32)
  else:
    floats = [d for d in (da, db) if not (_is_int(d) or _is_fp8(d))]
    ct = jnp.result_type(*floats) if floats else jnp.float32
    out = lax.dot_general(
      qa.astype(ct),
      qb.astype(ct),
      dn,
      precision=precision,
      preferred_element_type=jnp.float32,
    )
  out = out.reshape(bsz, n, fa, fb)
  if a.s is not None:
    out = out * a.s
  if b.s is not None:
    out = out * (b.s.transpose(0, 1, 3, 2) if b.form == 'fk' else b.s)
  return out[:, 0] if n == 1 else out.sum(axis=1)


def _pass(a: _Operand, b: _Operand, raw: DotGeneralRaw, precision):
  """One canonical dot: `a` is [B, Fa, K] ('fk'), `b` either form."""
  tile = _tile([a, b], a.x.shape[2])
  qa, qb = _prepare(a, tile), _prepare(b, tile)
  return _contract(qa, qb, raw, precision), qa, qb


def _noise(cfg: TensorConfig, key, shape):
  if key is None or not (cfg.quantized and cfg.rounding.stochastic):
    return None
  return cfg.rounding.noise(key, shape)


def _keys(key, n: int):
  return (None,) * n if key is None else tuple(jax.random.split(key, n))


def _fold(g3: jax.Array, q: _Q, axis: int):
  """Folds the forward scale of `q` into g along g's `axis` (1 or 2).

  Returns g * s as [B * T, ., .] matching q's tiles, and T.
  """
  s = q.s[..., 0] if q.form == 'fk' else q.s[:, :, 0, :]  # [B|1, T|1, F]
  s = s[:, :, None, :] if axis == 2 else s[:, :, :, None]
  g4 = g3[:, None].astype(jnp.float32) * s
  bsz, n = g3.shape[0], q.q.shape[1]
  g4 = jnp.broadcast_to(g4, (bsz, n) + g4.shape[2:])
  return g4.reshape((bsz * n,) + g4.shape[2:]), n


def _tiled(n: int, x: jax.Array | None):
  if x is None:
    return None
  x = jnp.broadcast_to(x[:, None], (x.shape[0], n) + x.shape[1:])
  return x.reshape((-1,) + x.shape[2:])


def _as_given(q: _Q) -> _Operand:
  """A forward QTensor as an operand of a backward dot (scale folded)."""
  bsz, n = q.q.shape[:2]
  return _Operand(q.q.reshape((bsz * n,) + q.q.shape[2:]), q.form)


def _flip(form: str) -> str:
  return 'kf' if form == 'fk' else 'fk'


def _untile(x3: jax.Array, n: int, form: str) -> jax.Array:
  """Merges tiles back: [B*T, F, t] / [B*T, t, F] -> [B, F, K] / [B, K, F]."""
  x4 = x3.reshape((-1, n) + x3.shape[1:])
  return from_view(x4, form)


def _mask(q: _Q | None, layout, form):
  if q is None or q.mask is None:
    return None
  return layout.from_canonical(from_view(q.mask, form), form)


def _dequant(q: _Q, layout, dtype):
  v = q.q.astype(jnp.float32) * q.s
  return layout.from_canonical(from_view(v, q.form), q.form).astype(dtype)


def _shape_dtype(x):
  if isinstance(x, QTensor):
    return jax.ShapeDtypeStruct(x.layout.shape, x.scale.dtype)
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _given(x: QTensor, raw_side: TensorConfig, layout, form, tile, name):
  """A stored QTensor as a forward operand, checked against the config."""
  n = raw_side.numerics
  b, f, k = layout.b, layout.f, layout.k
  t = tile or k
  view = (b, k // t, f, t) if form == 'fk' else (b, k // t, t, f)
  problems = []
  if not raw_side.quantized:
    problems.append(f'config.fwd.{name} is not quantized')
  elif jnp.dtype(x.qvalue.dtype) != jnp.dtype(n.dtype):
    problems.append(
      f'qvalue dtype {x.qvalue.dtype} != config numerics dtype {n.dtype}'
    )
  if x.layout != layout or x.form != form:
    problems.append(f"layout {x.layout}/{x.form} != the dot's {layout}/{form}")
  if tuple(x.qvalue.shape) != view:
    problems.append(f'qvalue shape {x.qvalue.shape} != expected {view}')
  if x.scale is None or jnp.ndim(x.scale) != 4:
    problems.append('scale missing or not in the tiled view')
  if problems:
    raise ValueError(
      f'the QTensor given as {name} does not match this dot and config: '
      + '; '.join(problems)
      + '. Quantize it with aqtr.quantize_operand(x, dimension_numbers, '
      'config, operand=...) using the same config and dimension numbers.'
    )
  return _Q(x.qvalue, x.scale, None, form)


def _tile_cfg(raw: DotGeneralRaw, k: int) -> int | None:
  ops = [_Operand(None, 'fk', raw.lhs), _Operand(None, 'fk', raw.rhs)]
  return _tile(ops, k)


def _canon_noise(cfg, key, layout, form):
  n = _noise(cfg, key, layout.shape)
  return None if n is None else layout.to_canonical(n, form)
