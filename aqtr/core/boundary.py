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
reaches across (lowered for CPU, a one-trip while loop, or in training a
conditional XLA cannot fold whose two branches are the identity, `fence`;
for GPU an `optimization_barrier`, see `lowering.py`). The forward puts
each quantized operand's scales behind one in both programs, so
everything after it is the same code on the same arrays: XLA fuses it
alike, and the outputs are equal bit for bit.

Internal API (for `forward.py`, `dot_general.py`,
`aqtr.flax.serving` and `aqtr.pax.kv_cache`): `fusion_boundary`,
`fusion_fenced`, `cotangent_boundary`; `fence`, `first_index`,
`copy_index` and `copyable` for `passes.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import get_abstract_mesh

from aqtr.core.lowering import loops_allowed, per_platform


def fusion_fenced() -> bool:
  """Whether `fusion_boundary` fences fusion on the default backend.

  True on CPU outside a mesh context (a loop or a conditional; measured:
  serve == train bit for bit on real models under XLA's default flags).
  Elsewhere it is an `optimization_barrier`, which XLA may drop before
  fusion (not measured): under a mesh the conditional's branch index,
  read from a sharded scale, would cost a collective per dot.

  Example:
    >>> fusion_fenced()  # On the CPU backend.
    True
  """
  return jax.default_backend() == 'cpu' and get_abstract_mesh().empty


def _index(first: jax.Array) -> jax.Array:
  """1 from a value XLA cannot fold (0 for a NaN; both branches of a
  `fence` are the identity, so either index gives the same outputs)."""
  if jnp.issubdtype(first.dtype, jnp.floating):
    return (first == first).astype(jnp.int32)
  return jnp.minimum(1, jnp.abs(first.astype(jnp.int32)) + 1)


def copyable(values: jax.Array) -> bool:
  """Whether a fence writes `values`' buffer (`copy_index` reads its first
  value's bits): non-empty, integer or 1-2 byte float."""
  return values.size > 0 and (
    jnp.issubdtype(values.dtype, jnp.integer) or values.dtype.itemsize <= 2
  )


def copy_index(values: jax.Array) -> jax.Array:
  """1 from the first value's bits, a count XLA cannot fold (`copyable`
  values)."""
  first = values.reshape(-1)[0]
  if jnp.issubdtype(values.dtype, jnp.integer):  # int4, int8, int16
    as_int = first.astype(jnp.int32)
  else:  # fp8, bf16, f16: their bits
    unsigned = jnp.uint8 if values.dtype.itemsize == 1 else jnp.uint16
    as_int = lax.bitcast_convert_type(first, unsigned).astype(jnp.int32)
  return jnp.minimum(1, jnp.abs(as_int) + 1)  # Always 1.


def swap_last(x: jax.Array | None) -> jax.Array | None:
  """[B, T, X, Y] -> [B, T, Y, X] (None stays None)."""
  return None if x is None else x.transpose(0, 1, 3, 2)


def one_trip_loop(tree, count):
  """`tree` through a while loop of `count(tree)` trips (an int32 XLA
  cannot fold, 1 or, where the loop is the identity anyway, 0).

  The count is computed in the loop's condition, from the carried arrays:
  no kernel of its own before the loop. XLA:CPU runs a small loop as one
  kernel (fast in a decoding step), but compiles that kernel for each
  loop (~15 ms; `fence` ~4 ms).
  """

  def body(carry):
    i, t = carry
    # The barrier keeps `t` a loop output (JAX hoists an unchanged carry
    # out of the loop, and XLA would then fuse across it again).
    return i + 1, lax.optimization_barrier(t)

  return lax.while_loop(lambda c: c[0] < count(c[1]), body, (0, tree))[1]


def fence(tree, index):
  """`tree` through a conditional on `index(tree)` (an int32 XLA cannot
  fold: 1 or, where either branch gives the same outputs, 0) whose two
  branches are the identity: the fence of the differentiated forward and
  of the backward (training).

  XLA keeps the conditional (its branches are computations of their own),
  so no fusion reaches across it: its operands are written to buffers of
  their own, which the branches return as they are (no copy). XLA:CPU
  compiles one in ~4 ms, a `one_trip_loop` in ~15 ms (a kernel of its own
  per loop, never shared); but it runs a conditional as a thunk of its
  own, which made a batch-1 decoding step (~1 ms, ~30 fences) 10-40 %
  slower in wall time on two threads: the primal and serving keep the
  loop. The index is computed before the conditional: from a scale, XLA
  fuses it with the scale's reductions into one small kernel, alike for
  every scale of one size (compiled once).
  """

  def keep(t):
    # The barrier keeps `t` an output of the conditional (JAX forwards an
    # operand that every branch returns unchanged, and XLA would then fuse
    # across it again).
    return lax.optimization_barrier(t)

  return lax.switch(index(tree), [keep, keep], tree)


def _vector(x: jax.Array) -> bool:
  """Whether at most one axis of `x` is longer than 1 (a scale's shape)."""
  return sum(d > 1 for d in x.shape) <= 1


def _flat_fence(tree, values, index, conditional: bool):
  """(`tree`, `values`) through `fence` (`conditional`) or
  `one_trip_loop`, `tree`'s vectors (scales) carried as 1-D (reshapes:
  free). So the kernels writing a row scale
  [., M, 1] and a column scale [., 1, N] of one size are one fused
  computation, which XLA:CPU compiles once (each kernel costs ~10 ms of
  compile time). Other arrays (a KV cache) keep their shapes: reshaped,
  XLA copies them in a decode loop."""
  leaves, treedef = jax.tree.flatten(tree)
  flat = [x.reshape(-1) if _vector(x) else x for x in leaves]
  through = fence if conditional else one_trip_loop
  flat, values = through((flat, values), index)
  leaves = [x.reshape(y.shape) for x, y in zip(flat, leaves, strict=True)]
  return jax.tree.unflatten(treedef, leaves), values


def fusion_boundary(
  tree, transposed: jax.Array | None = None, *, conditional: bool = False
):
  """`tree`'s arrays as buffers of their own that no fusion reaches across.

  Lowered for CPU outside a mesh, a `one_trip_loop`, or with
  `conditional` a `fence` (cheaper to compile, slower to run where a
  step is ~1 ms of small kernels: the differentiated forward takes it);
  XLA:CPU drops `optimization_barrier`s before fusion, but keeps a loop
  and a conditional; `tree`'s vectors carried 1-D, see `_flat_fence`.
  Elsewhere an `optimization_barrier` (`lowering.per_platform`). The
  values are unchanged.

  `transposed` (`copyable`): an array [B, T, X, Y] also returned as
  [B, T, Y, X]. For CPU the same fence makes it a buffer of its own, then
  a plain copy transposes it (the job of `passes.with_transposed_copy`
  without a fence of its own: each costs compile time); for GPU it is
  transposed as it is (a 1-byte array, no fence).

  Args:
    tree: a pytree of arrays (None leaves allowed).
    transposed: an array to copy transposed after the fence, or None.
    conditional: fence with a conditional instead of a loop.

  Returns:
    The same tree, same values; with `transposed`, `(tree, values,
    values_t)` (`values_t` None where it is not `copyable`, or under a
    mesh).

  Example:
    >>> s = jnp.array([0.5, 2.0])
    >>> fusion_boundary((s, None))[0].tolist()
    [0.5, 2.0]
  """
  copies = transposed is not None
  fences = loops_allowed(tree, transposed)
  if copies and fences and copyable(transposed):

    def cpu(tree, values):
      index = _scales_or_values_index if conditional else _values_index
      tree, values = _flat_fence(tree, values, index, conditional)
      return tree, values, swap_last(values)

    def gpu(tree, values):
      return _barrier(tree), values, swap_last(values)

    return per_platform(tree, transposed, cpu=cpu, gpu=gpu)
  if not fences:
    tree = _barrier(tree)
  elif any(x.size for x in jax.tree.leaves(tree)):
    tree = per_platform(
      tree,
      cpu=lambda t: _flat_fence(
        t, None, lambda c: first_index(c[0]), conditional
      )[0],
      gpu=_barrier,
    )
  return (tree, transposed, None) if copies else tree


def _barrier(tree):
  """`tree` behind an `optimization_barrier` (if it holds any values)."""
  if any(x.size for x in jax.tree.leaves(tree)):
    return lax.optimization_barrier(tree)
  return tree


def first_index(tree) -> jax.Array:
  """An index XLA cannot fold (1, or 0 for a NaN), from the first value
  of `tree`'s first non-empty array."""
  first = [x for x in jax.tree.leaves(tree) if x.size][0]
  return _index(first.reshape(-1)[0])


def _values_index(tree_values) -> jax.Array:
  return copy_index(tree_values[1])


def _scales_or_values_index(tree_values) -> jax.Array:
  """The index from the first scale (its kernel is alike for every scale
  of one size), else from the values' first bits."""
  tree, values = tree_values
  if any(x.size for x in jax.tree.leaves(tree)):
    return first_index(tree)
  return copy_index(values)


def cotangent_boundary(g: jax.Array) -> jax.Array:
  """`g` written to a buffer of its own (a `fence`) where lowered for CPU
  outside a mesh and `g` is not sharded; else `g` as it is.

  For a cotangent read by several fusions: XLA:CPU otherwise fuses the
  elementwise chain that makes it (a GELU's backward, say) into each of
  them, and recomputes it there, with strided loads where one of them
  copies it transposed. The values are unchanged.

  Example:
    >>> cotangent_boundary(jnp.ones(2)).tolist()
    [1.0, 1.0]
  """
  if g.size and loops_allowed(g):
    return per_platform(g, cpu=lambda g: fence(g, first_index), gpu=lambda g: g)
  return g
