"""One tensor: calibrate -> scale -> numerics -> QTensor; and fake quant.

Math: for each scale group G (the view axes the tiling shares)
`bound = calibration(x_G)`, `s = bound / numerics.max_value` (a bound of 0,
or one too small to divide by, gives s = 1), optionally
`s <- 2^ceil(log2 s)`; `q = numerics.quantize(x / s (+ noise))`. The stored
scale is `s * numerics.unit`. Quantization is computed in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.core import stateful
from aqtr.core.config import TensorConfig
from aqtr.core.dimension_numbers import OperandLayout, normalize_axes
from aqtr.core.qtensor import ROLE_AXES, QTensor, from_view, to_view
from aqtr.core.rounding import as_typed_key

_TINY = float(jnp.finfo(jnp.float32).tiny)


def quantize_view(x4: jax.Array, cfg: TensorConfig, form: str, noise=None):
  """Quantizes a tiled view; returns (qvalue, scale, grad_mask or None)."""
  return quantize_view_stateful(x4, cfg, form, noise)[:3]


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
    (qvalue, scale, grad_mask or None, new_state or None, learned): learned
    is {name: d xhat / d param} in the view for learned calibrations, or
    None.
  """
  n = cfg.numerics
  x = x4.astype(jnp.float32)
  axes = tuple(sorted(ROLE_AXES[form][r] for r in cfg.tiling.shared))
  cal = cfg.calibration
  new_state = learned = None
  if not stateful.is_stateful(cal):
    bound = cal.bound_for(x, axes, n)
  elif state is None and stateful.record(path, x, axes):
    bound = cal.calibrate(x, axes)
  else:
    bound, new_state = stateful.site_bound(cal, x, axes, n, state, path)
  bound = bound.astype(jnp.float32)
  qmax = n.max_value
  s = jnp.where(bound < qmax * _TINY, jnp.float32(1), bound / qmax)
  if cal.po2_scale:
    s = jnp.exp2(jnp.ceil(jnp.log2(s)))
  v = x / s
  q = n.quantize(v, noise)
  scale = s if n.unit == 1.0 else s * n.unit
  mask = n.grad_mask(v)
  if new_state is not None and cal.has_learned:
    learned, mask = cal.value_grad(x, s, n, state)
  return q, scale, mask, new_state, learned


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
  tile = config.tiling.tile(lay.k)
  noise = None
  if config.rounding.stochastic:
    n = config.rounding.noise(as_typed_key(key), lay.shape)
    noise = to_view(lay.to_canonical(n, 'fk'), 'fk', tile)
  x4 = to_view(lay.to_canonical(jnp.asarray(x), 'fk'), 'fk', tile)
  if not config.quantized:
    return QTensor(x4, None, lay, 'fk'), None
  q, s, mask = quantize_view(x4, config, 'fk', noise)
  return QTensor(q, s, lay, 'fk'), mask


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
  per index of the other axes).

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

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> x = jnp.array([[0.25, -1.0]])
    >>> bool((aqtr.fake_quant(x) == aqtr.quantize(x).dequant()).all())
    True
  """
  config = config or TensorConfig()
  xs = jax.lax.stop_gradient(x)
  qt, mask4 = _quantize(xs, config, contracting_axes, batch_axes, key)
  xhat = qt.dequant(jnp.result_type(x))
  st = x - xs
  if mask4 is not None:
    mask = qt.layout.from_canonical(from_view(mask4, 'fk'), 'fk')
    st = jnp.where(mask, st, jnp.zeros_like(st))
  return xhat + st
