"""Elementwise helpers on lax primitives, for the quantizer's hot path.

`jnp.where`, `jnp.clip` and `jnp.round` each trace as a nested `jit`
(a function of its own in the lowered module, inlined again by XLA): a
quantized dot's forward and backward trace about thirty of them, a
measurable share of its compile time. These trace to the same primitives
inline (`where` -> select_n, `clip` -> clamp,
`round_even` -> round to nearest even as `jnp.round`): same values, fewer
ops to compile.

`per_platform` traces a CPU and a GPU form of one computation and keeps,
when lowered, the one of the target platform (see `aqtr.core.lowering`).

It also holds the contractions the engine calls (`dot_general`,
`ragged_dot`, `conv_general_dilated`, `einsum`), captured at import so
that stock-model interception never catches the engine's own calls.

Example:
  >>> import jax.numpy as jnp
  >>> clip(round_even(jnp.array([0.5, 1.5, 300.0])), -127.0, 127.0).tolist()
  [0.0, 2.0, 127.0]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The contractions the engine runs, captured when aqtr is imported: stock
# model interception (`aqtr.flax.intercept`) patches the public names
# `jax.lax.dot_general`, `jnp.einsum`, ... while a quantized model runs,
# and the engine's own calls (its forward, and its backward traced later)
# must never be taken for the model's. Engine code calls these.
dot_general = lax.dot_general
ragged_dot = lax.ragged_dot
conv_general_dilated = lax.conv_general_dilated
einsum = jnp.einsum


def per_platform(*args, cpu, gpu):
  """`cpu(*args)` where lowered for CPU, `gpu(*args)` elsewhere.

  Both are traced; each must return the same shapes and dtypes.

  Example:
    >>> per_platform(jnp.ones(2), cpu=lambda x: x + 1, gpu=lambda x: x - 1)
    Array([2., 2.], dtype=float32)
  """
  return lax.platform_dependent(*args, cpu=cpu, default=gpu)


def negative(v: jax.Array) -> jax.Array:
  """Whether each float of `v` has its sign bit set (-0.0 too; NaN: False).

  By comparisons (`1 / -0.0 = -inf`), not by bit casts: XLA:CPU's
  constant folding got `jnp.signbit`'s cast wrong on transposed views of
  closed-over arrays (jax 0.10.2), and the quantized codes with it.

  Example:
    >>> negative(jnp.array([-1.0, -0.0, 0.0, 2.0])).tolist()
    [True, True, False, False]
  """
  zero = v == 0
  return (v < 0) | (zero & (1 / jnp.where(zero, v, 1) < 0))


# The float dtypes `abs_max_bits` reads: IEEE floats of 16 or 32 bits (inf
# is the top exponent with a zero mantissa), as integers of their width,
# and whether XLA:CPU flushes their subnormals to zero (float32's and
# bfloat16's are float32 subnormals; a float16 one is normal in float32).
_BITS = {
  jnp.dtype(jnp.float32): (jnp.int32, True),
  jnp.dtype(jnp.bfloat16): (jnp.int16, True),
  jnp.dtype(jnp.float16): (jnp.int16, False),
}


def abs_max_bits(x: jax.Array, axes) -> jax.Array | None:
  """XLA:CPU's `max |x|` over `axes` (kept, size 1), inf where a group
  holds NaN, by one integer max over the bits; None for another dtype.

  For non-negative floats the order of the bit patterns read as integers
  is the order of the values, and every NaN's magnitude bits lie above
  inf's, which lie above every finite value's: the max of `bits(x) &
  0x7fff...` is the bits of `max |x|` for a finite group, of inf for a
  group holding inf, and above inf's for a group holding NaN (clamped to
  inf's). Unlike a float max, an integer max cannot skip a NaN (XLA:CPU's
  library max does), so one reduction holds both the bound and the flag.
  A subnormal max of a float32 or bfloat16 group is +0, as XLA:CPU's
  float max gives it (it flushes subnormals to zero). The derivative is
  `jnp.max(jnp.abs(x))`'s where the max is finite, else 0 (the float
  form's). The reduction runs in steps (`max_in_steps`).

  Args:
    x: a float32, bfloat16 or float16 array.
    axes: the axes reduced.

  Returns:
    The max in x's dtype, or None where x has another dtype.

  Example:
    >>> x = jnp.array([[1.0, -4.0], [jnp.nan, 2.0], [-jnp.inf, 0.0]])
    >>> abs_max_bits(x, (1,)).ravel().tolist()
    [4.0, inf, inf]
  """
  if jnp.dtype(x.dtype) not in _BITS:
    return None
  return _abs_max_bits(x, tuple(sorted(a % x.ndim for a in axes)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _abs_max_bits(x, axes):
  ints, flush = _BITS[jnp.dtype(x.dtype)]
  dt = x.dtype

  def bits(v):
    return lax.bitcast_convert_type(jnp.asarray(v, dt), ints)

  mag = lax.bitcast_convert_type(x, ints) & jnp.iinfo(ints).max
  top = jnp.minimum(max_in_steps(mag, axes), bits(jnp.inf))
  if flush:
    top = where(top < bits(jnp.finfo(dt).tiny), 0, top)
  return lax.bitcast_convert_type(top, dt)


@_abs_max_bits.defjvp
def _abs_max_bits_jvp(axes, primals, tangents):
  (x,), (t,) = primals, tangents
  out = _abs_max_bits(x, axes)
  _, dt = jax.jvp(
    lambda v: jnp.max(jnp.abs(v), axes, keepdims=True), (x,), (t,)
  )
  return out, where(jnp.isfinite(out), dt, 0.0)


# XLA:CPU rewrites a reduction along an axis longer than this into a
# reduce-window and a reduce: two kernels, neither fused with a producer.
STEP = 32


def max_in_steps(v: jax.Array, axes) -> jax.Array:
  """`jnp.max(v, axes, keepdims=True)` of non-negative integers in steps
  of `STEP` along each reduced axis, each step behind an optimization
  barrier.

  Without the barriers XLA:CPU merges the steps back into one reduction
  and splits it into its reduce-window and reduce kernels (with a third
  for the producer of `v`); with them it fuses the steps and their
  producer into one kernel. An axis longer than `STEP` is zero-padded to
  a multiple of it (0 is no larger than any `v`). An axis sharded under
  explicit axis types is reduced in one step (its reshape could need a
  collective).

  Example:
    >>> v = jnp.arange(100).reshape(2, 50)
    >>> max_in_steps(v, (1,)).ravel().tolist()
    [49, 99]
  """
  spec = getattr(jax.typeof(v).sharding, 'spec', ())
  sharded = {i for i, s in enumerate(spec) if s is not None}
  for a in axes:
    while v.shape[a] > STEP and a not in sharded:
      n = -(-v.shape[a] // STEP)
      if n * STEP != v.shape[a]:
        pad = [(0, 0, 0)] * v.ndim
        pad[a] = (0, n * STEP - v.shape[a], 0)
        v = lax.pad(v, jnp.zeros((), v.dtype), pad)
      v = v.reshape(v.shape[:a] + (n, STEP) + v.shape[a + 1 :])
      v = lax.optimization_barrier(jnp.max(v, axis=a + 1))
  return jnp.max(v, axis=tuple(axes), keepdims=True)


def where(condition: jax.Array, x, y) -> jax.Array:
  """`jnp.where(condition, x, y)` for same-shaped arrays, either of x, y
  possibly a Python scalar (made like the other, sharding included).
  Other shapes go to `jnp.where`."""
  arrays = [a for a in (x, y) if isinstance(a, jax.Array | np.ndarray)]
  if not arrays or any(a.shape != jnp.shape(condition) for a in arrays):
    return jnp.where(condition, x, y)
  like = arrays[0]
  x = x if isinstance(x, jax.Array | np.ndarray) else lax.full_like(like, x)
  y = y if isinstance(y, jax.Array | np.ndarray) else lax.full_like(like, y)
  if x.dtype != y.dtype:
    return jnp.where(condition, x, y)
  return lax.select(condition, x, y)


def clip(x: jax.Array, lo: float, hi: float) -> jax.Array:
  """`jnp.clip(x, lo, hi)` for scalar bounds (one clamp; NaN stays NaN)."""
  return lax.clamp(jnp.asarray(lo, x.dtype), x, jnp.asarray(hi, x.dtype))


def round_even(x: jax.Array) -> jax.Array:
  """`jnp.round(x)`: to the nearest integer, ties to even."""
  return lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)


__all__ = ['abs_max_bits', 'clip', 'max_in_steps', 'round_even', 'where']
