"""Weights checked once for NaN / inf where aqtr quantizes them.

A NaN or inf weight cannot be quantized meaningfully (its scale becomes
NaN), and a model computing NaN logits decodes token 0 at every step of a
greedy loop (the argmax of NaN), silently: inside a stock model's own
jitted loop (a Hugging Face `generate`) nothing can raise. So the weights
are checked once, where aqtr touches them before the loop runs:
`aqtr.flax.convert` (every parameter a quantized op reads) and
`aqtr.flax.quantize_cache` (the parameters an nnx model or a Hugging Face
Flax model holds; a bare linen module holds none, its variables come at
`apply`). `aqtr.flax.decode.Decoder` checks the logits it computes.

Example:
  >>> import jax.numpy as jnp
  >>> tree = {'a': {'kernel': jnp.ones(2)}, 'b': jnp.asarray([0.0, jnp.nan])}
  >>> non_finite(tree)
  'b'
  >>> check_finite(tree['a'], 'demo', 'params/a')
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['check_finite', 'non_finite']


def _concrete_float(x: Any) -> bool:
  if isinstance(x, jax.core.Tracer) or not isinstance(
    x, jax.Array | np.ndarray
  ):
    return False
  return jnp.issubdtype(x.dtype, jnp.inexact)


def non_finite(tree: Any) -> str | None:
  """The first floating leaf of `tree` holding NaN or inf.

  Args:
    tree: a pytree of arrays; abstract leaves (tracers,
      `jax.ShapeDtypeStruct`) and integer leaves are skipped.

  Returns:
    The leaf's '/'-joined path ('' for a bare array), or None when every
    leaf is finite.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  for path, x in flat:
    if _concrete_float(x) and not bool(jnp.isfinite(x).all()):
      return jax.tree_util.keystr(path, simple=True, separator='/')
  return None


def check_finite(tree: Any, who: str, where: str = '') -> None:
  """Raises one line naming the parameter of `tree` holding NaN or inf.

  Args:
    tree: a parameter (array) or a pytree of them.
    who: the caller named in the message (e.g. 'aqtr.flax.convert').
    where: the path of `tree` (prefixed to the leaf's path).

  Raises:
    ValueError: some floating leaf holds NaN or inf.
  """
  bad = non_finite(tree)
  if bad is None:
    return
  name = '/'.join(p for p in (where, bad) if p) or '(the array)'
  raise ValueError(
    f'{who}: parameter {name} holds NaN or inf values (quantized or not, '
    'the logits would be NaN and greedy decoding token 0 at every step); '
    'fix or reload the weights.'
  )
