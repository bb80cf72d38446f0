"""A fusion boundary that XLA keeps, for serve == train bit for bit.

Training and serving are two programs: training computes a weight's codes
and scales from the float weight, serving loads them. Each op serves what
it trains, but XLA fuses each whole program on its own. Where training
fuses the scale computation into the rescale after the dot and serving
reads the stored scale, the two fusions differ, and LLVM contracts a
different multiply and the add after it into one fused multiply-add
(XLA's default, `-ffp-contract=fast`): 1-3 units in the last place apart
(NVFP4 tile sums, int8 / fp8 rescales of real Hugging Face LMs).

`fusion_boundary` writes arrays to buffers of their own that no fusion
reaches across. The forward puts each quantized operand's scales behind
one in both programs, so everything after it is the same code on the same
arrays: XLA fuses it alike, and the outputs are equal bit for bit.

Internal API (for `forward.py`, `aqtr.flax.serving` and
`aqtr.pax.kv_cache`): `fusion_boundary`, `fusion_fenced`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import get_abstract_mesh


def fusion_fenced() -> bool:
  """Whether `fusion_boundary` fences fusion on the default backend.

  True on CPU outside a mesh context (a while loop, measured: serve ==
  train bit for bit on real models under XLA's default flags). Elsewhere
  it is an `optimization_barrier`, which XLA may drop before fusion (not
  measured): under a mesh the loop's trip count, read from a sharded
  scale, would cost a collective per dot.

  Example:
    >>> fusion_fenced()  # On the CPU backend.
    True
  """
  return jax.default_backend() == 'cpu' and get_abstract_mesh().empty


def _trips(first: jax.Array) -> jax.Array:
  """1 from a value XLA cannot fold (0 for a NaN; the loop is the
  identity, so either count gives the same outputs)."""
  if jnp.issubdtype(first.dtype, jnp.floating):
    return (first == first).astype(jnp.int32)
  return jnp.minimum(1, jnp.abs(first.astype(jnp.int32)) + 1)


def fusion_boundary(tree):
  """`tree`'s arrays as buffers of their own that no fusion reaches across.

  Where `fusion_fenced`, a one-trip while loop whose trip count XLA
  cannot fold (XLA:CPU drops `optimization_barrier`s before fusion, but
  keeps a loop); elsewhere an `optimization_barrier`. The values are
  unchanged.

  Args:
    tree: a pytree of arrays (None leaves allowed).

  Returns:
    The same tree, same values.

  Example:
    >>> s = jnp.array([0.5, 2.0])
    >>> fusion_boundary((s, None))[0].tolist()
    [0.5, 2.0]
  """
  leaves = [x for x in jax.tree.leaves(tree) if x.size]
  if not leaves:
    return tree
  if not fusion_fenced():
    return lax.optimization_barrier(tree)
  trips = _trips(leaves[0].reshape(-1)[0])

  def body(carry):
    i, t = carry
    # The barrier keeps `t` a loop output (JAX hoists an unchanged carry
    # out of the loop, and XLA would then fuse across it again).
    return i + 1, lax.optimization_barrier(t)

  return lax.while_loop(lambda c: c[0] < trips, body, (0, tree))[1]
