"""Training only the adapters: masks, partition, optimizers, checks.

The LoRA trainable set is the adapter matrices (linen params named
`lora_a_<op>` / `lora_b_<op>`, nnx `aqtr.lora.Adapter` variables); the
frozen base never gets an update. Pick one of:

  linen   `adapters, frozen = partition(params)`: differentiate the loss
          in `adapters` only (`combine(adapters, frozen)` rebuilds the
          tree), any optax transformation on `adapters`; or
          `optimizer(tx)` on the whole tree (the base's updates are 0)
  nnx     `nnx_optimizer(model, tx)` (wrt `Adapter`), gradients with
          `nnx.DiffState(0, Adapter)`

A mask or `wrt` filter that makes a base weight trainable is refused
(`check`, `check_nnx`) with one line naming the weight.

Example:
  >>> import jax.numpy as jnp
  >>> params = {'dense': {'kernel': jnp.ones((2, 2)),
  ...                     'lora_a_dot_general0': jnp.ones((2, 1))}}
  >>> trainable(params)
  {'dense': {'kernel': False, 'lora_a_dot_general0': True}}
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx, traverse_util

from aqtr.lora.adapters import A_PREFIX, B_PREFIX, Adapter

__all__ = [
  'check',
  'check_nnx',
  'combine',
  'nnx_optimizer',
  'optimizer',
  'partition',
  'trainable',
]


def _key_name(k) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _is_adapter(path) -> bool:
  return any(_key_name(k).startswith((A_PREFIX, B_PREFIX)) for k in path[-1:])


def trainable(tree: Any) -> Any:
  """A mask of `tree`'s leaves: True exactly on the adapter matrices."""
  return jax.tree_util.tree_map_with_path(lambda p, _: _is_adapter(p), tree)


def _where(path) -> str:
  return '/'.join(_key_name(k) for k in path)


def check(params: Any, mask: Any) -> None:
  """Raises unless `mask` marks adapters only (and at least one)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  marks = jax.tree_util.tree_leaves(mask)
  if len(marks) != len(flat):
    raise ValueError(
      f'aqtr.lora: the trainable mask has {len(marks)} leaves but the '
      f'params have {len(flat)}; build it with aqtr.lora.trainable(params).'
    )
  for (path, _), m in zip(flat, marks, strict=True):
    if m and not _is_adapter(path):
      raise ValueError(
        f'aqtr.lora: base weight {_where(path)!r} is trainable; only the '
        'adapters (lora_a_* / lora_b_*) may train: use '
        'aqtr.lora.trainable(params) as the mask.'
      )
  if not any(marks):
    raise ValueError(
      'aqtr.lora: nothing is trainable (no adapter in the params); build '
      'the model with aqtr.lora.attach.'
    )


def optimizer(tx: optax.GradientTransformation, mask: Any = None):
  """`tx` on the adapters of the whole params tree; 0 for the rest.

  Args:
    tx: the optimizer of the adapters (e.g. `optax.adamw(1e-3)`).
    mask: the trainable mask (a tree or a function of the params);
      default `trainable`. A mask marking a base weight raises.
  """

  def labels(params):
    m = trainable(params) if mask is None else mask
    m = m(params) if callable(m) else m
    check(params, m)
    return jax.tree.map(lambda t: 'adapter' if t else 'frozen', m)

  return optax.multi_transform(
    {'adapter': tx, 'frozen': optax.set_to_zero()}, labels
  )


def partition(params: Any) -> tuple[dict, dict]:
  """(adapters, frozen) nested dicts of a linen params tree."""
  flat = traverse_util.flatten_dict(params)
  ad = {
    k: v for k, v in flat.items() if str(k[-1]).startswith((A_PREFIX, B_PREFIX))
  }
  rest = {k: v for k, v in flat.items() if k not in ad}
  if not ad:
    raise ValueError(
      'aqtr.lora.partition: no adapter in the params; build the model with '
      'aqtr.lora.attach.'
    )
  return traverse_util.unflatten_dict(ad), traverse_util.unflatten_dict(rest)


def combine(adapters: dict, frozen: dict) -> dict:
  """The params tree of `partition`'s two halves."""
  flat = traverse_util.flatten_dict(frozen)
  flat.update(traverse_util.flatten_dict(adapters))
  return traverse_util.unflatten_dict(flat)


def check_nnx(model: nnx.Module, wrt: Any = Adapter) -> None:
  """Raises unless the nnx filter `wrt` selects adapters only."""
  state = nnx.state(model, wrt)
  n = 0
  for path, v in nnx.to_flat_state(state):
    if not isinstance(v, Adapter):
      raise ValueError(
        f'aqtr.lora: base weight {"/".join(map(str, path))!r} '
        f'({type(v).__name__}) is trainable under wrt={wrt!r}; only the '
        'adapters may train: use wrt=aqtr.lora.Adapter.'
      )
    n += 1
  if not n:
    raise ValueError(
      f'aqtr.lora: wrt={wrt!r} selects no adapter; build the model with '
      'aqtr.lora.attach and use wrt=aqtr.lora.Adapter.'
    )


def nnx_optimizer(model: nnx.Module, tx, wrt: Any = Adapter):
  """`nnx.Optimizer(model, tx, wrt=wrt)` after `check_nnx(model, wrt)`."""
  check_nnx(model, wrt)
  return nnx.Optimizer(model, tx, wrt=wrt)
