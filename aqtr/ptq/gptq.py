"""GPTQ: column-by-column quantization with Cholesky error compensation.

Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", arXiv 2210.17323. For a weight
`W [d_in, d_out]` whose input has second moment `H = 2 X^T X / n`, the
rows of W (one per input channel) are quantized in order; after row i
the error `e = (w_i - q_i) / U_ii` is spread over the rows still to come,
`w_j -= e U_ij` (j > i), where U is the upper Cholesky factor of H^-1
(OBS's optimal update, eq. 3 of the paper, in Cholesky form). Rows are
processed in lazy blocks of `block_size`: within a block the update is
rank-1 per row; the rows after the block get the block's errors at once
(`W -= E U[block, :]`). Dead inputs (H_ii = 0) get their weight row
zeroed and H_ii = 1; `percdamp * mean(diag H)` is added to the diagonal.
With act-order the rows are processed by decreasing H_ii and the result
is permuted back, so serving needs no permutation.

The quantization step is the rule's own grid (`aqtr.ptq.grid.Grid`):
scales (and zero points) come from the engine's quantization of the
ORIGINAL weight with the rule's calibration and tiling, and each row is
rounded to that fixed grid by the numerics' own `quantize`. This is the
choice for grouped and block formats (int g128, MXFP4's E8M0 block-32
scales, NVFP4's e4m3 x f32 block-16 two-level scales): the scales are
exactly the ones round-to-nearest CONVERT stores (so NVFP4 keeps one
tensor scale and exact e4m3 block scales), and GPTQ moves only the
rounding of each element. The paper instead recomputes a group's scale
from the error-updated weights when the group is reached; with static
scales the solver stays format-agnostic (a registered numerics or tiling
works unchanged) and act-order needs no group index at serving time.

Cost: O(d_out d_in^2) flops, O(d_in^2 + d_in d_out) memory per layer; one
jitted program per weight shape.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from aqtr.numerics.int_symmetric import IntSymmetric
  >>> w = jax.random.normal(jax.random.key(0), (8, 3))
  >>> s, z, n = jnp.full((8, 3), 0.5), jnp.zeros((8, 3)), IntSymmetric(bits=4)
  >>> sol = solve(w, jnp.eye(8), s, z, n)  # H = I: round to nearest
  >>> bool((sol.wq == quantize_fixed(n, w, s, z)[1]).all())
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from aqtr.ptq.grid import quantize_fixed


def prepare(
  w2: jax.Array, h: jax.Array, percdamp: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(w2 with dead rows zeroed, damped H, dead mask)."""
  d = jnp.diag(h)
  dead = d == 0
  h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
  w2 = jnp.where(dead[:, None], 0.0, w2)
  damp = percdamp * jnp.mean(jnp.diag(h))
  return w2, h + damp * jnp.eye(h.shape[0], dtype=h.dtype), dead


def inverse_cholesky(h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(U upper triangular with H^-1 = U^T U, whether H is well conditioned).

  H counts as singular when a Cholesky pivot falls below 1e-6 of the
  mean diagonal (float32 roundoff), or the factors are not finite.
  """
  lower = jnp.linalg.cholesky(h)
  eye = jnp.eye(h.shape[0], dtype=h.dtype)
  hinv = jax.scipy.linalg.cho_solve((lower, True), eye)
  hinv = 0.5 * (hinv + hinv.T)
  u = jnp.linalg.cholesky(hinv).T
  pivots = jnp.diag(lower) ** 2
  ok = (jnp.min(pivots) > 1e-6 * jnp.mean(jnp.diag(h))) & jnp.all(
    jnp.isfinite(u)
  )
  return u, ok


class Solution(NamedTuple):
  """A solved weight: q-values, dequantized, and its grid, all [d_in,
  d_out] (the grid is the given one unless groups are dynamic)."""

  q: jax.Array
  wq: jax.Array
  scale: jax.Array
  zero: jax.Array


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8, 9))
def _solve(
  w2, h, scale, zero, numerics, block_size, act_order, percdamp, group, regroup
):
  n_in, n_out = w2.shape
  w2 = w2.astype(jnp.float32)
  h = h.astype(jnp.float32)
  w2, h, _ = prepare(w2, h, percdamp)
  perm = jnp.arange(n_in)
  if act_order:
    perm = jnp.argsort(-jnp.diag(h), stable=True)
    w2, h = w2[perm], h[perm][:, perm]
  u, ok = inverse_cholesky(h)
  bs = min(block_size, n_in)
  if group:  # Whole groups in a block.
    bs = max(group, bs - bs % group)
  pad = -n_in % bs
  total = n_in + pad
  w = jnp.pad(w2, ((0, pad), (0, 0)))
  scale = jnp.pad(scale, ((0, pad), (0, 0)), constant_values=1.0)
  zero = jnp.pad(zero, ((0, pad), (0, 0)))
  u = jnp.pad(u, ((0, pad), (0, pad))) + jnp.diag(
    jnp.concatenate([jnp.zeros(n_in), jnp.ones(pad)])
  )
  rows = jnp.concatenate([perm, jnp.zeros(pad, perm.dtype)])
  real = jnp.arange(total) < n_in
  idx = jnp.arange(bs)

  def block(b, carry):
    w, q, wq, scale, zero = carry
    i1 = b * bs
    w1 = lax.dynamic_slice_in_dim(w, i1, bs, 0)
    u1 = lax.dynamic_slice(u, (i1, i1), (bs, bs))
    r1 = lax.dynamic_slice_in_dim(rows, i1, bs, 0)
    ok1 = lax.dynamic_slice_in_dim(real, i1, bs, 0)

    def row(j, c):
      w1, q1, wq1, e1, scale, zero = c
      if group:  # The group's grid from its error-updated rows.

        def fresh(sz):
          s_new, z_new = regroup(lax.dynamic_slice_in_dim(w1, j, group, 0))
          return tuple(
            lax.dynamic_update_slice_in_dim(
              a, jnp.broadcast_to(v[None], (group, n_out)), i1 + j, 0
            )
            for a, v in zip(sz, (s_new, z_new), strict=True)
          )

        scale, zero = lax.cond(
          j % group == 0, fresh, lambda sz: sz, (scale, zero)
        )
      wj = w1[j]
      qj, dqj = quantize_fixed(numerics, wj, scale[r1[j]], zero[r1[j]])
      qj, dqj = qj * ok1[j], dqj * ok1[j]
      err = (wj - dqj) / u1[j, j]
      w1 = w1 - jnp.where(idx[:, None] > j, u1[j][:, None] * err[None], 0.0)
      return (
        w1,
        q1.at[j].set(qj),
        wq1.at[j].set(dqj),
        e1.at[j].set(err),
        scale,
        zero,
      )

    zeros = jnp.zeros_like(w1)
    _, q1, wq1, e1, scale, zero = lax.fori_loop(
      0, bs, row, (w1, zeros, zeros, zeros, scale, zero)
    )
    later = (jnp.arange(total) >= i1 + bs)[:, None]
    ub = lax.dynamic_slice_in_dim(u, i1, bs, 0)
    hp = lax.Precision.HIGHEST
    w = w - jnp.where(later, jnp.matmul(ub.T, e1, precision=hp), 0.0)
    q = lax.dynamic_update_slice_in_dim(q, q1, i1, 0)
    wq = lax.dynamic_update_slice_in_dim(wq, wq1, i1, 0)
    return w, q, wq, scale, zero

  zeros = jnp.zeros_like(w)
  _, q, wq, scale, zero = lax.fori_loop(
    0, total // bs, block, (w, zeros, zeros, scale, zero)
  )
  scale, zero = scale[:n_in], zero[:n_in]
  q, wq = q[:n_in], wq[:n_in]
  if act_order:
    inv = jnp.argsort(perm)
    q, wq = q[inv], wq[inv]
  return Solution(q, wq, scale, zero), ok


def solve(
  w2: jax.Array,
  h: jax.Array,
  scale: jax.Array,
  zero: jax.Array,
  numerics,
  *,
  block_size: int = 128,
  act_order: bool = False,
  percdamp: float = 0.01,
  group: int = 0,
  regroup: Callable | None = None,
) -> Solution:
  """GPTQ of one weight matrix on a fixed (or per-group refreshed) grid.

  Args:
    w2: the weight as [d_in, d_out].
    h: [d_in, d_in] the input's second moment (`LayerStats.hessian`; any
      positive multiple gives the same result).
    scale, zero: the grid, per element [d_in, d_out] (zero: the zero
      point, 0 for symmetric numerics): `aqtr.ptq.grid.Grid`'s.
    numerics: the numerics rounding to the grid (`quantize_fixed`).
    block_size: rows per lazy block (the paper's B = 128; with groups,
      rounded down to whole groups).
    act_order: process inputs by decreasing H_ii (the result is in the
      original order).
    percdamp: dampening, a fraction of mean(diag H) added to the diagonal.
    group: 0: the grid is fixed. > 0: when row i with i % group == 0 is
      reached, rows i..i+group-1 get the grid `regroup(rows [group,
      d_out]) -> (scale [d_out], zero [d_out])` of their error-updated
      values (the paper's groups; no act_order).
    regroup: see `group` (hashable: a static argument).

  Returns:
    A `Solution`.

  Raises:
    ValueError: H is singular after dampening (see `inverse_cholesky`),
      or a bad `group`.
  """
  if w2.ndim != 2 or h.shape != (w2.shape[0],) * 2:
    raise ValueError(
      f'gptq.solve: w2 must be [d_in, d_out] and h [d_in, d_in], got '
      f'{w2.shape} and {h.shape}.'
    )
  if group and (act_order or regroup is None or w2.shape[0] % group):
    raise ValueError(
      f'gptq.solve: group={group} needs regroup, no act_order and a group '
      f'dividing d_in={w2.shape[0]}.'
    )
  sol, ok = _solve(
    w2,
    h,
    scale,
    zero,
    numerics,
    int(block_size),
    bool(act_order),
    float(percdamp),
    int(group),
    regroup,
  )
  if not bool(ok):
    raise ValueError(
      f'gptq.solve: H is singular after dampening (percdamp={percdamp}); '
      'raise percdamp or give more calibration tokens.'
    )
  return sol


__all__ = ['Solution', 'inverse_cholesky', 'prepare', 'solve']
