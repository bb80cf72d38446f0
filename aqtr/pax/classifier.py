"""Small-data classifiers: an MLP and a CNN with injectable contractions.

  Conv  2-D convolution (NHWC input, HWIO kernel) through a `ConvOp`
  Mlp   flatten -> Linear -> act -> ... -> Linear (logits)
  Cnn   [Conv -> act -> avg-pool] * n -> Mlp head

Example:
  >>> import fiddle as fdl, jax, jax.numpy as jnp
  >>> from aqtr.pax import templates
  >>> cnn = fdl.build(templates.cnn_classifier(num_classes=3, channels=(4,)))
  >>> x = jnp.ones((2, 8, 8, 1))
  >>> params = jax.eval_shape(cnn.init, jax.random.key(0), x)
  >>> jax.eval_shape(cnn.apply, params, x).shape
  (2, 3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated

import flax.linen as nn
import jax

from aqtr.pax import ops, tags
from aqtr.pax.linear import Initializer, Linear, add_bias

__all__ = ['Cnn', 'Conv', 'Mlp']

Activation = Callable[[jax.Array], jax.Array]


class Conv(nn.Module):
  """2-D convolution, NHWC input and HWIO kernel, through an op field.

  Attributes:
    features: output channels.
    kernel_size: spatial window (height, width).
    strides: spatial strides.
    padding: 'SAME', 'VALID' or explicit pads, as in lax.
    conv: the injectable op (tagged `WeightOp`; the kernel is its rhs).
    use_bias: add a learned bias per output channel.
    kernel_init: initializer of the kernel.
  """

  features: int
  kernel_size: Sequence[int] = (3, 3)
  strides: Sequence[int] = (1, 1)
  padding: str | Sequence[tuple[int, int]] = 'SAME'
  conv: Annotated[ops.ConvOp | None, tags.WeightOp] = None
  use_bias: bool = True
  kernel_init: Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[batch, height, width, channels] -> [batch, h', w', features]."""
    shape = (*self.kernel_size, x.shape[-1], self.features)
    k = self.param('kernel', self.kernel_init, shape)
    y = ops.conv(
      self.conv,
      x,
      k,
      tuple(self.strides),
      self.padding,
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
    )
    if self.use_bias:
      b = self.param('bias', nn.initializers.zeros_init(), (self.features,))
      y = add_bias(y, b)
    return y


class Mlp(nn.Module):
  """Flattens all but the batch axis, then Linear layers with `activation`.

  Attributes:
    layers: the Linear layers; the last one gives the logits.
    activation: applied between layers (not after the last).
  """

  layers: Sequence[Linear]
  activation: Activation = jax.nn.relu

  def __call__(self, x: jax.Array) -> jax.Array:
    """[batch, ...] -> [batch, last features]."""
    x = x.reshape(x.shape[0], -1)
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i + 1 < len(self.layers):
        x = self.activation(x)
    return x


class Cnn(nn.Module):
  """Conv stages (conv, activation, `pool` x `pool` average pool), then a head.

  Attributes:
    convs: the convolution layers.
    head: the classifier on the flattened features (e.g. an `Mlp`).
    activation: applied after each convolution.
    pool: average-pool window and stride after each stage (1: none).
  """

  convs: Sequence[Conv]
  head: nn.Module
  activation: Activation = jax.nn.relu
  pool: int = 2

  def __call__(self, x: jax.Array) -> jax.Array:
    """[batch, height, width, channels] -> logits [batch, classes]."""
    for conv in self.convs:
      x = self.activation(conv(x))
      if self.pool > 1:
        window = (self.pool, self.pool)
        x = nn.avg_pool(x, window, strides=window)
    return self.head(x)
