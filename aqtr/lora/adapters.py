"""Low-rank adapters on a stock Flax model's weight ops, by rules.

`attach(model, rules, *sample_inputs)` takes a float linen or nnx model and
returns one whose matched weight ops compute

  y = base(x) + dropout(x) A B * alpha / r

(LoRA, Hu et al. 2021, arXiv 2106.09685; QLoRA, Dettmers et al. 2023,
arXiv 2305.14314). The ops are caught as `aqtr.flax.quantize` catches them
(`aqtr.flax.intercept`; the weight is the operand that is a parameter of
the module running the op). The base weight is frozen by
`aqtr.flax.convert` with the rule's `LoraConfig.base` (nf4 / int4 / int8:
the holder replaces the float kernel, stored compactly by
`aqtr.lora.storage`; float: the kernel stays) and its dot runs through
aqtr's engine in SERVE (the real low-bit dot where the numerics has one).
`A` [contracted weight axes..., r] starts Kaiming-uniform
(bound 1/sqrt(d_in)), `B` [r, output axes...] at zero; both live next to
the kernel in the module (linen 'params' `lora_a_<op>` / `lora_b_<op>`,
nnx `Adapter` variables), so scan over layers stacks them as it stacks
the kernel. The same forward trains and serves: serving the trained
model is bit for bit its training forward.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from aqtr.lora.config import LoraConfig
  >>> m = attach(nnx.Linear(64, 8, rngs=nnx.Rngs(0)),
  ...            LoraConfig(rank=2, base='nf4'), jnp.ones((1, 64)))
  >>> m.lora_a_dot_general0.shape, m.lora_b_dot_general0.shape
  ((64, 2), (2, 8))
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from aqtr.flax import hosts, serving
from aqtr.flax.frozen import (
  compact,
  holder_entries,
  holder_full_shape,
  holder_ref_ndim,
  is_compact,
)
from aqtr.flax.quantized import intercepting, quantize, spec_of
from aqtr.lora import pax as pax_lora
from aqtr.lora import storage
from aqtr.lora.config import LoraConfig, base_config
from aqtr.lora.selection import (
  check_used,
  codebook_table,
  initial,
  lora_rules,
)
from aqtr.lora.session import (
  A_PREFIX,
  B_PREFIX,
  Adapter,
  LoraSession,
  LoraSpec,
  Site,
  adapter_names,
  dropout,
  raw_entries,
)
from aqtr.rules import Rule

__all__ = [
  'A_PREFIX',
  'B_PREFIX',
  'Adapter',
  'Site',
  'attach',
  'base_rules_of',
  'check_used',
  'codebook_table',
  'dropout',
  'initial',
  'lora_rules',
  'sites',
  'spec',
]


def _base_rules(pairs) -> list[Rule]:
  return [
    Rule(
      base_config(c.base),
      path=s.path,
      layer=s.layer,
      tag=s.tag,
      op=s.op if s.op is not None else ('dot_general', 'einsum'),
      weight=True,
      name=s.name or s.label(),
    )
    for s, c in pairs
  ]


def base_rules_of(lspec: LoraSpec) -> list[Rule]:
  """The `aqtr.flax.quantize` rules of the frozen bases of `lspec`."""
  return _base_rules(zip(lspec.selectors, lspec.configs, strict=True))


def _intercepting(method):
  """`method` with a LoraSession active for its duration."""
  return intercepting(
    method,
    lambda m, weights: LoraSession(
      type(m).aqtr_spec,
      type(m).aqtr_lora,
      weights,
      hosts.of(m, need_variables=False).stored_ops(),
    ),
    'aqtr.lora',
    'Attach adapters before jitting the model.',
  )


def with_spec(model, lspec: LoraSpec, spec_=None):
  """A copy of a quantized `model` (nnx: in place) running LoRA sessions."""
  spec_ = spec_ or spec_of(model)
  base = type(model).aqtr_base
  ns = {'aqtr_spec': spec_, 'aqtr_base': base, 'aqtr_lora': lspec}
  for name in spec_.methods:
    ns[name] = _intercepting(getattr(base, name))
  model = hosts.of(model, need_variables=False).mode_copy()
  model.__class__ = type(base.__name__, (base,), ns)
  return model


def spec(model) -> LoraSpec:
  """The LoRA rules of a model made by `attach` (a clear error if none)."""
  s = getattr(type(model), 'aqtr_lora', None)
  if s is None:
    raise ValueError(
      f'{type(model).__name__} has no adapters: build it with '
      'aqtr.lora.attach(model, rules, *sample_inputs).'
    )
  return s


def sites(
  model, *args, variables=None, caller='aqtr.lora', **kwargs
) -> list[Site]:
  """The adapter sites of one call of `model` (traced abstractly)."""
  host = hosts.of(model, variables, who=caller)
  lspec = dataclasses.replace(spec(model), recording=True)
  rec = with_spec(host.clone(), lspec)
  sessions = serving.trace(
    rec, serving.abstract_call(rec, variables, args, kwargs)
  )
  found: dict[str, Site] = {}
  hits: set[int] = set()
  convs: set[int] = set()
  for s in sessions:
    hits |= s.activation_hits
    convs |= s.conv_hits
    for site in s.sites:
      found.setdefault(site.op_path, site)
  out = list(found.values())
  check_used(lspec.selectors, {s.rule for s in out}, hits, convs)
  return out


def _compact(holder, cfg: LoraConfig, ref_ndim: int):
  """A converted holder stored compactly (4-bit codes, 8-bit scales)."""
  table = codebook_table(cfg)
  stored, shapes = storage.encode(
    raw_entries(holder), table, cfg.double_quant, ref_ndim
  )
  return compact(holder, stored, tuple(sorted(shapes.items())))


def attach(model, rules, *args, variables=None, seed: int = 0, **kwargs):
  """Adapters on the weight ops `rules` select; the bases frozen.

  Args:
    model: a float linen Module (unbound) or nnx Module (not changed), or
      the Fiddle template of an `aqtr.pax` model (`aqtr.lora.pax.attach`),
      or a served model whose frozen weights are the bases as they are
      (`aqtr.checkpoints.load`; see `aqtr.checkpoints.qlora`).
    rules: a LoraConfig (every weight op), {path regex: LoraConfig}, or
      (Rule, LoraConfig) pairs, first match wins
      (`aqtr.lora.selection.lora_rules`).
    *args, **kwargs: sample inputs of one call (shapes matter).
    variables: linen: the float variables (e.g. a pretrained checkpoint).
    seed: PRNG seed of the A matrices.

  Returns:
    nnx: the LoRA model (a new one). linen: (LoRA module, variables). Pax:
    (LoRA template, variables).

  Raises:
    ValueError: a rule matches no weight op or only activation ops, a
      rank exceeds min(d_in, d_out), an op reads a derived weight.
  """
  host = hosts.of(model, variables, who='aqtr.lora.attach')
  if host.by_injection:  # A Pax template: Fiddle injection.
    return pax_lora.attach(
      model, rules, *args, variables=variables, seed=seed, **kwargs
    )
  pairs = lora_rules(rules)
  if getattr(type(model), 'aqtr_lora', None) is not None:
    raise ValueError(
      'aqtr.lora.attach: the model already has adapters; attach to the '
      'float model, or fold these in first with aqtr.lora.merge(model, '
      '..., requantize=None) and attach to the merged model.'
    )
  lspec = LoraSpec(
    tuple(s for s, _ in pairs), tuple(c for _, c in pairs), False
  )
  served = getattr(type(model), 'aqtr_spec', None)
  ready = served is not None and served.converted
  if ready:
    # A served model (`aqtr.checkpoints.load`): its frozen weights are the
    # bases as they are (no float copy); `LoraConfig.base` names their
    # format (`aqtr.checkpoints.qlora` sets it per weight).
    got = hosts.served(model, variables, who='aqtr.lora.attach')
  else:
    got = hosts.of(quantize(model, _base_rules(pairs)), variables)
  if not ready and any(base_config(c.base) is not None for _, c in pairs):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', UserWarning)
      out = serving.convert(
        got.model, *args, variables=variables, check=False, **kwargs
      )
      got = hosts.served(out)
  lora = hosts.of(with_spec(got.model, lspec), got.variables)
  found = sites(lora.model, *args, variables=lora.variables, **kwargs)
  key = jax.random.key(seed)
  done = set()
  for i, site in enumerate(found):
    cfg = lspec.configs[site.rule]
    path = site.param_path
    value = lora.leaf(path)
    if holder_entries(value) is not None:  # a frozen base
      ref_ndim, full = holder_ref_ndim(value), holder_full_shape(value)
      if path not in done and not is_compact(value):
        lora.set_leaf(path, _compact(value, cfg, ref_ndim))
      done.add(path)
    else:
      full = jnp.shape(value)
    lead = tuple(full[: len(full) - len(site.weight.shape)])
    a, b = initial(jax.random.fold_in(key, i), site, cfg.rank, lead)
    an, bn = adapter_names(site)
    lora.add_param((*site.op_module, an), a, Adapter)
    lora.add_param((*site.op_module, bn), b, Adapter)
  return lora.result()
