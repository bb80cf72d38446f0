"""MSE-optimal clipping: search the bound that minimizes quantization error."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.calibrations.base import Calibration, nonfinite_guard, register

_TINY = float(jnp.finfo(jnp.float32).tiny)
# Up to this many elements x candidates, a round runs as one vectorized
# computation (fast to compile); above it, a loop over the candidates.
_VECTOR_LIMIT = 1 << 22


@register('mse')
@dataclasses.dataclass(frozen=True, kw_only=True)
class Mse(Calibration):
  """bound = argmin over a grid of clip ratios of sum_G (x - fq(x))^2.

  Math (Banner et al. 2019, arXiv 1810.05723; AQT's SNR search): with
  `m = max_G |x|` and candidate bounds `a = r * m`, each candidate is tried
  with the operand's own numerics, as the quantizer would apply it,
    s = a / qmax,   fq_a(x) = s * unit * numerics.quantize(x / s),
  and the bound with the least `sum_G (x - fq_a(x))^2` is kept (ties keep
  the larger bound). The ratios are searched in `rounds`: the first tries
  `r = k / steps`, k = 1..steps; each further round tries `steps + 1`
  points spanning one step of the previous round on either side of its
  best, so after 2 rounds the resolution is `2 / steps^2` of max|x|.
  For N(0, 1) and int symmetric (preserve_zero, preserve_max_val) the
  optimum is about 1.22 / 1.95 / 2.47 / 3.94 sigma at 2 / 3 / 4 / 8 bits.

  Cost: about `steps * rounds` quantize passes over the group (rounding
  to nearest; power-of-two scales are applied after the search), ~110x an
  absmax on XLA:CPU for groups of 1024 (benchmarks/catalogue.py). A round
  over a small tensor runs all candidates at once; over a large one
  (candidates x elements > 2^22) it loops over them to bound memory.
  `calibrate` alone (no numerics known, e.g. a freezer's statistic)
  returns max|x|, the search's upper end.

  Attributes:
    steps: candidates per round, int >= 2.
    rounds: search rounds, int >= 1.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from aqtr.numerics import IntSymmetric
    >>> x = jnp.array([[1.0] * 15 + [4.0]])  # ternary: best a = 19/16
    >>> n = IntSymmetric(bits=2)
    >>> bound = jax.jit(lambda x: Mse().bound_for(x, (1,), n))
    >>> bound(x).tolist()
    [[1.1875]]
  """

  steps: int = 32
  rounds: int = 2

  def __post_init__(self):
    super().__post_init__()
    for name, low in (('steps', 2), ('rounds', 1)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f'Mse.{name} must be an int >= {low}, got {v!r}.')

  def calibrate(self, x: jax.Array, axes: Sequence[int]) -> jax.Array:
    return jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True)

  def bound_for(self, x: jax.Array, axes: Sequence[int], numerics):
    axes = tuple(axes)
    m = self.calibrate(x, axes)
    if not numerics.quantizes:
      return m
    x32 = x.astype(jnp.float32)
    m32 = m.astype(jnp.float32)
    qmax = numerics.max_value
    unit = numerics.unit

    def errors(r):  # r: [c, *m.shape] candidate ratios -> [c, *m.shape]
      a = r * m32[None]
      s = jnp.where(a < qmax * _TINY, jnp.float32(1), a / qmax)
      fq = numerics.quantize(x32[None] / s).astype(jnp.float32) * (unit * s)
      d = x32[None] - fq
      return jnp.sum(d * d, axis=tuple(i + 1 for i in axes), keepdims=True)

    def pick(rs, best):
      """Best of the candidates `rs` and `best` (r, err): ties take larger r."""
      rs = jnp.broadcast_to(rs, (len(rs),) + m32.shape)
      if len(rs) * x32.size <= _VECTOR_LIMIT:  # All candidates at once.
        e = errors(rs)
        emin = jnp.min(e, axis=0)
        r = jnp.max(jnp.where(e == emin[None], rs, -1.0), axis=0)
        e = emin
        better = e < best[1]
        return jnp.where(better, r, best[0]), jnp.where(better, e, best[1])

      def body(k, carry):
        r = rs[k]
        e = errors(r[None])[0]
        better = e < carry[1]
        return jnp.where(better, r, carry[0]), jnp.where(better, e, carry[1])

      return lax.fori_loop(0, len(rs), body, best)

    def column(v):
      return v.reshape((len(v),) + (1,) * m32.ndim)

    n = self.steps
    best = (jnp.ones_like(m32), jnp.full_like(m32, jnp.inf))
    # First round r = k/n, k = n..1 (descending: ties keep the larger).
    best = pick(column(jnp.arange(n, 0, -1, dtype=jnp.float32) / n), best)
    h = 1.0 / n
    for _ in range(self.rounds - 1):
      d = 2 * h / n
      k = column(jnp.arange(n + 1, dtype=jnp.float32))
      best = pick(jnp.clip(best[0][None] + h - k * d, 0, 1), best)
      h = d
    return (best[0] * m32).astype(m.dtype) + nonfinite_guard(x, axes)
