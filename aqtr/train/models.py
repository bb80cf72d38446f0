"""Models of the main job: Pax-style templates, quantized by injection.

A model is a Fiddle template of an `aqtr.pax` layer (float: every op field
unset). A run quantizes it without editing any layer code: `inject` gives
every weight contraction (ops tagged `aqtr.pax.tags.WeightOp`: attention
Q/K/V/O projections, feed-forward, logits; the weight is the rhs operand)
the run's DotGeneralConfig, through `aqtr.pax.inject` (except the blocks
a `HighPrecision` keeps float, `aqtr.train.high_precision`). Attention's
activation x activation einsums (QK^T, PV) stay float. The parameter tree
does not depend on the config, so every run starts from the same params.

`serving_template` turns an injected template into the same model whose
quantized weight ops are `aqtr.flax.linen.Einsum` ops in a freezer mode
(CONVERT / SERVE) with the 'weights' freezer on the rhs: the model that
`aqtr.flax.linen.convert` freezes and that serves from int8/fp8 weights.

Example:
  >>> import aqtr
  >>> from aqtr.train import models
  >>> t = models.lm(vocab_size=256, seq_len=16, d_model=32, num_layers=1,
  ...               num_heads=2)
  >>> cfg, report = models.inject(t, aqtr.presets.int8())
  >>> len(report.quantized_paths())
  7
"""

from __future__ import annotations

from collections.abc import Mapping

import fiddle as fdl
import flax.linen as nn
import jax
from fiddle import selectors

import aqtr
import aqtr.pax
from aqtr.pax import host as pax_host
from aqtr.ptq import fold
from aqtr.train.high_precision import HighPrecision

__all__ = [
  'build',
  'fold_map',
  'has_frozen_weights',
  'inject',
  'lm',
  'mlp',
  'relu',
  'serving_template',
]

Config = aqtr.DotGeneralConfig | None


def lm(
  vocab_size: int,
  seq_len: int,
  d_model: int = 128,
  num_layers: int = 2,
  num_heads: int = 4,
  mlp_ratio: int = 4,
) -> fdl.Config:
  """Decoder-only transformer LM template (`aqtr.pax.TransformerLm`).

  Untied embedding and softmax (the logits weight is then a plain weight
  that serving freezes), pre-LayerNorm blocks, GELU feed-forward.

  Args:
    vocab_size: number of tokens.
    seq_len: longest sequence (learned positions).
    d_model: model width.
    num_layers: transformer blocks.
    num_heads: attention heads.
    mlp_ratio: feed-forward hidden size / d_model.
  """
  return aqtr.pax.templates.transformer_lm(
    vocab_size,
    d_model,
    num_layers,
    num_heads,
    mlp_ratio * d_model,
    max_len=seq_len,
    tied=False,
    norm_kind='layer',
  )


def relu(x: jax.Array) -> jax.Array:
  """`jax.nn.relu` as a plain function (Fiddle can serialize a reference)."""
  return jax.nn.relu(x)


def mlp(num_classes: int, hidden: tuple[int, ...] = (256, 256)) -> fdl.Config:
  """MLP classifier template (`aqtr.pax.Mlp`, ReLU)."""
  return aqtr.pax.templates.mlp_classifier(
    num_classes, tuple(hidden), activation=relu
  )


def _is_float(config: Config) -> bool:
  return config is None or config.is_float


def inject(
  template: fdl.Config,
  config: Config,
  keep: HighPrecision | None = None,
) -> tuple[fdl.Config, aqtr.pax.InjectionReport]:
  """A copy of `template` with `config` on every weight contraction.

  Args:
    template: a float model template.
    config: the run's DotGeneralConfig (None or float: the float model).
    keep: blocks left float (`aqtr.train.high_precision`); None: none.

  Returns:
    (injected template, `aqtr.pax.InjectionReport`); `template` is left
    unchanged.
  """
  if _is_float(config):
    return aqtr.pax.inject(template, [])
  rules = [] if keep is None else keep.rules(template)
  rules.append(
    aqtr.pax.Rule(config, tag=aqtr.pax.tags.WeightOp, name='weights')
  )
  return aqtr.pax.inject(template, rules)


def build(template: fdl.Config) -> nn.Module:
  """The linen module of a template."""
  return fdl.build(template)


# The injected template with its weight ops frozen (`aqtr.pax.host`).
serving_template = pax_host.serving_template


def has_frozen_weights(injected: fdl.Config) -> bool:
  """Whether some op of `injected` quantizes its weight (rhs) operand."""
  return any(
    pax_host.frozen_config(node.__arguments__.get('config')) is not None
    for node in selectors.select(injected, aqtr.pax.EinsumOp)
  )


def fold_map(params: Mapping) -> fold.FoldMap:
  """The fold map of `aqtr.pax.TransformerLm` (`aqtr.train.models.lm`).

  Per layer: attention_norm (scale and bias) -> q/k/v_proj; v_proj
  (kernel columns and bias) -> o_proj; ffn_norm -> wi (and wi_gate);
  gated: wi -> wo, plain: wo follows the activation (GELU), unfolded.
  final_norm -> the untied `softmax` kernel (a tied table: `keep`).

  Args:
    params: the linen variables (`{'params': ...}`) or their 'params'.
  """
  root = 'params/' if 'params' in params else ''
  top = fold.get(params, root[:-1]) if root else params
  layers = fold.children(top, 'layers_')
  if not layers:
    raise ValueError(
      'models.fold_map: params have no "layers_<i>" (expected the variables of '
      'an aqtr.pax.TransformerLm).'
    )
  groups, unfolded = [], []
  for name in layers:
    lay = f'{root}{name}'
    att, ffn = f'{lay}/attention', f'{lay}/ffn'
    proj = lambda n: fold.Axis(path=f'{n}/kernel')  # noqa: E731
    groups.append(
      fold.FoldGroup(
        name=f'{lay}/attention_norm',
        sources=fold.norm_sources(f'{lay}/attention_norm', params),
        consumers=tuple(proj(f'{att}/{p}_proj') for p in 'qkv'),
      )
    )
    groups.append(
      fold.FoldGroup(
        name=f'{att}/v_proj',
        sources=fold.linear_sources(f'{att}/v_proj', params),
        consumers=(proj(f'{att}/o_proj'),),
        kind='linear',
      )
    )
    gated = 'wi_gate' in fold.get(params, ffn)
    ins = ('wi', 'wi_gate') if gated else ('wi',)
    groups.append(
      fold.FoldGroup(
        name=f'{lay}/ffn_norm',
        sources=fold.norm_sources(f'{lay}/ffn_norm', params),
        consumers=tuple(proj(f'{ffn}/{p}') for p in ins),
      )
    )
    if gated:
      groups.append(
        fold.FoldGroup(
          name=f'{ffn}/wi',
          sources=fold.linear_sources(f'{ffn}/wi', params),
          consumers=(proj(f'{ffn}/wo'),),
          kind='linear',
        )
      )
    else:
      unfolded.append(f'{ffn}/wo/kernel')
  if 'softmax' in top:
    groups.append(
      fold.FoldGroup(
        name=f'{root}final_norm',
        sources=fold.norm_sources(f'{root}final_norm', params),
        consumers=(fold.Axis(path=f'{root}softmax/kernel'),),
      )
    )
    keep = ()
  else:
    keep = (f'{root}embedding/embedding',)
  return fold.FoldMap(groups=tuple(groups), unfolded=tuple(unfolded), keep=keep)


def _is_pax_lm(params: Mapping) -> bool:
  top = params.get('params', params)
  return isinstance(top, Mapping) and bool(fold.children(top, 'layers_'))


fold.register(
  'pax_lm',
  lambda params, root, model: fold_map(params),
  model=aqtr.pax.TransformerLm,
  predicate=_is_pax_lm,
)
