"""Fold maps of third-party Flax LMs (AWQ, SmoothQuant): HF, Gemma.

Registered by class name (`aqtr.ptq.fold.register`; importing this
module does not import `transformers`), so `aqtr.ptq.quantize(model,
rules, batches, method='awq')` finds them for a linen model that is, or
holds in a field, one of these modules:

  Llama, Mistral  input_layernorm -> q/k/v_proj; v_proj -> o_proj
                  (grouped-query attention: o reads each v channel
                  heads / kv_heads times); post_attention_layernorm ->
                  gate/up_proj; up_proj -> down_proj (SwiGLU is linear
                  in up)
  GPT-2           ln_1 -> attn/c_attn; ln_2 -> mlp/c_fc (Conv1D kernels
                  are [out, in]: their input axis is 1); c_proj after the
                  attention (v is a slice of c_attn) and after the GELU
                  stay without a fold
  OPT             self_attn_layer_norm -> q/k/v_proj; v_proj -> out_proj;
                  final_layer_norm -> fc1; fc1 -> fc2 when the activation
                  is ReLU (relu(x / s) = relu(x) / s for s > 0)
  BLOOM           input_layernorm -> self_attention/query_key_value;
                  post_attention_layernorm -> mlp/dense_h_to_4h; dense
                  and dense_4h_to_h (after the attention and the GELU)
                  are unfolded

  Gemma (DeepMind `gemma`, Gemma 2 / 3)
                  pre_attention_norm -> q/kv_einsum (or qkv_einsum);
                  pre_ffw_norm -> mlp/gating_einsum (its RMSNorm reads
                  `1 + scale`: `Axis.offset`); mlp/linear (after the
                  gated GELU) is unfolded

Post-norm variants (OPT with `do_layer_norm_before=False`, BLOOM with
`apply_residual_connection_post_layernorm=True`) feed the normed value to
the residual too: no fold is exact there, so they are refused in one line.
The output heads (tied or not) get no fold: PTQ rules usually leave them
float.

Example:
  >>> from aqtr.ptq import fold
  >>> 'hf_llama' in fold.names()
  True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aqtr.ptq import fold

__all__ = ['bloom', 'gemma', 'gpt2', 'llama', 'opt']

_HF = 'transformers.models'


def _layers(params: Mapping, root: str, inner: tuple[str, ...]) -> list[str]:
  """'/'-joined paths of the decoder layers under `root` (first found)."""
  for sub in inner:
    path = '/'.join(p for p in (root, sub) if p)
    try:
      node = fold.get(params, path)
    except KeyError:
      continue
    keys = sorted((k for k in node if str(k).isdigit()), key=int)
    if keys:
      return [f'{path}/{k}' for k in keys]
  raise ValueError(
    f'fold: no decoder layers under {root or "<root>"!r} at any of {inner}.'
  )


def _norm(name: str, params: Mapping, consumers, axis: int = 0):
  return fold.FoldGroup(
    name=name,
    sources=fold.norm_sources(name, params),
    consumers=tuple(
      fold.Axis(path=f'{c}/kernel', axis=axis) for c in consumers
    ),
  )


def _linear(src: str, params: Mapping, dst: fold.Axis) -> fold.FoldGroup:
  return fold.FoldGroup(
    name=src,
    sources=fold.linear_sources(src, params),
    consumers=(dst,),
    kind='linear',
  )


def llama(params: Mapping, root: str = '', model: Any = None) -> fold.FoldMap:
  """The fold map of a Flax Llama / Mistral (causal LM or bare model).

  Args:
    params: the linen variables.
    root: the path of the model's parameters in `params`.
    model: the module (its `config` gives the heads); None: o_proj is
      folded only when q and v have the same width.
  """
  cfg = getattr(model, 'config', None)
  heads = getattr(cfg, 'num_attention_heads', None)
  groups = []
  for lay in _layers(params, root, ('model/layers', 'layers')):
    att, mlp = f'{lay}/self_attn', f'{lay}/mlp'
    qkv = [f'{att}/{p}_proj' for p in 'qkv']
    groups.append(_norm(f'{lay}/input_layernorm', params, qkv))
    d_q = fold.get(params, f'{att}/q_proj/kernel').shape[1]
    d_kv = fold.get(params, f'{att}/v_proj/kernel').shape[1]
    o = f'{att}/o_proj/kernel'
    if d_q == d_kv:
      groups.append(_linear(f'{att}/v_proj', params, fold.Axis(path=o)))
    elif heads and d_q % heads == 0 and d_q % d_kv == 0:
      ax = fold.Axis(path=o, repeat=d_q // d_kv, inner=d_q // heads)
      groups.append(_linear(f'{att}/v_proj', params, ax))
    mlp_in = [f'{mlp}/gate_proj', f'{mlp}/up_proj']
    groups.append(_norm(f'{lay}/post_attention_layernorm', params, mlp_in))
    down = fold.Axis(path=f'{mlp}/down_proj/kernel')
    groups.append(_linear(f'{mlp}/up_proj', params, down))
  return fold.FoldMap(groups=tuple(groups))


def gpt2(params: Mapping, root: str = '', model: Any = None) -> fold.FoldMap:
  """The fold map of a Flax GPT-2 (LM head model or bare model)."""
  del model
  groups = []
  for lay in _layers(params, root, ('transformer/h', 'h')):
    groups.append(_norm(f'{lay}/ln_1', params, [f'{lay}/attn/c_attn'], 1))
    groups.append(_norm(f'{lay}/ln_2', params, [f'{lay}/mlp/c_fc'], 1))
  return fold.FoldMap(groups=tuple(groups))


def _refuse_post_norm(name: str, post: bool) -> None:
  if post:
    raise ValueError(
      f'fold: {name} normalises after the residual (post-norm): no exact '
      'fold exists; pass fold_map= or use method rtn / gptq.'
    )


def opt(params: Mapping, root: str = '', model: Any = None) -> fold.FoldMap:
  """The fold map of a pre-norm Flax OPT (causal LM or bare model)."""
  cfg = getattr(model, 'config', None)
  _refuse_post_norm('OPT', not getattr(cfg, 'do_layer_norm_before', True))
  relu = getattr(cfg, 'activation_function', None) == 'relu'
  groups, unfolded = [], []
  inner = ('model/decoder/layers', 'decoder/layers', 'layers')
  for lay in _layers(params, root, inner):
    att = f'{lay}/self_attn'
    qkv = [f'{att}/{p}_proj' for p in 'qkv']
    groups.append(_norm(f'{lay}/self_attn_layer_norm', params, qkv))
    out = fold.Axis(path=f'{att}/out_proj/kernel')
    groups.append(_linear(f'{att}/v_proj', params, out))
    groups.append(_norm(f'{lay}/final_layer_norm', params, [f'{lay}/fc1']))
    if relu:
      fc2 = fold.Axis(path=f'{lay}/fc2/kernel')
      groups.append(_linear(f'{lay}/fc1', params, fc2))
    else:
      unfolded.append(f'{lay}/fc2/kernel')
  return fold.FoldMap(groups=tuple(groups), unfolded=tuple(unfolded))


def bloom(params: Mapping, root: str = '', model: Any = None) -> fold.FoldMap:
  """The fold map of a pre-norm Flax BLOOM (causal LM or bare model)."""
  cfg = getattr(model, 'config', None)
  _refuse_post_norm(
    'BLOOM',
    bool(getattr(cfg, 'apply_residual_connection_post_layernorm', False)),
  )
  groups, unfolded = [], []
  for lay in _layers(params, root, ('transformer/h', 'h')):
    att, mlp = f'{lay}/self_attention', f'{lay}/mlp'
    qkv = [f'{att}/query_key_value']
    groups.append(_norm(f'{lay}/input_layernorm', params, qkv))
    h4 = [f'{mlp}/dense_h_to_4h']
    groups.append(_norm(f'{lay}/post_attention_layernorm', params, h4))
    unfolded += [f'{att}/dense/kernel', f'{mlp}/dense_4h_to_h/kernel']
  return fold.FoldMap(groups=tuple(groups), unfolded=tuple(unfolded))


def gemma(params: Mapping, root: str = '', model: Any = None) -> fold.FoldMap:
  """The fold map of a DeepMind `gemma` Transformer (linen)."""
  del model
  top = fold.get(params, root) if root else params
  layers = fold.children(top, 'layer_')
  if not layers:
    raise ValueError(f'fold: no "layer_<i>" under {root or "<root>"!r}.')
  groups, unfolded = [], []
  for name in layers:
    lay = '/'.join(p for p in (root, name) if p)
    att = fold.get(params, f'{lay}/attn')
    if 'qkv_einsum' in att:  # [3, heads, D, head_dim]
      ins = (fold.Axis(path=f'{lay}/attn/qkv_einsum/w', axis=2),)
    else:  # q: [heads, D, head_dim]; kv: [2, kv_heads, D, head_dim]
      ins = (
        fold.Axis(path=f'{lay}/attn/q_einsum/w', axis=1),
        fold.Axis(path=f'{lay}/attn/kv_einsum/w', axis=2),
      )
    for norm, consumers in (
      ('pre_attention_norm', ins),
      ('pre_ffw_norm', (fold.Axis(path=f'{lay}/mlp/gating_einsum', axis=-1),)),
    ):
      src = fold.Axis(path=f'{lay}/{norm}/scale', offset=1.0)
      groups.append(
        fold.FoldGroup(
          name=f'{lay}/{norm}', sources=(src,), consumers=consumers
        )
      )
    unfolded.append(f'{lay}/mlp/linear')
  return fold.FoldMap(groups=tuple(groups), unfolded=tuple(unfolded))


for _name, _build, _classes in (
  (
    'hf_llama',
    llama,
    (
      'llama.modeling_flax_llama.FlaxLlamaForCausalLMModule',
      'llama.modeling_flax_llama.FlaxLlamaModule',
    ),
  ),
  (
    'hf_mistral',
    llama,
    (
      'mistral.modeling_flax_mistral.FlaxMistralForCausalLMModule',
      'mistral.modeling_flax_mistral.FlaxMistralModule',
    ),
  ),
  (
    'hf_gpt2',
    gpt2,
    (
      'gpt2.modeling_flax_gpt2.FlaxGPT2LMHeadModule',
      'gpt2.modeling_flax_gpt2.FlaxGPT2Module',
    ),
  ),
  (
    'hf_opt',
    opt,
    (
      'opt.modeling_flax_opt.FlaxOPTForCausalLMModule',
      'opt.modeling_flax_opt.FlaxOPTModule',
    ),
  ),
  (
    'hf_bloom',
    bloom,
    (
      'bloom.modeling_flax_bloom.FlaxBloomForCausalLMModule',
      'bloom.modeling_flax_bloom.FlaxBloomModule',
    ),
  ),
):
  for _i, _cls in enumerate(_classes):
    fold.register(
      _name if _i == 0 else f'{_name}_base', _build, model=f'{_HF}.{_cls}'
    )
fold.register('gemma', gemma, model='gemma.transformer.Transformer')
