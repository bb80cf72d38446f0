"""Token embedding and softmax logits, tied or separate (Pax style).

  Embedding               ids -> vectors (a gather, not a contraction)
  Softmax                 vectors -> logits through its own weight [d, V]
  SharedEmbeddingSoftmax  one table [V, d] for both (tied): `embed(ids)`
                          gathers, `__call__(x)` gives the logits

The logits contraction is an injectable op field (`einsum`, tagged
`WeightOp`, the weight as rhs operand).

Example:
  >>> import jax, jax.numpy as jnp
  >>> layer = SharedEmbeddingSoftmax(num_classes=10, features=4)
  >>> ids = jnp.array([[1, 2]])
  >>> params = layer.init(jax.random.key(0), ids, method='embed')
  >>> x = layer.apply(params, ids, method='embed')
  >>> x.shape, layer.apply(params, x).shape
  ((1, 2, 4), (1, 2, 10))
"""

from __future__ import annotations

from typing import Annotated

import flax.linen as nn
import jax
import jax.numpy as jnp

from aqtr.pax import ops, sharding, tags
from aqtr.pax.linear import Initializer, add_bias

__all__ = ['Embedding', 'SharedEmbeddingSoftmax', 'Softmax']

_EMBEDDING_INIT = nn.initializers.normal(stddev=0.02)


def _lookup(table: jax.Array, ids: jax.Array, scale: bool) -> jax.Array:
  x = sharding.lookup(table, ids)  # Explicit axes: sharded like the ids.
  return x * jnp.sqrt(table.shape[-1]).astype(x.dtype) if scale else x


class Embedding(nn.Module):
  """Looks ids up in a [num_embeddings, features] table.

  Attributes:
    num_embeddings: vocabulary size.
    features: embedding size.
    scale_sqrt_depth: multiply the vectors by sqrt(features).
    embedding_init: initializer of the table.
  """

  num_embeddings: int
  features: int
  scale_sqrt_depth: bool = False
  embedding_init: Initializer = _EMBEDDING_INIT

  def setup(self):
    self.embedding = self.param(
      'embedding', self.embedding_init, (self.num_embeddings, self.features)
    )

  def embed(self, ids: jax.Array) -> jax.Array:
    """Vectors of integer `ids`: [...] -> [..., features]."""
    return _lookup(self.embedding, ids, self.scale_sqrt_depth)

  def __call__(self, ids: jax.Array) -> jax.Array:
    """Same as `embed`."""
    return self.embed(ids)


class Softmax(nn.Module):
  """Logits `x . W (+ b)`, W of shape [d, num_classes] (untied).

  Attributes:
    num_classes: number of logits.
    einsum: the injectable logits op (tagged `WeightOp`).
    use_bias: add a learned bias to the logits.
    kernel_init: initializer of W.
  """

  num_classes: int
  einsum: Annotated[ops.EinsumOp | None, tags.WeightOp] = None
  use_bias: bool = False
  kernel_init: Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Logits [..., num_classes] of `x` [..., d]."""
    w = self.param('kernel', self.kernel_init, (x.shape[-1], self.num_classes))
    y = ops.einsum(self.einsum, '...d,dv->...v', x, w)
    if self.use_bias:
      b = self.param('bias', nn.initializers.zeros_init(), (self.num_classes,))
      y = add_bias(y, b)
    return y


class SharedEmbeddingSoftmax(nn.Module):
  """One [num_classes, features] table for the lookup and the logits.

  Attributes:
    num_classes: vocabulary size.
    features: embedding size.
    einsum: the injectable logits op `'...d,vd->...v'` (tagged
      `WeightOp`); the lookup is a gather and never quantized.
    scale_sqrt_depth: multiply looked-up vectors by sqrt(features).
    embedding_init: initializer of the table.
  """

  num_classes: int
  features: int
  einsum: Annotated[ops.EinsumOp | None, tags.WeightOp] = None
  scale_sqrt_depth: bool = False
  embedding_init: Initializer = _EMBEDDING_INIT

  def setup(self):
    self.embedding = self.param(
      'embedding', self.embedding_init, (self.num_classes, self.features)
    )

  def embed(self, ids: jax.Array) -> jax.Array:
    """Vectors of integer `ids`: [...] -> [..., features]."""
    return _lookup(self.embedding, ids, self.scale_sqrt_depth)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Logits [..., num_classes] of `x` [..., features]."""
    return ops.einsum(self.einsum, '...d,vd->...v', x, self.embedding)
