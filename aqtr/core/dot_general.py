"""Quantized `dot_general`: the one custom VJP of aqtr.

Math (DESIGN.md section 3). Operands are brought to canonical 3-D layouts
(`dimension_numbers.py`): lhs [B, M, K], rhs [B, N, K] or [B, K, N]. With
per-group scales constant along K (within a tile) the forward factorises:

  out[b, m, n] = sum_j (q_L[b, j, m, :] . q_R[b, j, n, :]) s_L[b,j,m] s_R[b,j,n]

and runs the real int8 x int8 -> int32 (fp8 x fp8 -> f32) dot. With
cotangent g in the output layout [B, M, N]:

  dlhs:  dL = g . Y_R     (contract N)      drhs:  dR = g^T . Y_L  (contract M)

where Y is the float operand, or with `use_fwd_quant` the forward QTensor
whose scale is folded into g first: (g * s_R) . q_R == g . dequant(R). Each
of these dots is quantized by `config.dlhs` / `config.drhs` (the gradient is
their lhs operand). Gradients pass straight through the rounding, masked by
the forward numerics' clip_gradient; no gradient reaches the scales.

Layout: on XLA:CPU an integer dot is fast only when its lhs contracts its
last axis (MK.KN, MK.NK). The forward dot is MK.NK or MK.KN, dlhs is MK.KN
or MK.NK, and drhs emits dW directly in the weight's layout: [N, K] weights
get (g^T)[N, M] . q_L[M, K]; [K, N] weights get q_L^T[K, M] . g[M, N] with
q_L^T written by the forward quantize pass. Freshly written transposed int
arrays are pinned with `optimization_barrier` so XLA cannot fold the
transpose back into the dot (which would pick the slow kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.dimension_numbers import DotLayout
from aqtr.core.qtensor import QTensor, from_view, to_view
from aqtr.core.quantizer import check_float, quantize_view
from aqtr.core.rounding import as_typed_key


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


@dataclasses.dataclass(frozen=True)
class _Shapes:
  """Static operand shapes and dtypes carried in the residuals."""

  lhs: jax.ShapeDtypeStruct
  rhs: jax.ShapeDtypeStruct
  given_l: bool = False
  given_r: bool = False


jax.tree_util.register_static(_Shapes)


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
  q, s, mask = quantize_view(x4, op.cfg, op.form, noise)
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
    qa, qb = (x.astype(jnp.int8) if x.dtype == jnp.int4 else x for x in (qa, qb))
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
  """[B*T, F, t] ('fk') / [B*T, t, F] ('kf') -> canonical [B, F, K] / [B, K, F]."""
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
    problems.append(
      f'layout {x.layout}/{x.form} != the dot\'s {layout}/{form}'
    )
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


def _fwd(lhs, rhs, key, dn, cfg: DotGeneralConfig, precision, preferred):
  lsd, rsd = _shape_dtype(lhs), _shape_dtype(rhs)
  lay = DotLayout.create(lsd.shape, rsd.shape, dn)
  floats = [x.dtype for x in (lhs, rhs) if not isinstance(x, QTensor)]
  out_dtype = preferred or (jnp.result_type(*floats) if floats else
                            jnp.dtype(jnp.float32))
  kf, kl, kr = _keys(key, 3)
  fwd = cfg.fwd
  given_l, given_r = isinstance(lhs, QTensor), isinstance(rhs, QTensor)
  rform = rhs.form if given_r else lay.rhs.natural_form()
  qlt = None
  if not (fwd.lhs.quantized or fwd.rhs.quantized or given_l or given_r):
    out = lax.dot_general(
      lhs, rhs, dn, precision=precision, preferred_element_type=preferred
    )
    ql = qr = None
  else:
    k1, k2 = _keys(kf, 2)
    a = None if given_l else _Operand(
      lay.lhs.to_canonical(lhs, 'fk'), 'fk', fwd.lhs,
      _canon_noise(fwd.lhs, k1, lay.lhs, 'fk'),
    )
    b = None if given_r else _Operand(
      lay.rhs.to_canonical(rhs, rform), rform, fwd.rhs,
      _canon_noise(fwd.rhs, k2, lay.rhs, rform),
    )
    tile = _tile_cfg(fwd, lay.lhs.k)
    ql = (_given(lhs, fwd.lhs, lay.lhs, 'fk', tile, 'lhs') if given_l
          else _prepare(a, tile))
    qr = (_given(rhs, fwd.rhs, lay.rhs, rform, tile, 'rhs') if given_r
          else _prepare(b, tile))
    out3 = _contract(ql, qr, fwd, precision)
    out = out3.reshape(lay.out_shape).astype(out_dtype)
    if ql.s is None:
      ql = None
    if qr.s is None:
      qr = None
    # drhs on a [K, N] weight contracts q_L^T [K, M]: write it now.
    if (
      ql is not None
      and not given_r
      and rform == 'kf'
      and cfg.drhs.use_fwd_quant
      and cfg.drhs.lhs.quantized
    ):
      qlt = _Q(
        lax.optimization_barrier(ql.q.transpose(0, 1, 3, 2)),
        ql.s.transpose(0, 1, 3, 2), None, 'kf',
      )
  # A stored QTensor has no float form: its gradient partner always reuses it.
  reuse_l = ql is not None and (cfg.drhs.use_fwd_quant or given_l)
  reuse_r = qr is not None and (cfg.dlhs.use_fwd_quant or given_r)
  res = (
    None if reuse_l else lhs,
    None if reuse_r else rhs,
    dataclasses.replace(ql, mask=None) if reuse_l else None,
    dataclasses.replace(qr, mask=None) if reuse_r else None,
    qlt,
    _mask(ql, lay.lhs, 'fk'),
    None if qr is None else _mask(qr, lay.rhs, rform),
    kl,
    kr,
    _Shapes(lsd, rsd, given_l, given_r),
  )
  return out, res


def _tile_cfg(raw: DotGeneralRaw, k: int) -> int | None:
  ops = [_Operand(None, 'fk', raw.lhs), _Operand(None, 'fk', raw.rhs)]
  return _tile(ops, k)


def _canon_noise(cfg, key, layout, form):
  n = _noise(cfg, key, layout.shape)
  return None if n is None else layout.to_canonical(n, form)


def _float_grad(lhs, rhs, dn, precision, preferred, g, wrt: int):
  """The gradient of lax.dot_general w.r.t. operand `wrt`, as JAX does it."""
  def f(x):
    args = (x, rhs) if wrt == 0 else (lhs, x)
    return lax.dot_general(
      *args, dn, precision=precision, preferred_element_type=preferred
    )

  x = lhs if wrt == 0 else rhs
  return jax.linear_transpose(f, x)(g)[0]


def _bwd(dn, cfg: DotGeneralConfig, precision, preferred, res, g):
  lhs, rhs, ql, qr, qlt, mask_l, mask_r, kl, kr, shapes = res
  lay = DotLayout.create(shapes.lhs.shape, shapes.rhs.shape, dn)
  ctx = _Ctx(lay, cfg, precision, preferred, shapes, g)
  dl = dr = None  # No gradient reaches a stored QTensor operand.
  if not shapes.given_l:
    dl = _dlhs(ctx, lhs, rhs, qr, kl)
    if mask_l is not None:
      dl = jnp.where(mask_l, dl, jnp.zeros_like(dl))
    dl = dl.astype(shapes.lhs.dtype)
  if not shapes.given_r:
    dr = _drhs(ctx, lhs, rhs, ql, qlt, kr)
    if mask_r is not None:
      dr = jnp.where(mask_r, dr, jnp.zeros_like(dr))
    dr = dr.astype(shapes.rhs.dtype)
  return dl, dr, None


@dataclasses.dataclass
class _Ctx:
  lay: DotLayout
  cfg: DotGeneralConfig
  precision: object
  preferred: object
  shapes: _Shapes
  g: jax.Array


def _residual(x, q: _Q | None, layout, sd):
  """The float residual: x, or the dequantized forward QTensor."""
  return x if q is None else _dequant(q, layout, sd.dtype)


def _dlhs(ctx: _Ctx, lhs, rhs, qr, key):
  lay, raw, precision, g = ctx.lay, ctx.cfg.dlhs, ctx.precision, ctx.g
  reuse = qr is not None
  if not raw.quantized:
    r = _residual(rhs, qr, lay.rhs, ctx.shapes.rhs)
    lzero = jnp.zeros(ctx.shapes.lhs.shape, ctx.shapes.lhs.dtype)
    dl = _float_grad(lzero, r, _dn(lay), precision, ctx.preferred, g, 0)
  else:
    bsz, m = lay.lhs.b, lay.lhs.f
    g3 = g.reshape(bsz, m, lay.rhs.f)
    noise = _noise(raw.lhs, key, lay.out_shape)
    n3 = None if noise is None else noise.reshape(g3.shape)
    if reuse:
      ga, n = _fold(g3, qr, axis=2)
      a = _Operand(ga, 'fk', raw.lhs, _tiled(n, n3))
      b = _as_given(qr)
      b.form = _flip(qr.form)
      out, _, _ = _pass(a, b, raw, precision)
      dl3 = _untile(out, n, 'fk')
    else:
      k1, k2 = _keys(key, 2)
      a = _Operand(g3, 'fk', raw.lhs, n3)
      rf = lay.rhs.natural_form()
      b = _Operand(
        lay.rhs.to_canonical(rhs, rf), _flip(rf), raw.rhs,
        _canon_noise(raw.rhs, k2, lay.rhs, rf),
      )
      dl3, _, _ = _pass(a, b, raw, precision)
    dl = lay.lhs.from_canonical(dl3, 'fk')
  return dl


def _drhs(ctx: _Ctx, lhs, rhs, ql, qlt, key):
  lay, raw, precision, g = ctx.lay, ctx.cfg.drhs, ctx.precision, ctx.g
  rform = lay.rhs.natural_form()
  reuse = ql is not None
  if not raw.quantized:
    lres = _residual(lhs, ql, lay.lhs, ctx.shapes.lhs)
    rzero = jnp.zeros(ctx.shapes.rhs.shape, ctx.shapes.rhs.dtype)
    dr = _float_grad(lres, rzero, _dn(lay), precision, ctx.preferred, g, 1)
  else:
    bsz, m, n_ = lay.lhs.b, lay.lhs.f, lay.rhs.f
    g3 = g.reshape(bsz, m, n_)
    noise = _noise(raw.lhs, key, lay.out_shape)
    n3 = None if noise is None else noise.reshape(g3.shape)
    k2 = _keys(key, 2)[1]
    if rform == 'fk':  # dR [B, N, K] = g^T [B, N, M] . L [B, M, K]
      gt = g3.transpose(0, 2, 1)
      nt = None if n3 is None else n3.transpose(0, 2, 1)
      if reuse:
        ga, n = _fold(gt, ql, axis=2)
        a = _Operand(ga, 'fk', raw.lhs, _tiled(n, nt))
        b = _as_given(ql)
        b.form = 'kf'
        out, _, _ = _pass(a, b, raw, precision)
        dr3 = _untile(out, n, 'fk')
      else:
        a = _Operand(gt, 'fk', raw.lhs, nt)
        b = _Operand(
          lay.lhs.to_canonical(lhs, 'fk'), 'kf', raw.rhs,
          _canon_noise(raw.rhs, k2, lay.lhs, 'fk'),
        )
        dr3, _, _ = _pass(a, b, raw, precision)
    else:  # dR [B, K, N] = L^T [B, K, M] . g [B, M, N]
      if reuse:
        ga, n = _fold(g3, ql, axis=1)
        b = _Operand(ga, 'kf', raw.lhs, _tiled(n, n3))
        if qlt is None:  # g is not quantized: a float dot, layout is free.
          qlt = _Q(ql.q.transpose(0, 1, 3, 2), None, None, 'kf')
        a = _as_given(qlt)
        a.form = 'fk'
        out, _, _ = _pass(a, b, raw, precision)
        dr3 = _untile(out, n, 'kf')
      else:
        lt = lay.lhs.to_canonical(lhs, 'kf')
        a = _Operand(lt, 'fk', raw.rhs, _canon_noise(raw.rhs, k2, lay.lhs,
                                                      'kf'))
        b = _Operand(g3, 'kf', raw.lhs, n3)
        dr3, _, _ = _pass(a, b, raw, precision)
    dr = lay.rhs.from_canonical(dr3, rform)
  return dr


def _dn(lay: DotLayout):
  return (lay.lhs.contract, lay.rhs.contract), (lay.lhs.batch, lay.rhs.batch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _qdot(lhs, rhs, key, dn, cfg, precision, preferred):
  return _fwd(lhs, rhs, key, dn, cfg, precision, preferred)[0]


_qdot.defvjp(_fwd, _bwd)
_qdot_jit = jax.jit(_qdot, static_argnums=(3, 4, 5, 6))


def dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers,
  config: DotGeneralConfig | None = None,
  *,
  key: jax.Array | None = None,
  precision=None,
  preferred_element_type=None,
) -> jax.Array:
  """Drop-in for `jax.lax.dot_general` quantized as `config` says.

  Args:
    lhs, rhs: float operands; either may instead be a QTensor made by
      `quantize_operand` with the same config and dimension numbers (serving
      frozen weights: no float copy needed; no gradient reaches it).
    dimension_numbers: ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)).
    config: a DotGeneralConfig; None (or an all-float config) is exactly
      `lax.dot_general`, values and gradients.
    key: PRNG key (typed or raw uint32[2]); required by stochastic rounding.
    precision, preferred_element_type: as in `lax.dot_general`; precision
      applies to the float dots.

  Returns:
    [batch..., lhs free..., rhs free...] in `preferred_element_type` or the
    operands' result type.

  Example:
    >>> import jax, jax.numpy as jnp, aqtr
    >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
    >>> aqtr.dot_general(x, w, (((1,), (0,)), ((), ())),
    ...                  aqtr.presets.int8()).tolist()[0]
    [8.0, 8.0]
  """
  if config is not None and not isinstance(config, DotGeneralConfig):
    raise TypeError(
      f'config must be an aqtr.DotGeneralConfig or None, got {config!r}.'
    )
  given = [isinstance(x, QTensor) for x in (lhs, rhs)]
  if any(given) and config is None:
    raise ValueError(
      'a QTensor operand needs the config it was quantized with: pass '
      'config=...'
    )
  empty = any(
    not isinstance(x, QTensor) and jnp.size(x) == 0 for x in (lhs, rhs)
  )
  # Zero-size operands: nothing to quantize; lax gives the (empty or zero)
  # result and gradients.
  if not any(given) and (config is None or config.is_float or empty):
    return lax.dot_general(
      lhs, rhs, dimension_numbers, precision=precision,
      preferred_element_type=preferred_element_type,
    )
  if not given[0]:
    lhs = jnp.asarray(lhs)
    check_float(lhs, 'lhs')
  if not given[1]:
    rhs = jnp.asarray(rhs)
    check_float(rhs, 'rhs')
  dn = _dn(
    DotLayout.create(
      _shape_dtype(lhs).shape, _shape_dtype(rhs).shape, dimension_numbers
    )
  )
  if config.needs_key:
    if key is None:
      raise ValueError(
        'config uses stochastic rounding and needs a PRNG key: pass '
        'key=jax.random.key(seed) (a raw jax.random.PRNGKey works too).'
      )
  key = as_typed_key(key) if config.needs_key else None
  preferred = (
    None if preferred_element_type is None
    else jnp.dtype(preferred_element_type)
  )
  return _qdot_jit(lhs, rhs, key, dn, config, precision, preferred)


def quantize_operand(
  x: jax.Array,
  dimension_numbers,
  config: DotGeneralConfig,
  *,
  operand: str = 'rhs',
  other_shape=None,
  key: jax.Array | None = None,
) -> QTensor:
  """Quantizes one operand exactly as the forward pass of `config` would.

  The result can be stored (e.g. frozen int8 weights) and passed to
  `dot_general` in place of the float operand: the output is bit-identical
  to running the float operand through the same config.

  Args:
    x: the float operand.
    dimension_numbers: of the dot it will be used in.
    config: the DotGeneralConfig of that dot (its fwd.<operand> applies).
    operand: 'lhs' or 'rhs'.
    other_shape: shape of the other operand; default: inferred as needed
      (only the contraction/batch sizes matter, taken from `x`).
    key: PRNG key if the forward rounding is stochastic.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> dn = (((1,), (0,)), ((), ()))
    >>> w = aqtr.quantize_operand(jnp.ones((8, 2)), dn, aqtr.presets.int8())
    >>> aqtr.dot_general(jnp.ones((4, 8)), w, dn, aqtr.presets.int8())[0]
    Array([8., 8.], dtype=float32)
  """
  if operand not in ('lhs', 'rhs'):
    raise ValueError(f"operand must be 'lhs' or 'rhs', got {operand!r}.")
  if not isinstance(config, DotGeneralConfig):
    raise TypeError(f'config must be an aqtr.DotGeneralConfig, got {config!r}.')
  x = jnp.asarray(x)
  check_float(x, 'x')
  (lc, rc), (lb, rb) = dimension_numbers
  mine, theirs = ((lc, lb), (rc, rb)) if operand == 'lhs' else ((rc, rb),
                                                               (lc, lb))
  if other_shape is None:  # A stand-in partner with matching sizes.
    nd = len(theirs[0]) + len(theirs[1])
    other_shape = [1] * max(nd, 1 + max((*theirs[0], *theirs[1], -1)))
    for a, b in zip((*mine[0], *mine[1]), (*theirs[0], *theirs[1]),
                    strict=True):
      other_shape[b] = x.shape[a]
  shapes = (x.shape, other_shape) if operand == 'lhs' else (other_shape,
                                                             x.shape)
  lay = DotLayout.create(*shapes, dimension_numbers)
  side = getattr(lay, operand)
  cfg = getattr(config.fwd, operand)
  if not cfg.quantized:
    raise ValueError(
      f'config.fwd.{operand} is not quantized; nothing to freeze.'
    )
  form = 'fk' if operand == 'lhs' else side.natural_form()
  tile = _tile_cfg(config.fwd, side.k)
  key = as_typed_key(key)
  if key is not None:
    key = _keys(_keys(key, 3)[0], 2)[0 if operand == 'lhs' else 1]
  op = _Operand(side.to_canonical(x, form), form, cfg,
                _canon_noise(cfg, key, side, form))
  q = _prepare(op, tile)
  return QTensor(q.q, q.s, side, form)
