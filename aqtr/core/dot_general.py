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

from aqtr.core.config import DotGeneralConfig
from aqtr.core.dimension_numbers import DotLayout
from aqtr.core.first_order import first_order_only
from aqtr.core.passes import (
  _Q,
  _as_given,
  _canon_noise,
  _contract,
  _dequant,
  _flip,
  _fold,
  _given,
  _keys,
  _mask,
  _noise,
  _Operand,
  _pass,
  _prepare,
  _shape_dtype,
  _tile_cfg,
  _tiled,
  _untile,
)
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import check_float
from aqtr.core.rounding import as_typed_key


@dataclasses.dataclass(frozen=True)
class _Shapes:
  """Static operand shapes and dtypes carried in the residuals."""

  lhs: jax.ShapeDtypeStruct
  rhs: jax.ShapeDtypeStruct
  given_l: bool = False
  given_r: bool = False


jax.tree_util.register_static(_Shapes)


def _fwd(lhs, rhs, key, dn, cfg: DotGeneralConfig, precision, preferred):
  lsd, rsd = _shape_dtype(lhs), _shape_dtype(rhs)
  lay = DotLayout.create(lsd.shape, rsd.shape, dn)
  floats = [x.dtype for x in (lhs, rhs) if not isinstance(x, QTensor)]
  out_dtype = preferred or (
    jnp.result_type(*floats) if floats else jnp.dtype(jnp.float32)
  )
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
    a = (
      None
      if given_l
      else _Operand(
        lay.lhs.to_canonical(lhs, 'fk'),
        'fk',
        fwd.lhs,
        _canon_noise(fwd.lhs, k1, lay.lhs, 'fk'),
      )
    )
    b = (
      None
      if given_r
      else _Operand(
        lay.rhs.to_canonical(rhs, rform),
        rform,
        fwd.rhs,
        _canon_noise(fwd.rhs, k2, lay.rhs, rform),
      )
    )
    tile = _tile_cfg(fwd, lay.lhs.k)
    ql = (
      _given(lhs, fwd.lhs, lay.lhs, 'fk', tile, 'lhs')
      if given_l
      else _prepare(a, tile)
    )
    qr = (
      _given(rhs, fwd.rhs, lay.rhs, rform, tile, 'rhs')
      if given_r
      else _prepare(b, tile)
    )
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
        ql.s.transpose(0, 1, 3, 2),
        None,
        'kf',
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
  return (*first_order_only(dl, dr), None)  # Differentiating again raises.


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
        lay.rhs.to_canonical(rhs, rf),
        _flip(rf),
        raw.rhs,
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
          lay.lhs.to_canonical(lhs, 'fk'),
          'kf',
          raw.rhs,
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
        a = _Operand(
          lt, 'fk', raw.rhs, _canon_noise(raw.rhs, k2, lay.lhs, 'kf')
        )
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
  key = as_typed_key(key)  # Checked even where unused.
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
      lhs,
      rhs,
      dimension_numbers,
      precision=precision,
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
  key = key if config.needs_key else None
  preferred = (
    None
    if preferred_element_type is None
    else jnp.dtype(preferred_element_type)
  )
  return _qdot_jit(lhs, rhs, key, dn, config, precision, preferred)
