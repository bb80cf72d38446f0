"""The tests' XLA flags (tests/conftest.py) keep serve == train checkable.

Serve == train compares two programs (the training model and the serving
model) that compute the same expressions; they agree bit for bit only if
XLA compiles one expression to the same arithmetic in both. XLA:CPU lets
LLVM contract a multiply and an add into an FMA; at LLVM -O0 its fast
instruction selector never does and its full one does, and which one runs
for a kernel depended on the other kernels of its LLVM module, i.e. on the
rest of the program (benchmarks/xla_cpu_fma_contraction.md). This is that
case at toy size: an int8 dot's rescale plus bias, compiled alone and next
to an unrelated tanh (with the tests' one codegen split, both kernels of
the second program share an LLVM module). It fails under the classic
emitters at -O0 without `-fast-isel=false`.
"""

import jax
import jax.numpy as jnp
import numpy as np


def _rescale(acc, lhs_scale, rhs_scale, bias):
  return ((acc.astype(jnp.float32) * lhs_scale) * rhs_scale + bias) * 0.25


def test_one_expression_compiles_to_the_same_bits_in_two_programs():
  k = jax.random.split(jax.random.key(0), 4)
  args = (
    jax.random.randint(k[0], (256, 32), -5000, 5000),
    jax.random.uniform(k[1], (256, 1)),
    jax.random.uniform(k[2], (1, 32)),
    jax.random.normal(k[3], (1, 32)),
  )
  alone = jax.jit(_rescale)(*args)
  beside_tanh, _ = jax.jit(
    lambda *a: (_rescale(*a), jnp.tanh(jnp.arange(7.0) * a[3][0, 0]))
  )(*args)
  np.testing.assert_array_equal(np.asarray(alone), np.asarray(beside_tanh))
