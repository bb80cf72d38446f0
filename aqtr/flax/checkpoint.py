"""orbax save / restore of serving trees (linen variables or nnx state).

A serving tree holds placeholders without arrays (`Removed` kernels) and
Flax containers; orbax is given only the arrays, as a flat dict keyed by
their dotted path ('params.Dense_0.bias', 'aqtr.Dense_0.DotGeneral_0.
frozen_1a2b3c4d.rhs.qvalue'). Restoring needs the tree's structure: pass a
`target` of the same structure, concrete or abstract, e.g.

  linen: jax.eval_shape(lambda v: convert(model, v, x), abstract_variables)
  nnx:   nnx.state(nnx.eval_shape(lambda: convert(make_model(), x)))

int8 / int4 / fp8 values keep their dtype.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def _name(entry) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _flat(tree) -> tuple[dict, jax.tree_util.PyTreeDef]:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  flat = {}
  for path, leaf in leaves:
    key = '.'.join(_name(e) for e in path) or 'value'
    if key in flat:
      raise ValueError(f'two leaves share the checkpoint key {key!r}.')
    flat[key] = leaf
  return flat, treedef


def save(path: str | os.PathLike, tree, *, force: bool = False) -> None:
  """Saves the arrays of a serving tree to the directory `path`.

  Args:
    path: a directory (made absolute); must not exist unless `force`.
    tree: serving variables (linen) or `nnx.state(model)` (nnx).
    force: overwrite an existing checkpoint.
  """
  flat, _ = _flat(tree)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.abspath(path), flat, force=force)
  ckpt.wait_until_finished()


def restore(path: str | os.PathLike, target):
  """Restores a tree saved by `save` into the structure of `target`.

  Args:
    path: the checkpoint directory.
    target: a tree of the saved structure; its leaves (arrays or
      jax.ShapeDtypeStruct) give shapes and dtypes.

  Returns:
    `target`'s structure with the saved arrays.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> d = tempfile.mkdtemp() + '/ckpt'
    >>> save(d, {'w': jnp.ones((2,), jnp.int8)})
    >>> restore(d, {'w': jnp.zeros((2,), jnp.int8)})['w'].tolist()
    [1, 1]
  """
  flat, treedef = _flat(target)
  abstract = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in flat.items()
  }
  ckpt = ocp.StandardCheckpointer()
  path = os.path.abspath(path)
  _check_keys(set(ckpt.metadata(path).item_metadata.tree), set(abstract))
  out = ckpt.restore(path, abstract)
  return jax.tree_util.tree_unflatten(treedef, [out[k] for k in flat])


def _check_keys(saved: set, wanted: set) -> None:
  """Reports a structure mismatch; frozen entries of another config first."""
  missing, extra = sorted(wanted - saved), sorted(saved - wanted)
  if not (missing or extra):
    return

  def frozen(keys):
    return [k for k in keys if '.frozen_' in f'.{k}']

  if frozen(missing) and frozen(extra):
    raise ValueError(
      'the checkpoint holds frozen values converted with a different '
      f'forward quantization config ({frozen(extra)[:3]}) than the target '
      f'expects ({frozen(missing)[:3]}); build the target with the config '
      'used for CONVERT, or convert again.'
    )
  raise ValueError(
    f'the checkpoint does not match the target: missing {missing[:5]}, '
    f'unexpected {extra[:5]}.'
  )


__all__ = ['restore', 'save']
