"""Static ranges: freeze an operand's calibration bound, not its values."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from aqtr.freezers.base import Freezer, Mode, Served, register


@register('calibration')
@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrationFreezer(Freezer):
  """Static-range quantization: the bound is calibrated once, then frozen.

  Math. In CALIBRATE each call t computes the operand's own calibration
  (e.g. AbsMax) over the static group G: the whole tensor, or with
  `per_channel` each index of the operand's free axes (reduced over its
  batch and contraction axes). It keeps the running mean

    m_T = (1/T) sum_{t<=T} bound_t(x_t),   count = T,

  i.e. the mean of absmax for AbsMax (the static ranges of Jacob et al.,
  2017, arXiv:1712.05877, averaged instead of exponentially smoothed).
  CONVERT freezes `bound = m_T`; SERVE quantizes with it and does not look
  at the data's range again: with `b` constant along the contraction axes,

    dot(x, y) ~ b * dot(x / b, y)  with the operand's calibration = Constant(1)

  which is exact by linearity and keeps gradients correct; values beyond
  `b` are clipped. TRAIN quantizes on the fly (dynamic ranges).

  Use `per_channel` only for operands whose free axes have a fixed size
  (weights); activations' free axes are batch and sequence axes.

  The bound is symmetric: affine numerics (`int_asymmetric`) are refused
  (freeze affine weights with 'weights'). A CALIBRATE call whose
  statistic is not finite (a NaN/inf in the batch) is left out of the mean
  and not counted, so one bad batch cannot freeze a NaN bound (which SERVE
  would propagate, not replace).

  Attributes:
    per_channel: one bound per free-axes index instead of one per tensor.

  Example:
    >>> import jax.numpy as jnp
    >>> from aqtr.calibrations import AbsMax
    >>> f = CalibrationFreezer()
    >>> s = f.init_stats(())
    >>> s = f.update_stats(s, f.statistic(jnp.ones((1, 2, 3)), AbsMax()))
    >>> float(s['mean']), int(s['count'])
    (1.0, 1)
  """

  per_channel: bool = False

  frozen_parts = ('bound',)
  collects = True

  def __post_init__(self):
    if not isinstance(self.per_channel, bool):
      raise TypeError(
        'CalibrationFreezer.per_channel must be a bool, got '
        f'{self.per_channel!r}.'
      )

  def stores(self, mode: Mode) -> tuple[str, ...]:
    if not isinstance(mode, Mode):
      raise TypeError(f'mode must be an aqtr.freezers.Mode, got {mode!r}.')
    return self.frozen_parts if mode is Mode.CONVERT else ()

  def statistic(self, x3: jax.Array, calibration) -> jax.Array:
    """This call's bound over the static groups.

    Args:
      x3: the operand in canonical [B, F, K] layout (batch, free, contract).
      calibration: the operand's Calibration.

    Returns:
      float32 [F] with `per_channel`, else a scalar.
    """
    x = jax.lax.stop_gradient(x3).astype(jnp.float32)
    axes = (0, 2) if self.per_channel else (0, 1, 2)
    b = calibration.calibrate(x, axes).astype(jnp.float32)
    return b.reshape(x.shape[1]) if self.per_channel else b.reshape(())

  def stats_shape(self, free_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the kept statistic for an operand's free axes."""
    return tuple(free_shape) if self.per_channel else ()

  def init_stats(self, shape: tuple[int, ...]) -> dict:
    """Statistics before any CALIBRATE call: mean 0, count 0."""
    return {
      'mean': jnp.zeros(shape, jnp.float32),
      'count': jnp.zeros((), jnp.int32),
    }

  def update_stats(self, stats: dict, value: jax.Array) -> dict:
    """One CALIBRATE call: `mean += (value - mean) / (count + 1)`; a
    non-finite `value` leaves the statistics unchanged."""
    value = value.reshape(stats['mean'].shape)
    ok = jnp.all(jnp.isfinite(value))
    count = stats['count'] + ok.astype(stats['count'].dtype)
    step = jnp.where(ok, value - stats['mean'], 0)
    mean = stats['mean'] + step / jnp.maximum(count, 1).astype(jnp.float32)
    return {'mean': mean, 'count': count}

  def frozen(self, stats: dict) -> dict:
    """The values CONVERT stores: `{'bound': mean}`."""
    return {'bound': stats['mean']}

  # The life cycle (see aqtr.freezers.base.Freezer).

  def _symmetric(self, call) -> None:
    n = call.tensor.numerics
    if getattr(n, 'asymmetric', False):
      raise call.error(
        f'config.fwd.{call.side}.freezer is CalibrationFreezer, which '
        f'freezes a symmetric bound, but config.fwd.{call.side}.numerics '
        f'is affine ({type(n).__name__}); use symmetric numerics, or the '
        "'weights' freezer for affine weights."
      )

  def start_stats(self, call) -> dict:
    self._symmetric(call)
    return self.init_stats(self.stats_shape(call.free_shape))

  def collect(self, stats: dict, call) -> dict:
    self._symmetric(call)
    value = self.statistic(call.canonical(), call.tensor.calibration)
    return self.update_stats(stats, value)

  def freeze(self, call, stats: dict | None) -> dict:
    self._symmetric(call)
    if stats is None or _never_updated(stats['count']):
      raise call.error(
        f'CONVERT freezes the static range of the {call.side} operand from '
        'its CALIBRATE statistics, but none were collected.',
        needs='stats',
      )
    return self.frozen(stats)

  def serve(self, call, frozen: dict) -> Served:
    """`b * dot(x / b, ..)` with the operand's range fixed to 1."""
    self._symmetric(call)
    b = jnp.asarray(frozen['bound'], jnp.float32)
    shape = self.stats_shape(call.free_shape)
    if b.shape != shape:
      raise call.error(
        f'the frozen {call.side} bound has shape {b.shape}, this call needs '
        f"{shape} (the operand's free axes with per_channel)."
      )
    # An all-zero range serves with 1; a NaN bound propagates.
    b = jnp.where((b > 0) | jnp.isnan(b), b, jnp.ones_like(b))
    return Served(
      call.x / call.over_free(b), tensor=call.with_range(1.0), out_scale=b
    )


def _never_updated(count) -> bool:
  """True when `count` is known (not traced) to be 0."""
  try:
    return int(count) == 0
  except (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
  ):
    return False
