"""Scales from calibration bounds, over the whole float32 range.

Math. With `s = numerics.scale_from_bound(bound)` (by default
`bound / max_value`: 127 for int8, 448 for e4m3; MX: a power of two) a
group's stored scale is

  S = max(s * unit, 2^-126)       if 0 < bound < inf
  S = unit                        if bound == 0 (s = 1: an all-zero group)
  S = NaN                         if bound is NaN or inf

optionally rounded up to a power of two, `S <- 2^ceil(log2 S)`, and the
value handed to the numerics is `v = (x / S) * unit`. The scale never
underflows: a float32 scale below the smallest normal 2^-126 would be
flushed to 0 on XLA:CPU, so bounds below `step * 2^-126` (1.5e-36 for int8)
use the smallest normal scale and simply fill fewer grid points. Any bound
at or above that keeps the same relative error as a bound of 1.

Non-finite values. A NaN scale marks a row (the elements one output of the
dot sums over, its `fiber`: the view axes `tile` and `k`) that holds a NaN
or inf, so the dot's output `(q_L . q_R) * S_L * S_R` is NaN exactly in the
rows and columns `lax.dot_general` makes non-finite, whatever the numerics
(int8 cannot store NaN; the scale carries it). Scales therefore always keep
the batch and free axes: a tiling that shares them (per-tensor) computes one
bound from the finite values, and only the rows holding a non-finite value
get a NaN scale.

Example:
  >>> import jax.numpy as jnp
  >>> from aqtr.numerics import IntSymmetric
  >>> s = scale_from_bound(jnp.array([0.0, 1.0, 1e-37, jnp.nan]),
  ...                      IntSymmetric(bits=8))
  >>> (s * 127).tolist()[:2], bool(s[2] == TINY), bool(jnp.isnan(s[3]))
  ([127.0, 1.0], True, True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.core import prims
from aqtr.core.algorithms import Numerics

# The smallest normal float32: scales never go below it.
TINY = float(jnp.finfo(jnp.float32).tiny)
# The view axes of one row (fiber): its elements meet one output of the dot.
FIBER_ROLES = frozenset({'tile', 'k'})


def po2_ceil(s: jax.Array) -> jax.Array:
  """`2^ceil(log2 s)` for normal s > 0, exactly (no exp2 / log2 rounding).

  Example:
    >>> import jax.numpy as jnp
    >>> po2_ceil(jnp.array([0.3, 4.0, 5.0, TINY])) / jnp.array([1, 1, 1, TINY])
    Array([0.5, 4. , 8. , 1. ], dtype=float32)
  """
  m, e = jnp.frexp(s)  # s = m * 2^e, m in [0.5, 1).
  e = jnp.minimum(prims.where(m == 0.5, e - 1, e), 127)
  return jnp.ldexp(jnp.ones_like(s), e)


def scale_from_bound(
  bound: jax.Array, numerics: Numerics, po2: bool = False
) -> jax.Array:
  """The stored scale S per group (see the module docstring).

  Args:
    bound: the calibration bound per group, float32, >= 0 or non-finite.
    numerics: the numerics the group is rounded to.
    po2: round S up to a power of two.

  Returns:
    float32 S shaped like `bound`: normal and > 0, or NaN.
  """
  s = numerics.scale_from_bound(bound)
  # `bound / max_value * unit` with max_value >= 1 >= unit is finite
  # wherever the bound is: checking the bound alone is enough.
  default = type(numerics).scale_from_bound is Numerics.scale_from_bound
  bounded = default and numerics.max_value >= 1 >= numerics.unit
  return _robust(s, bound, numerics.unit, po2, check_s=not bounded)


def scale_from_range(
  lo: jax.Array, hi: jax.Array, numerics: Numerics, po2: bool = False
) -> jax.Array:
  """The stored scale S per group of affine numerics, from its (lo, hi).

  `S = numerics.scale_from_range(lo, hi) * unit`, kept normal like
  `scale_from_bound` (an empty range gives s = 1; NaN / inf give NaN).

  Args:
    lo: the calibrated minimum per group, float32.
    hi: the calibrated maximum per group, float32.
    numerics: affine numerics (`numerics.asymmetric`).
    po2: round S up to a power of two.

  Returns:
    float32 S shaped like `lo`: normal and > 0, or NaN.
  """
  s = numerics.scale_from_range(lo, hi)
  return _robust(s, hi - lo, numerics.unit, po2)


def _robust(s, bound, unit: float, po2: bool, check_s=True) -> jax.Array:
  """`s * unit` kept normal, 1 for an all-zero group, NaN if not finite.

  `check_s=False`: the caller knows s is finite wherever `bound` is.
  """
  s = s if unit == 1.0 else s * unit
  # A NaN that XLA:CPU's fast max may drop here comes from a non-finite
  # bound, which the last step turns back into NaN.
  s = lax.max(s, jnp.asarray(TINY, s.dtype))
  if po2:
    s = po2_ceil(s)
  s = prims.where(bound == 0, unit, s)
  if not check_s:  # bound - bound: 0 where finite, NaN elsewhere.
    return s + (bound - bound)
  ok = jnp.isfinite(bound) & jnp.isfinite(s)
  return prims.where(ok, s, float('nan'))


def requantizable(s: jax.Array, max_value: float) -> jax.Array:
  """S rounded up to `24 - bits(odd part of max_value)` significant bits.

  Then `max_value * S` is exact in float32, so re-calibrating the
  dequantized values of a group whose largest value sits at the top code,
  `bound = max_value * S`, gives back S bit for bit when float32 division
  by max_value is exact on its multiples (true of 127 on XLA:CPU; not
  always of 7 or 448, where S may come back one ulp off). S grows by less
  than 2^-(23 - bits) of itself (2^-16 for 127); a normal S stays normal,
  a power of two (1 for an all-zero group) stays, NaN stays NaN.
  Quantized training stores weights with such scales, so serving them
  equals the training forward (`aqtr.qt`).

  Args:
    s: float32 scales from `scale_from_bound`.
    max_value: the numerics' top grid value (127 for int8).

  Example:
    >>> import jax.numpy as jnp
    >>> s = requantizable(jnp.float32(0.3) / 127, 127.0)
    >>> bool((127 * s) / 127 == s), bool(s >= jnp.float32(0.3) / 127)
    (True, True)
  """
  odd = float(max_value).as_integer_ratio()[0]
  while odd and odd % 2 == 0:
    odd //= 2
  low = jnp.uint32((1 << odd.bit_length()) - 1)
  s = s.astype(jnp.float32)
  u = jax.lax.bitcast_convert_type(s, jnp.uint32)
  up = jax.lax.bitcast_convert_type((u + low) & ~low, jnp.float32)
  return jnp.where(jnp.isfinite(s), up, s)


def row_flags(marks: jax.Array, fiber_axes) -> jax.Array:
  """0 per row, NaN where the row holds a non-finite value (add to S).

  Args:
    marks: float32 `x - x` of the view x: +0 where x is finite, NaN where
      it is NaN or inf (one reduction reads x; no mask is written).
    fiber_axes: the view axes of one row.

  Returns:
    float32 per row (the fiber axes kept, size 1): +0, or the positive
    quiet NaN (`inf - inf` gives a negative one on x86; the flag's bits
    stay those of a NaN constant, as the output's NaNs).

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([[1.0, 2.0], [jnp.inf, 0.0]])
    >>> row_flags(x - x, (1,)).ravel().tolist()
    [0.0, nan]
  """
  f = jnp.sum(marks, axis=tuple(fiber_axes), keepdims=True)
  return prims.where(f == f, lax.full_like(f, 0.0), float('nan'))


def divide(x: jax.Array, s: jax.Array, unit: float) -> jax.Array:
  """`v = x / s` in grid units (`(x / S) * unit`); S is never subnormal."""
  v = x / s
  return v if unit == 1.0 else v * unit


def scale_shape(view_shape, shared, role_axes: dict) -> tuple[int, ...]:
  """The shape of a QTensor's scale for a tiled view.

  Size 1 along the shared fiber axes (`tile`, `k`), the view's size along
  every other axis (batch and free axes are kept even when a tiling shares
  them, so a row holding NaN/inf can be marked).

  Example:
    >>> from aqtr.core.qtensor import ROLE_AXES
    >>> scale_shape((2, 1, 5, 8), {'batch', 'tile', 'free', 'k'},
    ...             ROLE_AXES['fk'])
    (2, 1, 5, 1)
  """
  ones = {role_axes[r] for r in set(shared) & FIBER_ROLES}
  return tuple(1 if i in ones else d for i, d in enumerate(view_shape))
