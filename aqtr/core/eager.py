"""One compiled program for a library function called outside a trace.

Called eagerly (a notebook, a test, a conversion script), a JAX function
runs op by op, and every distinct (primitive, shape) pair is traced,
lowered and compiled as a program of its own: a quantization is some 50
primitives, so its first eager call compiles ~50 tiny programs (each ~10 ms
of fixed XLA cost on CPU) and every later call dispatches ~50 times.
`compiled_when_eager(fn)` runs such a call as `jax.jit(fn)` instead: one
program per (function, array shapes and dtypes, other arguments), cached by
`jax.jit` like any jitted function. Inside a trace (`jit`, `grad`, `vmap`,
`scan`, ...) it calls `fn` as it is: the caller's trace already makes one
program, and a nested `jit` only adds an equation to trace.

An error raised while tracing (a bad argument, or a Python branch on an
array's value) sends the call, and later calls of the same kind, to `fn`
itself: the error a user sees is the one `fn` raises eagerly, unchanged.

Which arguments are traced: the array leaves (`jax.Array`, NumPy arrays)
of the arguments' pytrees. Every other leaf (configs, ints, strings,
None) is passed as it is, so it must be hashable; a call with an
unhashable one runs eagerly, as before. `fn` returns a pytree of arrays;
value checks it makes only when its inputs are concrete (`int(x)` inside
`try`) do not run under the jit: do not wrap such a function.

Values: the same primitives in one program, which XLA may fuse (no
fast-math on CPU). An eager call gives what the same call inside a user's
`jit` gives (tests/core/test_eager.py compares them bit for bit), which
op-by-op calls did not promise.

Example:
  >>> import jax.numpy as jnp
  >>> @compiled_when_eager
  ... def scaled(x, factor):
  ...   return x * factor
  >>> scaled(jnp.ones(3), 2.0).tolist()
  [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

F = TypeVar('F', bound=Callable[..., Any])


def _is_array(leaf) -> bool:
  return isinstance(leaf, jax.Array | np.ndarray)


class _Static:
  """The non-array leaves and the tree structure of one call: a hashable
  static argument of the jitted function."""

  __slots__ = ('leaves', 'mask', 'tree', '_hash')

  def __init__(self, leaves: tuple, mask: tuple, tree):
    self.leaves, self.mask, self.tree = leaves, mask, tree
    # With the types: 8, 8.0 and True are equal, but validate differently.
    self._hash = hash((tuple(map(type, leaves)), leaves, mask, tree))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return (
      isinstance(other, _Static)
      and self.mask == other.mask
      and self.tree == other.tree
      and tuple(map(type, self.leaves)) == tuple(map(type, other.leaves))
      and self.leaves == other.leaves
    )


def compiled_when_eager(fn: F) -> F:
  """`fn` as one `jax.jit` program when called with concrete arrays.

  Args:
    fn: a traceable function of pytrees of arrays and hashable values.

  Returns:
    A function with `fn`'s signature and docstring: under a trace it is
    `fn`; called eagerly it runs `jax.jit` of `fn` with the array leaves
    traced and every other leaf static.
  """

  def rebuilt(arrays, static: _Static):
    it_a, it_s = iter(arrays), iter(static.leaves)
    leaves = [next(it_a) if m else next(it_s) for m in static.mask]
    args, kwargs = jax.tree.unflatten(static.tree, leaves)
    return fn(*args, **kwargs)

  jitted = jax.jit(rebuilt, static_argnums=1)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return fn(*args, **kwargs)
    mask = tuple(_is_array(x) for x in leaves)
    others = tuple(x for x, m in zip(leaves, mask, strict=True) if not m)
    try:
      static = _Static(others, mask, tree)
    except TypeError:  # An unhashable leaf: no static key for it.
      return fn(*args, **kwargs)
    arrays = [x for x, m in zip(leaves, mask, strict=True) if m]
    avals = (static, tuple((jnp.shape(a), jnp.result_type(a)) for a in arrays))
    if avals not in eager_only:
      try:
        return jitted(arrays, static)
      except Exception:  # noqa: BLE001 - re-raised by the eager call below.
        eager_only.add(avals)
    # The eager call raises the function's own error (not through `jit`'s
    # frames and note), or runs a function that reads a value in Python.
    return fn(*args, **kwargs)

  eager_only: set = set()
  return call  # type: ignore[return-value]


__all__ = ['compiled_when_eager']
