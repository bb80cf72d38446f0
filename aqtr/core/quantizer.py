"""One tensor: calibrate -> scale -> numerics -> QTensor; and fake quant.

Math: for each scale group G (the view axes the tiling shares)
`bound = calibration(x_G)`, `S = numerics.scale_from_bound(bound) * unit`
(by default `bound / (numerics.max_value / unit)`; `aqtr.core.scale`: kept
normal, an all-zero group gets s = 1, optionally a power of two);
`q = numerics.quantize(x / s (+ noise))`; `x ~ q * S`. Asymmetric numerics
take `(lo, hi) = calibration.calibrate_range(x_G)`,
`s = numerics.scale_from_range(lo, hi)`, `z = numerics.zero_point(lo, s)`
and `q = numerics.quantize(x / s + z)`; `x ~ (q - z) * S`. Quantization is
computed in float32.

Edge cases (documented behaviour, tested):
  * NaN / inf: a row (the elements one dot output sums over) holding a NaN
    or inf gets a NaN scale, so its dequantized values and every dot output
    it feeds are NaN: outputs are non-finite exactly where
    `lax.dot_general` makes them non-finite (NaN where lax may give +-inf).
    Other rows keep finite scales, also under per-tensor tiling, where the
    one bound is taken over the finite values. `clip_gradient` passes the
    gradient of non-finite values (they are never silently zeroed).
  * Tiny magnitudes: scales work over the whole normal float32 range
    (relative error independent of magnitude down to ~1e-36 for int8);
    below, the smallest normal scale 2^-126 is used (fewer grid points).
    Only an exactly zero group falls back to s = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr.core import prims
from aqtr.core.config import TensorConfig
from aqtr.core.dimension_numbers import OperandLayout, normalize_axes
from aqtr.core.eager import compiled_when_eager
from aqtr.core.qtensor import ROLE_AXES, QTensor, from_view, to_view
from aqtr.core.rounding import as_typed_key
from aqtr.core.scale import (
  FIBER_ROLES,
  divide,
  row_flags,
  scale_from_bound,
  scale_from_range,
  scale_shape,
)
from aqtr.core.sparsify import prune


def view_scale_shape(view_shape, cfg: TensorConfig, form: str):
  """The scale shape `quantize_view` gives a view of `view_shape`."""
  return scale_shape(view_shape, cfg.tiling.shared, ROLE_AXES[form])


def scale_problems(scale, view_shape, cfg: TensorConfig, form: str):
  """[] if a stored scale fits a view of `view_shape`, else what is wrong."""
  want = view_scale_shape(view_shape, cfg, form)
  if tuple(jnp.shape(scale)) != want:
    return [f'scale shape {tuple(jnp.shape(scale))} != expected {want}']
  return []


def shared_axes(cfg: TensorConfig, form: str) -> tuple[int, ...]:
  """The view axes the tiling shares one scale along."""
  return tuple(sorted(ROLE_AXES[form][r] for r in cfg.tiling.shared))


def _block_rows(cfg: TensorConfig, form: str, view_shape) -> int | None:
  """Rows per block when a block tiling also shares the free axis."""
  free = ROLE_AXES[form]['free']
  rows = cfg.tiling.free_block(view_shape[free])
  return None if rows is None or free in shared_axes(cfg, form) else rows


def calibration_view(view_shape, cfg: TensorConfig, form: str):
  """(shape, axes) of the array the calibration sees for a view.

  The view itself and the shared axes; with a block tiling (`free_block`)
  the free axis split into blocks of rows (padded), the rows shared too.
  """
  axes = shared_axes(cfg, form)
  rows = _block_rows(cfg, form, view_shape)
  if rows is None:
    return tuple(view_shape), axes
  free = ROLE_AXES[form]['free']
  nb = -(-view_shape[free] // rows)
  shape = view_shape[:free] + (nb, rows) + tuple(view_shape[free + 1 :])
  axes5 = tuple(a + (a > free) for a in axes) + (free + 1,)
  return shape, tuple(sorted(axes5))


class Quantized(NamedTuple):
  """One quantized view (see `quantize_view`).

  Attributes:
    q: the values; s: the scale; z: the zero point (affine) or None.
    mask: the straight-through gradient mask, or None.
    state: a stateful calibration's new {'stats', 'learned'}, or None.
    learned: {name: d xhat / d param} in the view (learned calibrations),
      or None.
  """

  q: jax.Array
  s: jax.Array
  z: jax.Array | None = None
  mask: jax.Array | None = None
  state: dict | None = None
  learned: dict | None = None


def _bounds(cfg: TensorConfig, x, axes, state, finite=False):
  """(bound or (lo, hi), new state or None) of the calibration; `finite`:
  x is known to hold finite values only."""
  cal, n = cfg.calibration, cfg.numerics
  if n.asymmetric:
    return cal.calibrate_range(x, axes), None
  if state is None:
    if finite:
      return cal.bound_of_finite(x, axes, n), None
    return cal.bound_for(x, axes, n), None
  return cal.bound_with_state(x, axes, n, state)


def _calibrate(cfg: TensorConfig, form: str, x, state, finite=False):
  """(bound, new state) of view `x`; block tilings share rows in blocks
  (the last block padded by repeating its last row)."""
  axes = shared_axes(cfg, form)
  rows = _block_rows(cfg, form, x.shape)
  if rows is None:
    return _bounds(cfg, x, axes, state, finite)
  free = ROLE_AXES[form]['free']
  f = x.shape[free]
  pad = [(0, 0)] * x.ndim
  pad[free] = (0, -f % rows)
  shape5, axes5 = calibration_view(x.shape, cfg, form)
  x5 = jnp.pad(x, pad, mode='edge').reshape(shape5)
  bound, new = _bounds(cfg, x5, axes5, state, finite)

  def back(b5):
    b5 = jnp.broadcast_to(
      b5, b5.shape[: free + 1] + (rows,) + b5.shape[free + 2 :]
    )
    b = b5.reshape(b5.shape[:free] + (-1,) + b5.shape[free + 2 :])
    return lax.slice_in_dim(b, 0, f, axis=free)

  return jax.tree.map(back, bound), new


def quantize_view(
  x4: jax.Array,
  cfg: TensorConfig,
  form: str,
  noise=None,
  state: dict | None = None,
) -> Quantized:
  """Quantizes a tiled view.

  The scale (and zero point) have `view_scale_shape`; the scale is NaN for
  the rows holding a NaN or inf (see the module docstring). A stateful
  calibration reads `state` ({'stats', 'learned'}) and returns the next.
  """
  n = cfg.numerics
  cal = cfg.calibration
  x = x4.astype(jnp.float32)
  roles = ROLE_AXES[form]
  spans_rows = (
    _block_rows(cfg, form, x.shape) is not None
    or not cfg.tiling.shared <= FIBER_ROLES
  )
  if spans_rows:  # Groups span rows: bound the finite values, mark bad rows.
    # The row flags from x itself (x - x: +0, or NaN for NaN / inf), so
    # no finite mask is shared by two consumers (and written); the finite
    # values' bound needs no guard of its own (`bound_of_finite`).
    flags = row_flags(x - x, sorted(roles[r] for r in FIBER_ROLES))
    clean = prims.where(jnp.isfinite(x), x, 0.0)
    bound, new_state = _calibrate(cfg, form, clean, state, finite=True)
  else:
    # Groups lie within rows: a non-finite bound (the calibration contract)
    # already marks the rows holding NaN/inf.
    bound, new_state = _calibrate(cfg, form, x, state)
    flags = None
  po2 = cal.po2_scale
  z = None
  if n.asymmetric:
    lo, hi = (b.astype(jnp.float32) for b in bound)
    s = scale_from_range(lo, hi, n, po2)
    z = n.zero_point(lo, s / n.unit)
  else:
    s = scale_from_bound(bound.astype(jnp.float32), n, po2)
  if flags is not None:
    s = s + flags
  shape = view_scale_shape(x.shape, cfg, form)
  s = jnp.broadcast_to(s, shape)
  v = divide(x, s, n.unit)
  if z is not None:
    z = jnp.broadcast_to(z, shape)
    v = v + z
  q = n.quantize(v, noise)  # = quantize_scaled(x, s, n, z, noise)
  mask = n.grad_mask(v)
  learned = None
  if new_state is not None and cal.has_learned:
    learned, mask = cal.value_grad(x, s, n, state)
  if mask is not None:  # Never zero the gradient of a non-finite value
    # or row; a finite x / s that overflows is clipped like any other.
    mask = mask | ~(jnp.isfinite(x) & jnp.isfinite(s))
  return Quantized(q, s, z, mask, new_state, learned)


def quantize_scaled(x, s, numerics, z=None, noise=None) -> jax.Array:
  """The values `numerics.quantize(x / s (+ z))` of `x` with given scales.

  The one rounding step every stored format goes through (`quantize_view`,
  KV caches, quantized training, PTQ grids): `aqtr.core.scale.divide` in
  float32, the zero point of affine numerics added, then the numerics.

  Args:
    x: a float array.
    s: stored scales broadcastable to `x` (from `scale_from_bound`).
    numerics: the number format.
    z: the zero point (affine numerics), or None.
    noise: stochastic-rounding noise shaped like `x`, or None.

  Returns:
    The values in `numerics.dtype`.

  Example:
    >>> import jax.numpy as jnp
    >>> from aqtr.numerics import IntSymmetric
    >>> quantize_scaled(jnp.array([1.0, -3.0]), 0.5, IntSymmetric()).tolist()
    [2, -6]
  """
  v = divide(jnp.asarray(x, jnp.float32), s, numerics.unit)
  if z is not None:
    v = v + z
  return numerics.quantize(v, noise)


def quantize_bound(
  x, bound, numerics, *, po2: bool = False, noise=None
) -> tuple[jax.Array, jax.Array]:
  """(q, S) of `x` whose groups have calibrated `bound` (broadcastable).

  S is the core's scale (`aqtr.core.scale.scale_from_bound`: kept normal,
  1 for an all-zero group, NaN for a NaN / inf bound, so the group's
  dequantized values are NaN), `q = quantize_scaled(x, S, numerics)`.

  Example:
    >>> import jax.numpy as jnp
    >>> from aqtr.numerics import IntSymmetric
    >>> x = jnp.array([[0.5, -1.0], [0.0, 0.0]])
    >>> q, s = quantize_bound(x, jnp.abs(x).max(-1, keepdims=True),
    ...                       IntSymmetric())
    >>> q.tolist(), s.ravel().tolist()
    ([[64, -127], [0, 0]], [0.007874015718698502, 1.0])
  """
  s = scale_from_bound(jnp.asarray(bound, jnp.float32), numerics, po2)
  return quantize_scaled(x, s, numerics, noise=noise), s


def table_codes(
  x: jax.Array, table: Sequence[float], key: jax.Array | None = None
) -> jax.Array:
  """uint8 indices into the sorted `table` of the (normalised) values `x`.

  Nearest (no key): the index of the nearest table value (ties to the
  lower). Stochastic (a key): the lower neighbour `T[i] <= x`, moved up
  with probability `(x - T[i]) / (T[i+1] - T[i])`, so `E[T[code]] = x`
  inside [T_0, T_-1]. Used by the low-bit optimizer states (`aqtr.qt`).

  Example:
    >>> import jax.numpy as jnp
    >>> table_codes(jnp.array([-0.9, 0.2, 0.8]), (-1.0, 0.0, 1.0)).tolist()
    [0, 1, 2]
  """
  t = np.asarray(table, np.float32)
  if key is None:  # Nearest: compare with the midpoints.
    mids = jnp.asarray((t[1:] + t[:-1]) / 2)
    codes = jnp.searchsorted(mids, x, side='left', method='scan_unrolled')
    return codes.astype(jnp.uint8)
  inner = jnp.asarray(t[1:-1])
  lo = jnp.searchsorted(inner, x, side='right', method='scan_unrolled')
  lo = lo.astype(jnp.int32)
  tt = jnp.asarray(t)
  p = (x - tt[lo]) / jnp.asarray(np.diff(t))[lo]
  up = jax.random.uniform(key, x.shape) < p
  return (lo + up).astype(jnp.uint8)


def check_float(x, field: str) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(
      f'{field} must have a floating dtype to be quantized, got '
      f'{jnp.result_type(x)}; allowed: float16, bfloat16, float32, float64.'
    )


def _layout(x, contracting_axes, batch_axes) -> OperandLayout:
  rank = jnp.ndim(x)
  contract = normalize_axes(contracting_axes, rank, 'contracting_axes')
  batch = normalize_axes(batch_axes, rank, 'batch_axes')
  if set(contract) & set(batch):
    raise ValueError(
      'an axis cannot be both in batch_axes and contracting_axes.'
    )
  return OperandLayout(tuple(jnp.shape(x)), batch, contract)


def _quantize(x, config, contracting_axes, batch_axes, key):
  if not isinstance(config, TensorConfig):
    raise TypeError(f'config must be an aqtr.TensorConfig, got {config!r}.')
  check_float(x, 'x')
  lay = _layout(x, contracting_axes, batch_axes)
  x, keep = prune(jnp.asarray(x), config, lay, 'fk', 'config')
  tile = config.tiling.tile(lay.k)
  noise = None
  if config.rounding.stochastic:
    n = config.rounding.noise(as_typed_key(key), lay.shape)
    noise = to_view(lay.to_canonical(n, 'fk'), 'fk', tile)
  x4 = to_view(lay.to_canonical(jnp.asarray(x), 'fk'), 'fk', tile)
  if not config.quantized:
    return QTensor(x4, None, lay, 'fk'), None, keep
  r = quantize_view(x4, config, 'fk', noise)
  return QTensor(r.q, r.s, lay, 'fk', r.z), r.mask, keep


@compiled_when_eager
def quantize(
  x: jax.Array,
  config: TensorConfig | None = None,
  *,
  contracting_axes: Sequence[int] = (-1,),
  batch_axes: Sequence[int] = (),
  key: jax.Array | None = None,
) -> QTensor:
  """Quantizes `x` as operand of a dot contracting `contracting_axes`.

  The tiling shares scales relative to those axes (per-channel: one scale
  per index of the other axes); the sparsity prunes along them first.

  Args:
    x: a float array.
    config: how to quantize (default int8 per-channel absmax).
    contracting_axes: the axes the dot would contract.
    batch_axes: the dot's batch axes.
    key: PRNG key, required for stochastic rounding.

  Returns:
    A QTensor; `.dequant()` gives the quantized values in x's layout.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> aqtr.quantize(jnp.array([[0.5, -1.0]])).qvalue.ravel().tolist()
    [64, -127]
  """
  return _quantize(
    x, config or TensorConfig(), contracting_axes, batch_axes, key
  )[0]


@compiled_when_eager
def fake_quant(
  x: jax.Array,
  config: TensorConfig | None = None,
  *,
  contracting_axes: Sequence[int] = (-1,),
  batch_axes: Sequence[int] = (),
  key: jax.Array | None = None,
) -> jax.Array:
  """Quantize-dequantize `x` in float: the reference the engine must match.

  The value is `quantize(x).dequant()`; the gradient is straight-through,
  masked by the numerics' clip_gradient, and no gradient reaches the scale.
  A pruning sparsity passes the gradient to the dense `x` (SR-STE's added
  `decay * (1 - M) * x` does not depend on the loss, so only the engine's
  custom VJP, `aqtr.dot_general`, adds it).

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> x = jnp.array([[0.25, -1.0]])
    >>> bool((aqtr.fake_quant(x) == aqtr.quantize(x).dequant()).all())
    True
  """
  config = config or TensorConfig()
  xs = jax.lax.stop_gradient(x)
  qt, mask4, _ = _quantize(xs, config, contracting_axes, batch_axes, key)
  xhat = qt.dequant(jnp.result_type(x))
  st = x - xs
  if mask4 is not None:
    mask = qt.layout.from_canonical(from_view(mask4, 'fk'), 'fk')
    st = prims.where(mask, st, 0.0)
  return xhat + st
