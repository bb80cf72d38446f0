"""The one place that tells Flax model kinds apart (nnx, linen, bound).

Every other module asks these predicates (or the model's host,
`aqtr.flax.hosts.of`) instead of testing `isinstance` on Flax's module
classes itself, so a new kind of model is taught to aqtr here and in its
host, nowhere else. A test holds it (tests/flax/test_host_structure.py).

Example:
  >>> from flax import nnx
  >>> m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> is_nnx(m), is_linen(m), name(m)
  (True, False, 'nnx')
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx

__all__ = ['is_bound', 'is_linen', 'is_module', 'is_nnx', 'name']


def is_linen(model: Any) -> bool:
  """Whether `model` is a linen Module (bound or not)."""
  return isinstance(model, nn.Module)


def is_nnx(model: Any) -> bool:
  """Whether `model` is an nnx Module."""
  return isinstance(model, nnx.Module)


def is_bound(model: Any) -> bool:
  """Whether `model` is a linen Module bound to variables (in a call)."""
  return is_linen(model) and model.scope is not None


def is_module(model: Any) -> bool:
  """Whether `model` is a module that can run now: nnx, or bound linen."""
  return is_nnx(model) or is_bound(model)


def name(model: Any) -> str | None:
  """'nnx', 'linen' or None (another kind: a host may be registered)."""
  if is_nnx(model):
    return 'nnx'
  if is_linen(model):
    return 'linen'
  return None
