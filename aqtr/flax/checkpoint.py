"""orbax save / restore of serving trees (linen variables or nnx state).

A serving tree holds placeholders without arrays (removed kernels,
`aqtr.flax.frozen`) and Flax containers; orbax is given only the arrays, as a
flat dict keyed by their dotted path ('params.Dense_0.bias',
'aqtr.Dense_0.DotGeneral_0. frozen_1a2b3c4d.rhs.qvalue'). Restoring needs the
tree's structure: pass a `target` of the same structure, concrete or abstract,
e.g.

  linen: jax.eval_shape(lambda v: convert(model, v, x), abstract_variables)
  nnx:   nnx.state(nnx.eval_shape(lambda: convert(make_model(), x)))

int8 / int4 / fp8 values keep their dtype.

Integrity: `save` also writes `aqtr_checksum.json` in the checkpoint folder
(a sha256 of every array's dtype, shape and bytes); `restore` recomputes it
and refuses data that changed since it was saved. Every way a checkpoint
cannot be restored (no folder, missing or garbled metadata, a target of
another structure or of other leaf shapes or dtypes, truncated or
corrupted data, a checksum mismatch) raises one `CheckpointError` whose
one-line message starts with the checkpoint's path.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np

from aqtr import extras

try:
  import orbax.checkpoint as ocp
except ImportError as e:
  raise extras.missing('flax', 'aqtr.flax.checkpoint', e) from e

CHECKSUM_FILE = 'aqtr_checksum.json'
_FORMAT = 'aqtr.flax.checkpoint/1'


class CheckpointError(ValueError):
  """A checkpoint cannot be restored as saved; the message names its path."""

  def __init__(self, path: str, message: str):
    super().__init__(f'{path}: {message}')
    self.path = path


def _one_line(err: BaseException, limit: int = 200) -> str:
  text = ' '.join(str(err).split())
  text = text if len(text) <= limit else text[: limit - 3] + '...'
  return f'{type(err).__name__}: {text}' if text else type(err).__name__


def _digests(flat: dict) -> dict[str, str]:
  """sha256 of each array's dtype, shape and bytes, by key."""
  out = {}
  for key in sorted(flat):
    a = np.ascontiguousarray(np.asarray(flat[key]))
    h = hashlib.sha256(f'{a.dtype.name}{a.shape}'.encode())
    h.update(a.tobytes())
    out[key] = h.hexdigest()
  return out


def _read_digests(path: str) -> dict[str, str]:
  file = os.path.join(path, CHECKSUM_FILE)
  if not os.path.isfile(file):
    raise CheckpointError(
      path,
      f'{CHECKSUM_FILE} is missing: not written by aqtr.flax.checkpoint.save, '
      'or the save did not finish.',
    )
  try:
    with open(file, 'rb') as f:
      meta = json.loads(f.read().decode())
    digests = meta['sha256']
    if meta['format'] != _FORMAT or not isinstance(digests, dict):
      raise ValueError(f'format {meta["format"]!r}, expected {_FORMAT!r}')
  except Exception as e:  # Reported with the path.
    raise CheckpointError(
      path, f'{CHECKSUM_FILE} is garbled ({_one_line(e, 80)}).'
    ) from e
  return digests


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
  path = os.path.abspath(path)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, flat, force=force)
  ckpt.wait_until_finished()
  meta = {'format': _FORMAT, 'sha256': _digests(flat)}
  with open(os.path.join(path, CHECKSUM_FILE), 'w') as f:
    json.dump(meta, f, indent=1)


def restore(path: str | os.PathLike, target):
  """Restores a tree saved by `save` into the structure of `target`.

  Args:
    path: the checkpoint directory.
    target: a tree of the saved structure; its leaves (arrays or
      jax.ShapeDtypeStruct) give shapes and dtypes.

  Returns:
    `target`'s structure with the saved arrays.

  Raises:
    CheckpointError: no checkpoint at `path`, missing or garbled metadata,
      unreadable data, data that changed since `save` (checksum), or a
      target of another structure or with a leaf of another shape or dtype
      (named). The message starts with the path.

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
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(path, 'no checkpoint here (no such directory).')
  expected = _read_digests(path)
  ckpt = ocp.StandardCheckpointer()
  try:
    meta = ckpt.metadata(path).item_metadata.tree
    saved = set(meta)
  except Exception as e:  # Reported with the path.
    raise CheckpointError(
      path,
      'the orbax metadata cannot be read: the checkpoint is incomplete or '
      f'corrupted ({_one_line(e, 80)}).',
    ) from e
  if saved != set(expected):
    raise CheckpointError(
      path, f'the orbax metadata and {CHECKSUM_FILE} list different arrays.'
    )
  _check_keys(path, saved, set(abstract))
  _check_shapes(path, meta, abstract)
  try:
    out = ckpt.restore(path, abstract)
  except Exception as e:  # Reported with the path.
    raise CheckpointError(
      path,
      'the array data cannot be read: truncated or corrupted '
      f'({_one_line(e)}).',
    ) from e
  actual = _digests(out)
  bad = [k for k in sorted(flat) if actual[k] != expected[k]]
  if bad:
    raise CheckpointError(
      path,
      f'checksum mismatch for {bad[:3]}: the data changed since it was '
      'saved (corrupted); do not serve from it.',
    )
  return jax.tree_util.tree_unflatten(treedef, [out[k] for k in flat])


def _check_keys(path: str, saved: set, wanted: set) -> None:
  """Reports a structure mismatch; frozen entries of another config first."""
  missing, extra = sorted(wanted - saved), sorted(saved - wanted)
  if not (missing or extra):
    return

  def frozen(keys):
    return [k for k in keys if '.frozen_' in f'.{k}']

  if frozen(missing) and frozen(extra):
    raise CheckpointError(
      path,
      'the checkpoint holds frozen values converted with a different '
      f'forward quantization config ({frozen(extra)[:3]}) than the target '
      f'expects ({frozen(missing)[:3]}); build the target with the config '
      'used for CONVERT, or convert again.',
    )
  raise CheckpointError(
    path,
    f'the checkpoint does not match the target: missing {missing[:5]}, '
    f'unexpected {extra[:5]}.',
  )


def _check_shapes(path: str, meta: dict, abstract: dict) -> None:
  """Reports target leaves whose shape or dtype differs from the saved one."""
  bad, views = [], False
  for key in sorted(abstract):
    want, m = abstract[key], meta[key]
    if getattr(m, 'shape', None) is None or getattr(m, 'dtype', None) is None:
      continue  # Not an array's metadata: the restore checks it.
    have = (tuple(m.shape), np.dtype(m.dtype))
    if have != (tuple(want.shape), np.dtype(want.dtype)):
      bad.append(
        f'{key!r} is {have[1].name}{list(have[0])} in the checkpoint but '
        f'{np.dtype(want.dtype).name}{list(want.shape)} in the target'
      )
      views |= _other_view(key, have[0], tuple(want.shape))
  if bad:
    more = f' (and {len(bad) - 2} more)' if len(bad) > 2 else ''
    fix = (
      'build the target from the model and config that were saved (same '
      'layer sizes, same weight format).'
    )
    if views:
      fix = (
        'the frozen weights were saved in the view they were quantized in '
        '([.., K, N]), before aqtr stored integer-dot weights with their '
        'contraction minor ([.., N, K]): convert the model again, or move '
        'the weights through aqtr.checkpoints (export, then load).'
      )
    raise CheckpointError(
      path,
      f'the target differs from the saved tree: {"; ".join(bad[:2])}{more}. '
      f'The files are intact: {fix}',
    )


def _other_view(key: str, have: tuple, want: tuple) -> bool:
  """Whether a frozen scale was saved in the other tiled view: [.., 1, N]
  saved, [.., N, 1] wanted (`aqtr.core.qtensor.stored_form`)."""
  return (
    key.endswith('.scale')
    and len(have) == len(want) >= 2
    and have[:-2] == want[:-2]
    and have[-2:] == want[-2:][::-1]
    and have[-2] == 1
  )


__all__ = ['CHECKSUM_FILE', 'CheckpointError', 'restore', 'save']
