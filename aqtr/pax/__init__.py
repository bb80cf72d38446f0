"""Pax-style layers configured by Fiddle, and selector-based quantization.

A small praxis-like layer family on Flax linen: every layer is built from a
Fiddle template (`aqtr.pax.templates`) and every tensor contraction is an
injectable op field (`EinsumOp`, `DotGeneralOp`, `ConvOp`; None = float).
`Decoder` generates from a `TransformerLm` through a fixed-size KV cache,
float or quantized (`KVCacheConfig`: int8 / int4 / fp8 codes + scales).
`inject` quantizes an existing model config by rules (layer class, dotted
path regex, or tag) without editing layer code, and reports which op got
which config; `mixed_precision_rules` reads MaxText-style per-layer JSON.

Import it explicitly (`import aqtr.pax`); it needs the `flax` extra.

Example:
  >>> import fiddle as fdl, aqtr.pax
  >>> cfg = aqtr.pax.templates.transformer_lm(
  ...   vocab_size=32, d_model=16, num_layers=2, num_heads=2, hidden_dim=32)
  >>> rule = aqtr.pax.Rule('int8', path=r'layers\\.0\\..*_proj')
  >>> cfg, report = aqtr.pax.inject(cfg, [rule])
  >>> report.quantized_paths()[-1]
  'layers[0].attention.o_proj.einsum'
  >>> print(report)  # doctest: +ELLIPSIS
  4/17 ops quantized
    embedding.einsum                   float  [unchanged]
    layers[0].attention.q_proj.einsum  int8  [rule 0]
  ...
"""

from aqtr import extras

try:  # Name the extra to install when one is missing.
  import flax  # noqa: F401
except ImportError as e:
  raise extras.missing('flax', 'aqtr.pax', e) from e

from aqtr.pax import (
  decode,
  kv_cache,
  mixed_precision,
  paths,
  tags,
  templates,
)
from aqtr.pax.attention import Attention
from aqtr.pax.classifier import Cnn, Conv, Mlp
from aqtr.pax.decode import Decoder, Sampling
from aqtr.pax.embedding import Embedding, SharedEmbeddingSoftmax, Softmax
from aqtr.pax.feedforward import FeedForward
from aqtr.pax.host import TemplateHost  # Registers Pax templates' host.
from aqtr.pax.inject import Rule, inject
from aqtr.pax.kv_cache import KVCacheConfig
from aqtr.pax.linear import Linear
from aqtr.pax.mixed_precision import mixed_precision_rules
from aqtr.pax.moe import MoeFeedForward
from aqtr.pax.ops import (
  ConvOp,
  DotGeneralOp,
  EinsumOp,
  Op,
  RaggedDotOp,
  needs_key,
)
from aqtr.pax.report import InjectionReport, describe
from aqtr.pax.transformer import Block, TransformerLm, next_token_loss

__all__ = [
  'Attention',
  'Block',
  'Cnn',
  'Conv',
  'ConvOp',
  'Decoder',
  'DotGeneralOp',
  'EinsumOp',
  'Embedding',
  'FeedForward',
  'InjectionReport',
  'KVCacheConfig',
  'Linear',
  'Mlp',
  'MoeFeedForward',
  'Op',
  'RaggedDotOp',
  'Rule',
  'Sampling',
  'SharedEmbeddingSoftmax',
  'Softmax',
  'TemplateHost',
  'TransformerLm',
  'decode',
  'describe',
  'inject',
  'kv_cache',
  'mixed_precision',
  'mixed_precision_rules',
  'needs_key',
  'next_token_loss',
  'paths',
  'tags',
  'templates',
]
