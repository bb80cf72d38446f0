"""Fiddle templates of the Pax-style layers, every op node spelled out.

Each function returns an `fdl.Config` tree; `fdl.build` turns it into linen
modules. Every contraction op is an explicit `fdl.Config(EinsumOp)` (or
`ConvOp`) node, because Fiddle selectors cannot see field defaults, so
`selectors.select(cfg, aqtr.pax.EinsumOp)` and `aqtr.pax.inject` reach them all.

Template reuse: `transformer_lm` clones one block template into
`num_layers` distinct nodes (`repeat`), so each layer can be edited on its
own afterwards (`cfg.layers[0]`, rule path `layers\\.0\\..*`).

Example:
  >>> import aqtr.pax
  >>> from fiddle import selectors
  >>> cfg = transformer_lm(vocab_size=32, d_model=16, num_layers=2,
  ...                      num_heads=2, hidden_dim=32)
  >>> len(list(selectors.select(cfg, aqtr.pax.EinsumOp)))
  17
  >>> cfg.layers[0] is cfg.layers[1]
  False
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fiddle as fdl
import flax.linen as nn
import jax

from aqtr.pax.attention import Attention
from aqtr.pax.classifier import Cnn, Conv, Mlp
from aqtr.pax.embedding import Embedding, SharedEmbeddingSoftmax, Softmax
from aqtr.pax.feedforward import FeedForward
from aqtr.pax.linear import Linear
from aqtr.pax.moe import MoeFeedForward
from aqtr.pax.ops import ConvOp, EinsumOp, RaggedDotOp
from aqtr.pax.transformer import Block, TransformerLm

__all__ = [
  'attention',
  'block',
  'cnn_classifier',
  'feed_forward',
  'linear',
  'mlp_classifier',
  'moe_feed_forward',
  'norm',
  'repeat',
  'transformer_lm',
]

T = TypeVar('T')


def repeat(template: T, n: int) -> list[T]:
  """`n` independent deep copies of `template` (no node shared).

  Args:
    template: any Fiddle config (or value).
    n: number of copies.

  Returns:
    A list of `n` deep copies; editing one never changes another.

  Example:
    >>> import fiddle as fdl
    >>> a, b = repeat(linear(4), 2)
    >>> a.einsum is b.einsum
    False
  """
  return [copy.deepcopy(template) for _ in range(n)]


def linear(
  features: int, *, use_bias: bool = True, kernel_init: Any = None
) -> fdl.Config[Linear]:
  """A `Linear` with its einsum op node.

  Example:
    >>> linear(8).einsum.config is None
    True
  """
  cfg = fdl.Config(
    Linear, features=features, einsum=fdl.Config(EinsumOp), use_bias=use_bias
  )
  if kernel_init is not None:
    cfg.kernel_init = kernel_init
  return cfg


def norm(kind: str = 'rms') -> fdl.Config[nn.Module]:
  """An `nn.RMSNorm` ('rms') or `nn.LayerNorm` ('layer') config.

  Example:
    >>> norm('layer').__fn_or_cls__.__name__
    'LayerNorm'
  """
  kinds = {'rms': nn.RMSNorm, 'layer': nn.LayerNorm}
  if kind not in kinds:
    raise ValueError(f'norm kind must be one of {sorted(kinds)}, got {kind!r}.')
  return fdl.Config(kinds[kind])


def feed_forward(
  d_model: int,
  hidden_dim: int,
  *,
  gated: bool = False,
  activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
) -> fdl.Config[FeedForward]:
  """A `FeedForward` d_model -> hidden_dim -> d_model, optionally gated.

  Example:
    >>> feed_forward(8, 32, gated=True).wi_gate.features
    32
  """
  return fdl.Config(
    FeedForward,
    wi=linear(hidden_dim),
    wo=linear(d_model),
    wi_gate=linear(hidden_dim) if gated else None,
    activation=activation,
  )


def moe_feed_forward(
  d_model: int,
  hidden_dim: int,
  *,
  num_experts: int,
  top_k: int = 2,
  gated: bool = False,
  activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
) -> fdl.Config[MoeFeedForward]:
  """A `MoeFeedForward` with `num_experts` experts and every op node.

  Use it as a block's `ffn` (`block(...).ffn = moe_feed_forward(...)`).

  Example:
    >>> moe_feed_forward(8, 32, num_experts=4).router.features
    4
  """
  return fdl.Config(
    MoeFeedForward,
    num_experts=num_experts,
    hidden_dim=hidden_dim,
    router=linear(num_experts, use_bias=False),
    wi=fdl.Config(RaggedDotOp),
    wo=fdl.Config(RaggedDotOp),
    wi_gate=fdl.Config(RaggedDotOp) if gated else None,
    top_k=top_k,
    gated=gated,
    activation=activation,
  )


def attention(
  d_model: int,
  num_heads: int,
  *,
  head_dim: int | None = None,
  causal: bool = True,
) -> fdl.Config[Attention]:
  """An `Attention` with Q/K/V/O projections and both einsum op nodes.

  Args:
    d_model: model width.
    num_heads: number of heads.
    head_dim: per-head size (default d_model // num_heads).
    causal: mask future positions.

  Returns:
    The attention config.

  Example:
    >>> attention(16, 4).q_proj.features
    16
  """
  if head_dim is None:
    if d_model % num_heads:
      raise ValueError(
        f'attention: d_model={d_model} is not divisible by num_heads='
        f'{num_heads}; pass head_dim.'
      )
    head_dim = d_model // num_heads
  inner = num_heads * head_dim
  return fdl.Config(
    Attention,
    q_proj=linear(inner),
    k_proj=linear(inner),
    v_proj=linear(inner),
    o_proj=linear(d_model),
    num_heads=num_heads,
    qk_einsum=fdl.Config(EinsumOp),
    pv_einsum=fdl.Config(EinsumOp),
    causal=causal,
  )


def block(
  d_model: int,
  num_heads: int,
  hidden_dim: int,
  *,
  gated: bool = False,
  norm_kind: str = 'rms',
) -> fdl.Config[Block]:
  """A pre-norm transformer `Block` template.

  Example:
    >>> block(16, 2, 64).ffn.wi.features
    64
  """
  return fdl.Config(
    Block,
    attention=attention(d_model, num_heads),
    ffn=feed_forward(d_model, hidden_dim, gated=gated),
    attention_norm=norm(norm_kind),
    ffn_norm=norm(norm_kind),
  )


def transformer_lm(
  vocab_size: int,
  d_model: int,
  num_layers: int,
  num_heads: int,
  hidden_dim: int,
  max_len: int = 512,
  *,
  tied: bool = True,
  gated: bool = False,
  norm_kind: str = 'rms',
  block_template: fdl.Config[Block] | None = None,
) -> fdl.Config[TransformerLm]:
  """A decoder-only `TransformerLm`; its blocks are clones of one template.

  Args:
    vocab_size: number of tokens.
    d_model: model width.
    num_layers: number of blocks.
    num_heads: attention heads per block.
    hidden_dim: feed-forward hidden size.
    max_len: longest sequence (learned positions).
    tied: one table for embedding and softmax (`SharedEmbeddingSoftmax`),
      else `Embedding` + `Softmax`.
    gated: gated feed-forward.
    norm_kind: 'rms' or 'layer'.
    block_template: the block to clone (default `block(...)` from the
      sizes above); each layer gets its own deep copy.

  Returns:
    The LM config with `layers` a list of `num_layers` distinct blocks.

  Example:
    >>> cfg = transformer_lm(64, 16, 2, 2, 32, tied=False)
    >>> cfg.softmax.einsum.config is None, len(cfg.layers)
    (True, 2)
  """
  tpl = block_template or block(
    d_model, num_heads, hidden_dim, gated=gated, norm_kind=norm_kind
  )
  if tied:
    embedding = fdl.Config(
      SharedEmbeddingSoftmax,
      num_classes=vocab_size,
      features=d_model,
      einsum=fdl.Config(EinsumOp),
    )
    softmax = None
  else:
    embedding = fdl.Config(
      Embedding, num_embeddings=vocab_size, features=d_model
    )
    softmax = fdl.Config(
      Softmax, num_classes=vocab_size, einsum=fdl.Config(EinsumOp)
    )
  return fdl.Config(
    TransformerLm,
    embedding=embedding,
    layers=repeat(tpl, num_layers),
    final_norm=norm(norm_kind),
    softmax=softmax,
    max_len=max_len,
  )


def mlp_classifier(
  num_classes: int,
  hidden: Sequence[int] = (64,),
  *,
  activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
) -> fdl.Config[Mlp]:
  """An `Mlp` classifier: hidden Linear layers, then the logits layer.

  Example:
    >>> [layer.features for layer in mlp_classifier(10, (32, 16)).layers]
    [32, 16, 10]
  """
  sizes = [*hidden, num_classes]
  return fdl.Config(
    Mlp, layers=[linear(n) for n in sizes], activation=activation
  )


def cnn_classifier(
  num_classes: int,
  channels: Sequence[int] = (8, 16),
  *,
  kernel_size: Sequence[int] = (3, 3),
  hidden: Sequence[int] = (),
  pool: int = 2,
) -> fdl.Config[Cnn]:
  """A `Cnn` classifier: conv stages, then an `Mlp` head.

  Example:
    >>> cfg = cnn_classifier(10, (4, 8))
    >>> [c.features for c in cfg.convs], cfg.convs[0].conv.config
    ([4, 8], None)
  """
  convs = [
    fdl.Config(
      Conv, features=c, kernel_size=tuple(kernel_size), conv=fdl.Config(ConvOp)
    )
    for c in channels
  ]
  return fdl.Config(
    Cnn, convs=convs, head=mlp_classifier(num_classes, hidden), pool=pool
  )
