"""Quantized `dot_general`: the one custom VJP of aqtr.

Math. Operands are brought to canonical 3-D layouts (`dimension_numbers.py`):
L [B, M, K], R [B, N, K] or [B, K, N]. With per-group scales constant along K
(within a tile j) the forward factorises:

  out[b, m, n] = sum_j (q_L[b, j, m, :] . q_R[b, j, n, :]) s_L[b,j,m] s_R[b,j,n]

and runs the real int8 x int8 -> int32 (fp8 x fp8 -> f32) dot. With
cotangent g in the output layout [B, M, N]:

  dlhs:  dL = g . Y_R     (contract N)      drhs:  dR = g^T . Y_L  (contract M)

where Y is the float operand or, when reusing the forward quantization
(`use_fwd_quant`), the forward QTensor whose scale is folded into g first:
(g * s_R) . q_R == g . dequant(R). Each of these dots is quantized by
`config.dlhs` / `config.drhs` (the gradient g is their lhs operand).
Gradients pass straight through the rounding, masked by the forward
numerics' clip_gradient; no gradient reaches the scales, except through a
learned calibration (LSQ, PACT), whose own rule replaces the straight
through one.

State (`aqtr.core.stateful`): with `state=`, the call returns
(out, new_state); the state is a differentiable input of this VJP, whose
cotangent carries the backward operands' new state and the learned
parameters' gradients.

Layout: on XLA:CPU an integer dot is fast only when its lhs contracts its
last axis (MK.KN, MK.NK). The forward dot is MK.NK or MK.KN, dlhs is MK.KN
or MK.NK, and drhs emits dR directly in the weight's layout: [N, K] weights
get q_g^T[N, M] . q_L[M, K]; [K, N] weights get q_L^T[K, M] . q_g[M, N],
with q_L^T written by the forward pass. A transposed operand is quantized
as it lies and its int8 values copied transposed (`passes.quantized_dot`,
`QuantizedOperand.with_transposed`): XLA:CPU quantizes a transposed float
array several times slower.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core.config import DotGeneralConfig, DotGeneralRaw
from aqtr.core.dimension_numbers import DotLayout
from aqtr.core.engine_state import (
  check_state_tree,
  forward_state,
  state_cotangent,
)
from aqtr.core.first_order import first_order_only
from aqtr.core.passes import (
  Operand,
  PassKeys,
  QuantizedOperand,
  canonical_noise,
  common_tile,
  contract,
  flip,
  fold_scale,
  forward_operand,
  merge_tiles,
  quantized_dot_state,
  repeat_tiles,
  residual_key,
  rounding_noise,
  struct_of,
)
from aqtr.core.qtensor import QTensor
from aqtr.core.quantizer import check_float
from aqtr.core.ragged import ragged_bwd, ragged_fwd
from aqtr.core.residuals import (
  Residuals,
  drhs_contracts_q_lhs_t,
  make_residuals,
)
from aqtr.core.rounding import as_typed_key
from aqtr.core.sharding import (
  check_dot_out_sharding,
  check_operands,
  gather_specs,
  keep_on_shards,
  match_vma,
  run_on_mesh,
  zeros_varying,
)
from aqtr.core.sparsify import prune_operands, site_entries, sites_of
from aqtr.core.zero_point import reuse_term

# ------------------------------------------------------------------- forward


def _fwd(lhs, rhs, key, state, dn, cfg, precision, preferred, specs=None):
  """((out, new_state), residuals) (specs: `gather_specs`).

  A sparsity prunes the forward operands first (`core.sparsify`): every
  pass then sees the pruned operands; SR-STE terms go to the residuals.
  """
  lay = DotLayout.create(struct_of(lhs).shape, struct_of(rhs).shape, dn)
  lhs, rhs, terms, sites = prune_operands(lhs, rhs, lay, cfg, sites_of(state))
  out, q_lhs, q_rhs, res = _fwd_out(
    lhs, rhs, key, state, dn, cfg, precision, preferred, specs
  )
  res = dataclasses.replace(res, sr_lhs=terms[0], sr_rhs=terms[1])
  (out, new_state), res = forward_state(out, state, q_lhs, q_rhs, res)
  return (out, {**new_state, **site_entries(sites)}), res


def _fwd_out(lhs, rhs, key, state, dn, cfg: DotGeneralConfig, *static):
  """out = L . R, quantized as `cfg.fwd` says; q_L, q_R; the residuals."""
  precision, preferred, specs = static
  lay = DotLayout.create(struct_of(lhs).shape, struct_of(rhs).shape, dn)
  keys = PassKeys.split(key)
  stored = isinstance(lhs, QTensor) or isinstance(rhs, QTensor)
  if not (cfg.fwd.lhs.quantized or cfg.fwd.rhs.quantized or stored):
    out = lax.dot_general(
      lhs, rhs, dn, precision=precision, preferred_element_type=preferred
    )
    res = make_residuals(lhs, rhs, None, None, lay, cfg, keys)
    return out, None, None, res
  rhs_form = rhs.form if isinstance(rhs, QTensor) else lay.rhs.natural_form()
  tile = common_tile([cfg.fwd.lhs, cfg.fwd.rhs], lay.lhs.k)
  q_lhs = forward_operand(
    lhs, cfg.fwd.lhs, lay.lhs, 'fk', tile, keys.fwd_lhs, 'lhs',
    state.get('fwd.lhs'),
  )  # fmt: skip
  q_rhs = forward_operand(
    rhs, cfg.fwd.rhs, lay.rhs, rhs_form, tile, keys.fwd_rhs, 'rhs',
    state.get('fwd.rhs'),
  )  # fmt: skip
  q_lhs, q_rhs = keep_on_shards(q_lhs, q_rhs, lay, specs)
  q_lhs_t = None
  if drhs_contracts_q_lhs_t(lhs, rhs, q_lhs, lay, cfg):
    q_lhs, q_lhs_t = q_lhs.with_transposed()
  out = contract(q_lhs, q_rhs, cfg.fwd, precision).reshape(lay.out_shape)
  floats = [x.dtype for x in (lhs, rhs) if not isinstance(x, QTensor)]
  out_dtype = preferred or (
    jnp.result_type(*floats) if floats else jnp.dtype(jnp.float32)
  )
  res = make_residuals(lhs, rhs, q_lhs, q_rhs, lay, cfg, keys, q_lhs_t)
  return out.astype(out_dtype), q_lhs, q_rhs, res


# ------------------------------------------------------------------ backward


@dataclasses.dataclass(frozen=True)
class _Backward:
  """The static context of one backward pass."""

  lay: DotLayout
  precision: object
  preferred: object


def _bwd(dn, cfg: DotGeneralConfig, precision, preferred, specs, res, gs):
  del specs  # Forward only.
  g = gs[0]  # The new state's cotangent is ignored.
  lay = DotLayout.create(res.lhs_struct.shape, res.rhs_struct.shape, dn)
  ctx = _Backward(lay, precision, preferred)
  dl = dr = dl_raw = dr_raw = None  # No gradient reaches a stored QTensor.
  st_l = st_r = None
  if not res.lhs_stored:
    dl_raw, st_l = _dlhs(ctx, cfg.dlhs, res, g)
    dl = _plus(_masked(dl_raw, res.mask_lhs), res.sr_lhs)
    dl = match_vma(dl.astype(res.lhs_struct.dtype), res.lhs_vma)
  if not res.rhs_stored:
    dr_raw, st_r = _drhs(ctx, cfg.drhs, res, g)
    dr = _plus(_masked(dr_raw, res.mask_rhs), res.sr_rhs)
    dr = match_vma(dr.astype(res.rhs_struct.dtype), res.rhs_vma)
  st = state_cotangent(res, st_l, st_r, dl_raw, dr_raw, cfg, lay)
  # Differentiating again raises.
  return (*first_order_only(dl, dr), None, st)


def _masked(grad: jax.Array, mask: jax.Array | None) -> jax.Array:
  return grad if mask is None else jnp.where(mask, grad, jnp.zeros_like(grad))


def _plus(grad: jax.Array, term: jax.Array | None) -> jax.Array:
  """The gradient plus a sparsity's SR-STE term (`sparsify.decay_term`)."""
  return grad if term is None else grad + term.astype(grad.dtype)


def _float_grad(ctx: _Backward, lhs, rhs, g, wrt: int) -> jax.Array:
  """The gradient of lax.dot_general w.r.t. operand `wrt`, as JAX does it."""

  def f(x):
    args = (x, rhs) if wrt == 0 else (lhs, x)
    return lax.dot_general(
      *args,
      ctx.lay.dimension_numbers,
      precision=ctx.precision,
      preferred_element_type=ctx.preferred,
    )

  return jax.linear_transpose(f, lhs if wrt == 0 else rhs)(g)[0]


def _float_residual(x, q: QuantizedOperand | None, layout, struct):
  """Y: the float operand, or the dequantized forward quantization."""
  return x if q is None else q.dequantized(layout, struct.dtype)


def _gradient(ctx: _Backward, raw: DotGeneralRaw, key, g):
  """g as [B, M, N] and its rounding noise (drawn in the output layout)."""
  lay = ctx.lay
  g3 = g.reshape(lay.lhs.b, lay.lhs.f, lay.rhs.f)
  noise = rounding_noise(raw.lhs, key, lay.out_shape)
  return g3, None if noise is None else noise.reshape(g3.shape)


# dlhs: dL [B, M, K] = g [B, M, N] . Y_R, contracting N.


def _dlhs(ctx: _Backward, raw: DotGeneralRaw, res: Residuals, g):
  """(dL, the gradient operand's new calibration state or None)."""
  lay = ctx.lay
  if not raw.quantized:
    y_r = _float_residual(res.rhs, res.q_rhs, lay.rhs, res.rhs_struct)
    zero_l = zeros_varying(res.lhs_struct, res.lhs_vma)
    return _float_grad(ctx, zero_l, y_r, g, wrt=0), None
  g3, noise = _gradient(ctx, raw, res.key_dlhs, g)
  gst = res.state.get('dlhs.lhs')
  if res.q_rhs is not None:
    dl3, st = _dlhs_reusing(ctx, raw, g3, noise, res.q_rhs, gst)
  else:
    key = residual_key(res.key_dlhs)
    dl3, st = _dlhs_requantizing(ctx, raw, g3, noise, res.rhs, key, gst)
  return lay.lhs.from_canonical(dl3, 'fk'), st


def _minus_zero_point(out, g_s, q: QuantizedOperand, axis: int):
  """Subtracts (g s) . z of a reused affine operand (`zero_point.py`)."""
  z = q.partner_zero_point()
  return out if z is None else out - reuse_term(g_s, z, axis)


def _grad_operand(g, form, raw, noise, gst, path) -> Operand:
  """The gradient g as the lhs operand of a backward dot (state `gst`)."""
  return Operand(g, form, raw.lhs, noise, None, gst, path)


def _dlhs_reusing(ctx, raw, g, noise, q_r: QuantizedOperand, gst):
  """(g * s_R) . q_R, per tile of R."""
  g_s, n = fold_scale(g, q_r, axis=2)
  a = _grad_operand(g_s, 'fk', raw, repeat_tiles(noise, n), gst, 'dlhs.lhs')
  out, st, _ = quantized_dot_state(a, q_r.as_partner(), raw, ctx.precision)
  return merge_tiles(_minus_zero_point(out, g_s, q_r, 2), n, 'fk'), st


def _dlhs_requantizing(ctx, raw, g, noise, rhs, key, gst):
  """g . R, both quantized by `raw`; R is seen in its natural form."""
  form = ctx.lay.rhs.natural_form()
  r = Operand(
    ctx.lay.rhs.to_canonical(rhs, form),
    flip(form),  # R's free axis N is contracted here.
    raw.rhs,
    canonical_noise(raw.rhs, key, ctx.lay.rhs, form),
    path='dlhs.rhs',
  )
  a = _grad_operand(g, 'fk', raw, noise, gst, 'dlhs.lhs')
  out, st, _ = quantized_dot_state(a, r, raw, ctx.precision)
  return out, st


# drhs: dR = g^T . Y_L, contracting M, emitted in R's natural form:
#   'fk' weights [B, N, K] = g^T [B, N, M] . L [B, M, K]
#   'kf' weights [B, K, N] = L^T [B, K, M] . g [B, M, N]


def _drhs(ctx: _Backward, raw: DotGeneralRaw, res: Residuals, g):
  """(dR, the gradient operand's new calibration state or None)."""
  lay = ctx.lay
  if not raw.quantized:
    y_l = _float_residual(res.lhs, res.q_lhs, lay.lhs, res.lhs_struct)
    zero_r = zeros_varying(res.rhs_struct, res.rhs_vma)
    return _float_grad(ctx, y_l, zero_r, g, wrt=1), None
  g3, noise = _gradient(ctx, raw, res.key_drhs, g)
  key = residual_key(res.key_drhs)
  gst = res.state.get('drhs.lhs')
  reusing = res.q_lhs is not None
  if lay.rhs.natural_form() == 'fk':
    run = _drhs_nk_reusing if reusing else _drhs_nk_requantizing
  else:
    run = _drhs_kn_reusing if reusing else _drhs_kn_requantizing
  y = res.q_lhs if reusing else (res.lhs, key)
  dr3, st = run(ctx, raw, g3, noise, y, gst)
  return lay.rhs.from_canonical(dr3, lay.rhs.natural_form()), st


def _drhs_nk_reusing(ctx, raw, g, noise, q_l: QuantizedOperand, gst):
  """(g * s_L)^T . q_L, per tile of L: [B, N, K].

  g [B, M, N] is the 'kf' lhs of this dot (M contracted), written
  transposed after its quantization.
  """
  g_s, n = fold_scale(g, q_l, axis=1)
  a = _grad_operand(g_s, 'kf', raw, repeat_tiles(noise, n), gst, 'drhs.lhs')
  out, st, _ = quantized_dot_state(a, q_l.as_partner(), raw, ctx.precision)
  z = q_l.partner_zero_point()  # g_s is [B, M, N]: sum over M, as [B, N, 1]
  if z is not None:
    out = out - reuse_term(g_s, z, 1).transpose(0, 2, 1)
  return merge_tiles(out, n, 'fk'), st


def _drhs_nk_requantizing(ctx, raw, g, noise, lhs_key, gst):
  """g^T . L, both quantized by `raw`: [B, N, K]."""
  lhs, key = lhs_key
  lay_l = ctx.lay.lhs
  l_op = Operand(
    lay_l.to_canonical(lhs, 'fk'),
    'kf',  # L's free axis M is contracted here.
    raw.rhs,
    canonical_noise(raw.rhs, key, lay_l, 'fk'),
    path='drhs.rhs',
  )
  a = _grad_operand(g, 'kf', raw, noise, gst, 'drhs.lhs')  # g^T, quantized.
  out, st, _ = quantized_dot_state(a, l_op, raw, ctx.precision)
  return out, st


def _drhs_kn_reusing(ctx, raw, g, noise, q_lt: QuantizedOperand, gst):
  """q_L^T . (g * s_L), per tile of L: [B, K, N]; q_L^T is [B, T, t, M]."""
  g_s, n = fold_scale(g, q_lt, axis=1)
  b = _grad_operand(g_s, 'kf', raw, repeat_tiles(noise, n), gst, 'drhs.lhs')
  out, _, st = quantized_dot_state(q_lt.as_partner(), b, raw, ctx.precision)
  return merge_tiles(_minus_zero_point(out, g_s, q_lt, 1), n, 'kf'), st


def _drhs_kn_requantizing(ctx, raw, g, noise, lhs_key, gst):
  """L^T . g, both quantized by `raw`: [B, K, N]."""
  lhs, key = lhs_key
  lay_l = ctx.lay.lhs
  l_op = Operand(
    lay_l.to_canonical(lhs, 'fk'),
    'kf',  # L's free axis M is contracted: L^T after quantization.
    raw.rhs,
    canonical_noise(raw.rhs, key, lay_l, 'fk'),
    path='drhs.rhs',
  )
  b = _grad_operand(g, 'kf', raw, noise, gst, 'drhs.lhs')
  out, _, st = quantized_dot_state(l_op, b, raw, ctx.precision)
  return out, st


# ------------------------------------------------------------ the custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _qdot(lhs, rhs, key, state, dn, cfg, precision, preferred, specs):
  return _fwd(lhs, rhs, key, state, dn, cfg, precision, preferred, specs)[0]


_qdot.defvjp(_fwd, _bwd)
_qdot_jit = jax.jit(_qdot, static_argnums=(4, 5, 6, 7, 8))


def raw_qdot(lhs, rhs, state, dn, config, key=None):
  """(out, new_state) without checks or jit (for `aqtr.state.init`)."""
  return _qdot(lhs, rhs, key, state, dn, config, None, None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _qragged(lhs, rhs, group_sizes, key, cfg, precision, preferred):
  return ragged_fwd(lhs, rhs, group_sizes, key, cfg, precision, preferred)[0]


_qragged.defvjp(ragged_fwd, ragged_bwd)
# The custom VJP of `aqtr.ragged_dot` (passes in `ragged.py`): (lhs, rhs,
# group_sizes, key, config, precision, preferred_element_type).
quantized_ragged_dot = jax.jit(_qragged, static_argnums=(4, 5, 6))


def dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers,
  config: DotGeneralConfig | None = None,
  *,
  key: jax.Array | None = None,
  precision=None,
  preferred_element_type=None,
  out_sharding=None,
  state: dict | None = None,
):
  """Drop-in for `jax.lax.dot_general` quantized as `config` says.

  On a mesh (auto/explicit axes, `jax.shard_map`) it computes what it
  computes on one device, with lax's output sharding (`core.sharding`).

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
    out_sharding: as in `lax.dot_general` (a NamedSharding or
      PartitionSpec of the output); under auto axes a sharding constraint.
    state: the calibration state tree (`aqtr.state.init`) when the config
      has stateful or learned calibrations; see `aqtr.core.stateful`.

  Returns:
    [batch..., lhs free..., rhs free...] in `preferred_element_type` or the
    operands' result type; with `state`, the pair (out, new_state).

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
  check_dot_out_sharding(out_sharding, lhs, rhs, dimension_numbers)
  stored = [isinstance(x, QTensor) for x in (lhs, rhs)]
  check_state_tree(config, state, tuple(stored))
  if any(stored) and config is None:
    raise ValueError(
      'a QTensor operand needs the config it was quantized with: pass '
      'config=...'
    )
  empty = any(
    not isinstance(x, QTensor) and jnp.size(x) == 0 for x in (lhs, rhs)
  )
  # Zero-size operands: nothing to quantize; lax gives the (empty or zero)
  # result and gradients.
  if not any(stored) and (config is None or config.is_float or empty):
    out = lax.dot_general(
      lhs,
      rhs,
      dimension_numbers,
      precision=precision,
      preferred_element_type=preferred_element_type,
      out_sharding=out_sharding,
    )
    return out if state is None else (out, state)
  if not stored[0]:
    lhs = jnp.asarray(lhs)
    check_float(lhs, 'lhs')
  if not stored[1]:
    rhs = jnp.asarray(rhs)
    check_float(rhs, 'rhs')
  lay = DotLayout.create(
    struct_of(lhs).shape, struct_of(rhs).shape, dimension_numbers
  )
  if config.needs_key and key is None:
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
  dn, fwd = lay.dimension_numbers, config.fwd
  check_operands(lhs, rhs, dn, common_tile([fwd.lhs, fwd.rhs], lay.lhs.k))
  static = (dn, config, precision, preferred, gather_specs(lhs, rhs, fwd))
  structs = [struct_of(x) if isinstance(x, QTensor) else x for x in (lhs, rhs)]
  if state is not None:

    def run_state(lhs, rhs, key, state):
      return _qdot_jit(lhs, rhs, key, state, *static)

    args = (lhs, rhs, key, state)
    return run_on_mesh(
      run_state, args, structs, dn, preferred, out_sharding, state
    )

  def run(lhs, rhs, key):
    return _qdot_jit(lhs, rhs, key, {}, *static)[0]

  return run_on_mesh(run, (lhs, rhs, key), structs, dn, preferred, out_sharding)
