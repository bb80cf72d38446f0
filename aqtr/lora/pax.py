"""LoRA and QLoRA on `aqtr.pax` templates: adapters injected by rules.

`aqtr.lora.attach(template, rules, *sample_inputs, variables=float_vars)`
(a Fiddle template of an `aqtr.pax` model) puts a `LoraEinsum` in the slot
of every weight einsum the rules select, as `aqtr.pax.inject` sets configs
(the rules match Pax op paths, layers, tags). The op computes

  y = base(x W) + dropout(x) A B * alpha / r

(LoRA, Hu et al. 2021, arXiv 2106.09685; QLoRA, Dettmers et al. 2023,
arXiv 2305.14314). The base weight `W` is frozen by the model's own
serving conversion (`aqtr.flax.linen.convert` of the op in CONVERT with
`LoraConfig.base`: the layer's float kernel becomes an empty
`aqtr.flax.frozen.FrozenBox` and the op reads its frozen entries from the
collection 'aqtr' in SERVE, stored compactly by `aqtr.lora.storage` — nf4 as
4-bit codes, double-quantized scales); a float base keeps the kernel. `A`
[contracted weight axes..., r] and `B` [r, output axes...] are params of
the op (`.../q_proj/einsum/lora_a_einsum`), so `aqtr.lora.partition` and
`optimizer` train them alone. The same forward trains and serves. The op
is `aqtr.lora.pax_op`; merging and sizes are `aqtr.lora.pax_merge`.

Example:
  >>> import jax, jax.numpy as jnp, aqtr.pax
  >>> from aqtr.lora.config import LoraConfig
  >>> t = aqtr.pax.templates.feed_forward(64, 128)
  >>> x = jnp.ones((2, 64))
  >>> v = jax.jit(fdl.build(t).init)(jax.random.key(0), x)
  >>> lt, lv = attach(t, {'wi': LoraConfig(rank=4, base='nf4')}, x,
  ...                 variables=v)
  >>> lv['params']['wi']['einsum']['lora_a_einsum'].shape
  (64, 4)
  >>> out = fdl.build(lt).apply(lv, x)  # B = 0: the nf4 base model
"""

from __future__ import annotations

import copy
import warnings

import fiddle as fdl
import flax
import jax
import jax.numpy as jnp
from fiddle import selectors

import aqtr.flax.linen as aqtr_linen
from aqtr.core import codecs
from aqtr.freezers import Mode, configure
from aqtr.lora import storage
from aqtr.lora.config import base_config
from aqtr.lora.pax_op import KEY, LoraEinsum, nodes, sites
from aqtr.lora.selection import (
  check_used,
  codebook_table,
  initial,
  lora_rules,
)
from aqtr.lora.session import adapter_names
from aqtr.pax import ops, paths

__all__ = ['attach', 'qvalue_ndim', 'tree_get', 'tree_put']


def _swap(template, pairs) -> None:
  """Puts a `LoraEinsum` in each matched op slot of `template` (in place)."""
  used: set[int] = set()
  hits: set[int] = set()
  n = 0
  for site in paths.find_ops(template):
    rule = next((i for i, (s, _) in enumerate(pairs) if s.matches(site)), None)
    if rule is None:
      continue
    if site.weight is False:
      hits.add(rule)
      continue
    label = f'aqtr.lora: {site.path} (rule {rule} {pairs[rule][0].label()})'
    if site.kind != 'einsum' or not issubclass(site.op_cls, ops.EinsumOp):
      raise ValueError(
        f'{label}: adapters go on weight einsums (aqtr.pax.EinsumOp), not '
        f'{site.op_cls.__name__}; exclude it from the LoRA rules.'
      )
    if site.weight is None:
      raise ValueError(
        f'{label}: the op is not tagged aqtr.pax.tags.WeightOp, so its rhs '
        'may not be a weight; adapters need a parameter.'
      )
    op = site.op
    old = None if op is None else op.__arguments__.get('config')
    if old is not None:
      raise ValueError(
        f'{label}: the op already has a config; the base format is '
        'LoraConfig.base: attach adapters to the float template.'
      )
    cfg = pairs[rule][1]
    base = base_config(cfg.base)
    node = fdl.Config(
      LoraEinsum,
      config=None if base is None else configure(base, rhs='weights'),
      mode=Mode.SERVE,
      lora=cfg,
      index=n,
      rng_stream='quant' if op is None else op.rng_stream,
    )
    site.replace(node)
    used.add(rule)
    n += 1
  check_used([sel for sel, _ in pairs], used, hits)


def tree_get(tree, path):
  """`tree[path[0]][path[1]]...`."""
  for k in path:
    tree = tree[k]
  return tree


def tree_put(tree, path, value) -> None:
  """Sets `tree[path[0]]...[path[-1]] = value`, making dicts on the way."""
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def qvalue_ndim(entries) -> int:
  """The rank of an op's frozen qvalue (the engine's tiled view)."""
  (entry,) = entries.values()
  parts = entry['rhs']
  return jnp.ndim(parts[codecs.packed_key(parts) or 'qvalue'])


def _convert(template, variables, args, kwargs):
  """The float `variables` with every quantized base frozen (CONVERT)."""
  twin = copy.deepcopy(template)
  quantized = False
  for node in selectors.select(twin, LoraEinsum):
    quantized |= node.config is not None
    node.mode = Mode.CONVERT
    fdl.update_callable(node, ops.EinsumOp, drop_invalid_args=True)
  variables = flax.core.unfreeze(variables)
  if not quantized:
    return variables
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)
    return flax.core.unfreeze(
      aqtr_linen.convert(fdl.build(twin), variables, *args, **kwargs)
    )


def attach(template, rules, *args, variables=None, seed: int = 0, **kwargs):
  """Adapters on the weight ops of a Pax template; bases frozen.

  Args:
    template: a float `aqtr.pax` model's Fiddle config (not changed).
    rules: as `aqtr.lora.attach` (`adapters.lora_rules`); the selectors
      match Pax op sites (dotted paths such as `layers[0].ffn.wi.einsum`,
      enclosing layer classes, tags).
    *args, **kwargs: sample inputs of one call.
    variables: the float variables (e.g. a pretrained checkpoint).
    seed: PRNG seed of the A matrices.

  Returns:
    (LoRA template, its variables): frozen bases in 'aqtr' (float kernels
    removed: empty `FrozenBox`es), adapters in 'params'.

  Raises:
    ValueError / TypeError: one line for a rule matching no weight op or
      only activation ops, an op that is not a weight einsum or already
      quantized, a rank above min(d_in, d_out), missing variables.
  """
  if variables is None or 'params' not in variables:
    raise TypeError(
      'aqtr.lora.attach: a Pax template needs variables= (its float '
      "variables, with 'params')."
    )
  pairs = lora_rules(rules)
  t = copy.deepcopy(template)
  paths.unshare(t)
  _swap(t, pairs)
  found = sites(t, *args, **kwargs)
  out = _convert(t, variables, args, kwargs)
  found_nodes = nodes(t)
  key = jax.random.key(seed)
  for ps in found:
    node, cfg = found_nodes[ps.index], ps.lora
    table = codebook_table(cfg)
    if node.config is not None and (table is not None or cfg.double_quant):
      raw = tree_get(out[aqtr_linen.FROZEN], ps.op_module)
      stored, shapes = storage.encode(
        {KEY: raw}, table, cfg.double_quant, qvalue_ndim(raw)
      )
      tree_put(out[aqtr_linen.FROZEN], ps.op_module, stored[KEY])
      node.table, node.scale_shapes = table, tuple(sorted(shapes.items()))
    k = jax.random.fold_in(key, ps.index)
    a, b = initial(k, ps, cfg.rank)
    names = adapter_names(ps)
    tree_put(out['params'], (*ps.op_module, names[0]), a)
    tree_put(out['params'], (*ps.op_module, names[1]), b)
  return t, out
