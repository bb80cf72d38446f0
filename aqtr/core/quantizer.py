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

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core import stateful
from aqtr.core.config import TensorConfig
from aqtr.core.dimension_numbers import OperandLayout, normalize_axes
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


def _blocked(calibrate, x: jax.Array, axes, free_axis: int, rows: int):
  """`calibrate(x, axes)` with the free axis also shared in blocks of `rows`.

  The free axis is split into blocks (the last one padded by repeating its
  last row), the blocks' rows are reduced with `axes`, and the result is
  repeated back to one entry per row. Works for bounds and (lo, hi) pairs.
  """
  f = x.shape[free_axis]
  pad = [(0, 0)] * x.ndim
  pad[free_axis] = (0, -f % rows)
  xp = jnp.pad(x, pad, mode='edge')
  nb = xp.shape[free_axis] // rows
  x5 = xp.reshape(x.shape[:free_axis] + (nb, rows) + x.shape[free_axis + 1 :])
  axes5 = tuple(a + (a > free_axis) for a in axes) + (free_axis + 1,)

  def back(b5):
    b5 = jnp.broadcast_to(
      b5, b5.shape[: free_axis + 1] + (rows,) + b5.shape[free_axis + 2 :]
    )
    b = b5.reshape(
      b5.shape[:free_axis] + (nb * rows,) + b5.shape[free_axis + 2 :]
    )
    return lax.slice_in_dim(b, 0, f, axis=free_axis)

  return jax.tree.map(back, calibrate(x5, tuple(sorted(axes5))))


def view_scale_shape(view_shape, cfg: TensorConfig, form: str):
  """The scale shape `quantize_view` gives a view of `view_shape`."""
  return scale_shape(view_shape, cfg.tiling.shared, ROLE_AXES[form])


def scale_problems(scale, view_shape, cfg: TensorConfig, form: str):
  """[] if a stored scale fits a view of `view_shape`, else what is wrong."""
  want = view_scale_shape(view_shape, cfg, form)
  if tuple(jnp.shape(scale)) != want:
    return [f'scale shape {tuple(jnp.shape(scale))} != expected {want}']
  return []


def _bound(cal, x, axes, n, state, path):
  """(bound, new_state or None): stateless, recorded, or stateful."""
  if not stateful.is_stateful(cal):
    return cal.bound_for(x, axes, n), None
  if state is None and stateful.record(path, x, axes):
    return cal.calibrate(x, axes), None
  return stateful.site_bound(cal, x, axes, n, state, path)


def _calibrator(cfg: TensorConfig, form: str, x_shape, state, path: str):
  """`calibrate(x, axes)` for the numerics: a bound, or (lo, hi) if affine.

  Block tilings (`free_block`) also share the free axis in blocks of rows.
  A stateful calibration's new state is written to the returned `box`.
  Returns (calibrate, axes, spans_rows, box).
  """
  n = cfg.numerics
  cal = cfg.calibration
  roles = ROLE_AXES[form]
  axes = tuple(sorted(roles[r] for r in cfg.tiling.shared))
  box = {}
  if n.asymmetric:
    if stateful.is_stateful(cal):
      raise ValueError(
        f'{path}.calibration: {type(cal).__name__} is stateful and gives a '
        f'symmetric bound; numerics {type(n).__name__} is asymmetric and '
        'needs a range; allowed: a stateless calibration.'
      )
    base = cal.calibrate_range
  else:

    def base(x, axes):
      bound, box['state'] = _bound(cal, x, axes, n, state, path)
      return bound

  free_axis = roles['free']
  rows = cfg.tiling.free_block(x_shape[free_axis])
  if rows is not None and free_axis not in axes:

    def calibrate(x, axes):
      return _blocked(base, x, axes, free_axis, rows)

    return calibrate, axes, True, box
  return base, axes, not cfg.tiling.shared <= FIBER_ROLES, box


def quantize_view(x4: jax.Array, cfg: TensorConfig, form: str, noise=None):
  """Quantizes a tiled view.

  The scale (and zero point) have `view_scale_shape`; the scale is NaN for
  the rows holding a NaN or inf (see the module docstring).

  Returns:
    (qvalue, scale, zero_point or None, grad_mask or None).
  """
  return quantize_view_stateful(x4, cfg, form, noise)[:4]


def quantize_view_stateful(
  x4: jax.Array,
  cfg: TensorConfig,
  form: str,
  noise=None,
  state: dict | None = None,
  path: str = 'operand',
):
  """`quantize_view` with calibration state (see `aqtr.core.stateful`).

  Returns:
    (qvalue, scale, zero_point or None, grad_mask or None, new_state or
    None, learned): learned is {name: d xhat / d param} in the view for
    learned calibrations, or None.
  """
  n = cfg.numerics
  cal = cfg.calibration
  x = x4.astype(jnp.float32)
  roles = ROLE_AXES[form]
  calibrate, axes, spans_rows, box = _calibrator(
    cfg, form, x.shape, state, path
  )
  if spans_rows:  # Groups span rows: bound the finite values, mark bad rows.
    finite = jnp.isfinite(x)
    bound = calibrate(jnp.where(finite, x, jnp.float32(0)), axes)
    flags = row_flags(finite, sorted(roles[r] for r in FIBER_ROLES))
  else:
    # Groups lie within rows: a non-finite bound (the calibration contract)
    # already marks the rows holding NaN/inf.
    bound = calibrate(x, axes)
    flags = None
  new_state = box.get('state')
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
  q = n.quantize(v, noise)
  mask = n.grad_mask(v)
  learned = None
  if new_state is not None and cal.has_learned:
    learned, mask = cal.value_grad(x, s, n, state)
  if mask is not None:  # Never zero the gradient of a non-finite value
    # or row; a finite x / s that overflows is clipped like any other.
    mask = mask | ~(jnp.isfinite(x) & jnp.isfinite(s))
  return q, s, z, mask, new_state, learned


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
  q, s, z, mask = quantize_view(x4, config, 'fk', noise)
  return QTensor(q, s, lay, 'fk', z), mask, keep


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
    st = jnp.where(mask, st, jnp.zeros_like(st))
  return xhat + st
