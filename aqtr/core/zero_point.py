"""Zero points (affine numerics) in the canonical dot.

An affine operand stores `x ~ s (q - z)` with z constant along the
contraction within a tile (one z per scale group). The integer dot stays
an integer dot; the zero points add correction terms per tile of t
elements:

  sum_k (q_a - z_a)(q_b - z_b)
    = q_a . q_b - z_a sum_k q_b - z_b sum_k q_a + t z_a z_b

computed exactly in int32. In a float dot the zero point is subtracted
before the dot. A backward pass that reuses a forward operand with a zero
point contracts that operand's free axis, along which z varies:
`(g s) . (q - z) = (g s) . q - (g s) . z`, whose second term (a
matrix-vector product in float) is `reuse_term`.

Internal API (used by `passes.py`, `backward.py` and `geometry.py`):
`as_int8`, `per_row`, `int_corrections`, `subtract_rows`, `reuse_term`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_int8(values: jax.Array, zero_point: jax.Array | None):
  """uint8 values as int8 `q - 128`, the zero point shifted alike.

  `q - z` is unchanged, so the int8 x int8 dot serves uint8 storage.
  Other dtypes (or no zero point) are returned as they are.
  """
  if zero_point is None or values.dtype != jnp.uint8:
    return values, zero_point
  shifted = (values.astype(jnp.int16) - 128).astype(jnp.int8)
  return shifted, zero_point - 128


def per_row(z: jax.Array, shape4: tuple[int, ...], form: str) -> jax.Array:
  """A view-shaped zero point as [B*T, F] (one value per free index).

  Args:
    z: broadcastable to the view [B, T, F, t] ('fk') / [B, T, t, F] ('kf'),
      constant along t.
    shape4: the view's shape.
    form: 'fk' or 'kf'.
  """
  bsz, n = shape4[:2]
  f = shape4[2] if form == 'fk' else shape4[3]
  z = z[..., 0] if form == 'fk' else z[:, :, 0, :]
  return jnp.broadcast_to(z, (bsz, n, f)).reshape(bsz * n, f)


def int_corrections(
  out: jax.Array,
  qa: jax.Array,
  qb: jax.Array,
  za: jax.Array | None,
  zb: jax.Array | None,
  b_contract: int,
) -> jax.Array:
  """The int32 dot `out` [BT, Fa, Fb] of (q_a - z_a) and (q_b - z_b).

  Args:
    out: q_a . q_b in int32, [BT, Fa, Fb].
    qa: [BT, Fa, t] int8.
    qb: [BT, Fb, t] (b_contract 2) or [BT, t, Fb] (b_contract 1) int8.
    za, zb: zero points per row, [BT, Fa] / [BT, Fb] (integer-valued
      float32), or None.
    b_contract: the contracted axis of qb.
  """
  t = qa.shape[2]
  za_i = None if za is None else za.astype(jnp.int32)[:, :, None]
  zb_i = None if zb is None else zb.astype(jnp.int32)[:, None, :]
  if za_i is not None:
    out = out - za_i * jnp.sum(qb, axis=b_contract, dtype=jnp.int32)[:, None]
  if zb_i is not None:
    out = out - zb_i * jnp.sum(qa, axis=2, dtype=jnp.int32)[:, :, None]
  if za_i is not None and zb_i is not None:
    out = out + t * za_i * zb_i
  return out


def subtract_rows(qa, qb, za, zb, b_contract: int):
  """(q_a - z_a, q_b - z_b) of float operands shaped as `int_corrections`'s
  (a zero point None leaves its operand as it is)."""
  if za is not None:
    qa = qa - za[:, :, None].astype(qa.dtype)
  if zb is not None:
    zz = zb[:, :, None] if b_contract == 2 else zb[:, None, :]
    qb = qb - zz.astype(qb.dtype)
  return qa, qb


def reuse_term(g_s: jax.Array, z: jax.Array, axis: int, form: str):
  """`(g s) . z` summed over g_s's `axis` (the reused operand's free axis).

  Args:
    g_s: the cotangent with the forward scale folded in, [BT, ., .].
    z: the reused operand's zero point per row, [BT, F].
    axis: 1 or 2, the axis of g_s that holds F.
    form: the backward dot's output form: 'fk' [BT, F_x, t] or 'kf'
      [BT, t, F_x].

  Returns:
    The term to subtract from the backward dot's output, broadcastable to
    it (size 1 along t).
  """
  zz = z[:, None, :] if axis == 2 else z[:, :, None]
  term = jnp.sum(g_s * zz, axis=axis)  # [BT, F_x]
  return term[:, :, None] if form == 'fk' else term[:, None, :]
