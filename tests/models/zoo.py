"""Real third-party Flax models at toy size (the `models` extra).

Each entry builds a linen module from another project's model code
(Hugging Face `transformers` Flax models, DeepMind's `gemma` and
`recurrentgemma`), randomly initialised from a small config (no weight
download), behind a thin linen wrapper that fixes the call convention to
one input array: token ids (B, T) for the LMs, images (B, H, W, C) for
ViT. The wrapper adds the masks and positions the model code asks for and
returns the logits; every parameter and op is the third party's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

B, T, VOCAB, D, LAYERS, HEADS = 2, 16, 128, 64, 2, 4
IMG = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Zoo:
  """One real model: how to build it and a sample input.

  Attributes:
    name: the test id.
    package: the module that must import for the model to exist.
    build: () -> an unbound linen module taking one array.
    image: the input is an image batch (else token ids).
    mqa: the attention broadcasts one KV head over the query heads.
    remat: the blocks run under `nn.remat` (the gradient recomputes them).
    blocks: a path regex of the blocks' weight ops (PTQ and LoRA targets,
      as a user picks them: not the embedding or head, nor Griffin's
      per-head gates, which PTQ and LoRA refuse).
  """

  name: str
  package: str
  build: Callable[[], nn.Module]
  image: bool = False
  mqa: bool = False
  remat: bool = False
  blocks: str = ''

  def available(self) -> bool:
    """Whether the model's package is installed."""
    try:
      return importlib.util.find_spec(self.package) is not None
    except ModuleNotFoundError:  # Its parent package is missing.
      return False

  def sample(self, seed: int = 0, batch: int = B) -> jax.Array:
    """One input batch (deterministic in `seed`)."""
    key = jax.random.key(seed)
    if self.image:
      return jax.random.normal(key, (batch, IMG, IMG, 3))
    return jax.random.randint(key, (batch, T), 0, VOCAB)


def loss(z: Zoo, logits: jax.Array, x: jax.Array) -> jax.Array:
  """Next-token cross entropy (images: fixed labels per example)."""
  if z.image:
    labels = jnp.arange(logits.shape[0]) % logits.shape[-1]
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()
  return optax.softmax_cross_entropy_with_integer_labels(
    logits[:, :-1], x[:, 1:]
  ).mean()


def fit_adapters(z: Zoo, lm, lv, x, steps: int = 5, lr: float = 1e-2):
  """`steps` Adam steps on a LoRA linen model's adapters (`aqtr.lora`).

  Returns:
    (the trained variables, the loss before each step).
  """
  import aqtr.lora as lora  # noqa: PLC0415 (only for LoRA callers)

  ad, frozen = lora.partition(lv['params'])
  tx = optax.adam(lr)

  @jax.jit
  def step(ad, opt):
    def fn(ad):
      return loss(z, lm.apply({'params': lora.combine(ad, frozen)}, x), x)

    value, g = jax.value_and_grad(fn)(ad)
    upd, opt = tx.update(g, opt, ad)
    return optax.apply_updates(ad, upd), opt, value

  opt, values = tx.init(ad), []
  for _ in range(steps):
    ad, opt, value = step(ad, opt)
    values.append(float(value))
  return {**lv, 'params': lora.combine(ad, frozen)}, values


class HfLm(nn.Module):
  """A Hugging Face Flax causal LM module called on token ids alone."""

  inner: nn.Module
  positions: bool = True

  def __call__(self, ids):
    mask = jnp.ones_like(ids)
    args = (ids, mask)
    if self.positions:
      args += (jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape),)
    return self.inner(*args, return_dict=False)[0]


class HfVit(nn.Module):
  """A Hugging Face Flax ViT classifier module called on NHWC images."""

  inner: nn.Module

  def __call__(self, images):
    return self.inner(images, return_dict=False)[0]


class GemmaLm(nn.Module):
  """DeepMind `gemma` Transformer called on token ids (causal, no cache)."""

  inner: nn.Module

  def __call__(self, ids):
    t = ids.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t), ids.shape)
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = jnp.broadcast_to(causal, (ids.shape[0], t, t))
    return self.inner(ids, pos, None, mask)[0]


class GriffinLm(nn.Module):
  """DeepMind `recurrentgemma` Griffin called on token ids (no cache)."""

  inner: nn.Module

  def __call__(self, ids):
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return self.inner(ids, pos, return_cache=False)[0]


def _hf_llama_kw():
  return dict(
    vocab_size=VOCAB,
    hidden_size=D,
    intermediate_size=2 * D,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    max_position_embeddings=2 * T,
  )


def _hf(model: str, **config) -> nn.Module:
  import transformers  # noqa: PLC0415 (optional extra)

  cfg_cls, cls = {
    'llama': (transformers.LlamaConfig, transformers.FlaxLlamaForCausalLM),
    'mistral': (
      transformers.MistralConfig,
      transformers.FlaxMistralForCausalLM,
    ),
    'gpt2': (transformers.GPT2Config, transformers.FlaxGPT2LMHeadModel),
    'opt': (transformers.OPTConfig, transformers.FlaxOPTForCausalLM),
    'bloom': (transformers.BloomConfig, transformers.FlaxBloomForCausalLM),
    'vit': (
      transformers.ViTConfig,
      transformers.FlaxViTForImageClassification,
    ),
  }[model]
  inner = cls(cfg_cls(**config), _do_init=False).module
  if model == 'vit':
    return HfVit(inner)
  return HfLm(inner, positions=model != 'bloom')


def _gemma(version: int) -> nn.Module:
  from gemma import modules, transformer  # noqa: PLC0415

  local, glob = (
    modules.AttentionType.LOCAL_SLIDING,
    modules.AttentionType.GLOBAL,
  )
  common = dict(
    num_layers=LAYERS,
    num_embed=VOCAB,
    embed_dim=D,
    hidden_dim=2 * D,
    num_heads=HEADS,
    head_dim=D // HEADS,
    max_cache_length=None,
    sliding_window_size=T // 2,
    attention_types=(local, glob),
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    transpose_gating_einsum=True,
  )
  if version == 2:  # Gemma 2: GQA, soft caps.
    cfg = transformer.TransformerConfig(
      **common,
      num_kv_heads=HEADS // 2,
      final_logit_softcap=30.0,
      attn_logits_soft_cap=50.0,
      query_pre_attn_norm=transformer.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS,
    )
  else:  # Gemma 3 (1B's text stack): one KV head, QK norm, two RoPE bases.
    cfg = transformer.TransformerConfig(
      **common,
      num_kv_heads=1,
      final_logit_softcap=None,
      use_qk_norm=True,
      local_base_frequency=10_000,
      global_base_frequency=1_000_000,
    )
  return GemmaLm(transformer.Transformer(cfg))


def _griffin() -> nn.Module:
  from recurrentgemma import jax as rg  # noqa: PLC0415

  kinds = rg.TemporalBlockType
  cfg = rg.GriffinConfig(
    vocab_size=VOCAB,
    width=D,
    mlp_expanded_width=2 * D,
    num_heads=HEADS,
    lru_width=D,
    block_types=(kinds.RECURRENT, kinds.ATTENTION),
    embeddings_scale_by_sqrt_dim=True,
    attention_window_size=T // 2,
    logits_soft_cap=30.0,
  )
  return GriffinLm(rg.Griffin(cfg))


_P = functools.partial
MODELS = (
  Zoo(
    name='hf_llama_gqa',
    package='transformers',
    build=_P(_hf, 'llama', **_hf_llama_kw(), num_key_value_heads=2),
    blocks='inner/model/layers/.*',
  ),
  Zoo(
    name='hf_llama_mqa',
    package='transformers',
    build=_P(_hf, 'llama', **_hf_llama_kw(), num_key_value_heads=1),
    blocks='inner/model/layers/.*',
    mqa=True,
  ),
  Zoo(
    name='hf_mistral',
    package='transformers',
    build=_P(
      _hf,
      'mistral',
      **_hf_llama_kw(),
      num_key_value_heads=2,
      sliding_window=T // 2,
    ),
    blocks='inner/model/layers/.*',
  ),
  Zoo(
    name='hf_gpt2',
    package='transformers',
    build=_P(
      _hf,
      'gpt2',
      vocab_size=VOCAB,
      n_embd=D,
      n_layer=LAYERS,
      n_head=HEADS,
      n_positions=2 * T,
    ),
    blocks='inner/transformer/h/.*',
  ),
  Zoo(
    name='hf_opt',
    package='transformers',
    build=_P(
      _hf,
      'opt',
      vocab_size=VOCAB,
      hidden_size=D,
      ffn_dim=2 * D,
      num_hidden_layers=LAYERS,
      num_attention_heads=HEADS,
      max_position_embeddings=2 * T,
      word_embed_proj_dim=D,
    ),
    blocks='inner/model/decoder/layers/.*',
  ),
  Zoo(
    name='hf_bloom',
    package='transformers',
    build=_P(
      _hf,
      'bloom',
      vocab_size=VOCAB,
      hidden_size=D,
      n_layer=LAYERS,
      n_head=HEADS,
    ),
    blocks='inner/transformer/h/.*',
  ),
  Zoo(
    name='hf_vit',
    package='transformers',
    build=_P(
      _hf,
      'vit',
      image_size=IMG,
      patch_size=4,
      hidden_size=D,
      intermediate_size=2 * D,
      num_hidden_layers=LAYERS,
      num_attention_heads=HEADS,
      num_labels=10,
    ),
    blocks='inner/vit/encoder/.*',
    image=True,
  ),
  Zoo(
    name='gemma2',
    package='gemma.transformer',
    build=_P(_gemma, 2),
    blocks='inner/layer_.*',
  ),
  Zoo(
    name='gemma3',
    package='gemma.transformer',
    build=_P(_gemma, 3),
    mqa=True,
    blocks='inner/layer_.*',
  ),
  Zoo(
    name='griffin',
    package='recurrentgemma.jax',
    build=_griffin,
    mqa=True,
    remat=True,
    blocks=(
      r'inner/blocks\.\d+/'
      r'(mlp_block|attention_block|recurrent_block/linear_\w+)/.*'
    ),
  ),
)
