"""Serving merged adapters, and the bytes of LoRA vs full fine-tuning.

`merge(model, *sample_inputs)` folds each adapter into its weight and
re-quantizes it with the base's format: `W' = Q(W_deq + A B alpha / r)`
(`W_deq`: the frozen base dequantized, `aqtr.QTensor.dequant`), giving an
ordinary serving model (`aqtr.flax.convert`'s; float base: the float
model with `W + A B alpha / r`) with no adapter matmul left. Q rounds to
nearest by default; `method='gptq'` with calibration `batches` solves it
against the unmerged weight, optionally on the base's own grid
(`aqtr.lora.requant`).

`sizes(model, *sample_inputs)` counts what training holds: trainable
adapters, AdamW's two moments of them, the frozen base (as stored), the
other (float, untouched) parameters, and the same model fine-tuned in full
with AdamW (float weights + two moments).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from aqtr.lora.adapters import attach
  >>> from aqtr.lora.config import LoraConfig
  >>> x = jnp.ones((1, 64))
  >>> m = attach(nnx.Linear(64, 64, rngs=nnx.Rngs(0)),
  ...            LoraConfig(rank=2, base='nf4'), x)
  >>> s = sizes(m, x)
  >>> s.adapters, s.base, s.full
  (1024, 2304, 49920)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx, traverse_util

from aqtr.flax import hosts
from aqtr.flax.frozen import (
  FrozenBox,
  holder_entries,
  kernel_bytes,
)
from aqtr.flax.sites import WeightSite
from aqtr.freezers import lifecycle
from aqtr.lora import adapters as adapters_lib
from aqtr.lora import pax_merge
from aqtr.lora.config import base_config
from aqtr.lora.folding import Bytes, delta, dequantized
from aqtr.lora.requant import check_solver, requantized
from aqtr.lora.session import adapter_names, adapter_shapes

__all__ = [
  'Bytes',
  'delta',
  'dequantized',
  'merge',
  'sizes',
]


def _weight(value):
  return value.unbox() if isinstance(value, FrozenBox) else value


def _given(adapters, site: WeightSite, rank: int):
  """The (A, B) `adapters` holds for `site`, checked against it."""
  flat = {
    tuple(map(str, k)): v
    for k, v in traverse_util.flatten_dict(adapters).items()
  }
  got = []
  names, shapes = adapter_names(site), adapter_shapes(site, rank)
  for name, shape in zip(names, shapes, strict=True):
    key = tuple(map(str, (*site.op_module, name)))
    if key not in flat:
      raise ValueError(
        f'aqtr.lora.merge: the adapters have no {"/".join(key)!r}; merge '
        'adapters trained on this model (same rules).'
      )
    v = jnp.asarray(flat[key])
    if tuple(v.shape[v.ndim - len(shape) :]) != tuple(shape):
      raise ValueError(
        f'aqtr.lora.merge: adapter {"/".join(key)!r} has shape {v.shape} '
        f'but the model needs {shape} (rank {rank}); merge '
        'adapters of the same rank and shapes.'
      )
    got.append(v)
  return tuple(got)


def merge(
  model,
  *args,
  variables=None,
  adapters=None,
  requantize='base',
  method='rtn',
  batches=None,
  grid='fresh',
  report=False,
  **kwargs,
):
  """The adapters folded into re-quantized base weights, for serving.

  `W' = W_deq + A B alpha / r` is quantized by `method`: 'rtn' rounds it
  to nearest on fresh scales (`aqtr.flax.convert`); a solver of
  `aqtr.ptq` ('gptq', ...) solves it on the fine-tuning domain's inputs
  `batches` (the float merged model, then `aqtr.ptq.quantize`), which
  minimizes `||X (W' - Q)||` against the unmerged model's weight.
  `grid='base'` keeps each base's own grid (its scales, recomputed from
  `W_deq`, on which `W_deq` is exact): Q then differs from the base
  only where the adapters move a weight across a rounding boundary.

  Args:
    model: a LoRA model (`aqtr.lora.attach`), trained; or a LoRA Pax
      template (`variables` required; `aqtr.lora.pax_merge`).
    *args, **kwargs: sample inputs.
    variables: linen / Pax: the LoRA variables.
    adapters: other adapters to merge instead of the model's (a nested
      dict as `aqtr.lora.partition` or `nnx.state(m, Adapter)` give).
    requantize: the merged weights' format: 'base' (each rule's
      `LoraConfig.base`), or one format for all (a `LoraConfig.base`
      value: 'nf4', a preset name such as 'int8_weight_only', a
      DotGeneralConfig, or None: float).
    method: 'rtn', a registered `aqtr.ptq` method name or an
      `aqtr.ptq.Method` (e.g. `aqtr.ptq.Gptq(act_order=True)`).
    batches: calibration inputs (model inputs of the fine-tuning domain,
      one per batch, all of the first's shapes); needed by every method
      but 'rtn'.
    grid: 'fresh' (the merged weight's own scales) or 'base' (the base
      weight's scales; needs requantize='base' and a method that solves
      on a given grid: 'rtn' or 'gptq').
    report: also return the `aqtr.ptq.PtqReport` (per weight: output
      error of fresh RTN and of the method); needs `batches`.

  Returns:
    nnx: the merged serving model. linen: (module, variables). With
    `report=True`: (that, PtqReport).
  """
  solver = {'method': method, 'batches': batches, 'grid': grid}
  host = hosts.of(model, variables, who='aqtr.lora.merge')
  if host.by_injection:  # A Pax template.
    m = pax_merge.float_merged(
      model, *args, variables=variables, adapters=adapters, **kwargs
    )
    rules = _formats(m.rules, requantize)
    check_solver(
      method, batches, grid, report, requantize, not _quantized(rules)
    )
    served = (m.template, m.variables)
    return _solved(served, rules, m.bases, report, solver, args, kwargs)
  lspec = adapters_lib.spec(model)
  floats = all(base_config(c.base) is None for c in lspec.configs)
  check_solver(method, batches, grid, report, requantize, floats)
  found = adapters_lib.sites(
    model, *args, variables=variables, caller='aqtr.lora.merge', **kwargs
  )
  if adapters is not None and not isinstance(adapters, dict):
    adapters = nnx.to_pure_dict(adapters)
  out = hosts.of(host.clone(), host.variables)
  bases = {}
  for site in found:
    cfg = lspec.configs[site.rule]
    mpath, names = site.op_module, adapter_names(site)
    a, b = (
      (out.leaf((*mpath, names[0])), out.leaf((*mpath, names[1])))
      if adapters is None
      else _given(adapters, site, cfg.rank)
    )
    holder = out.leaf(site.param_path)
    if holder_entries(holder) is not None:
      w = dequantized(holder, site, base_config(cfg.base))
      bases[site.op_path] = w
    else:
      w = _weight(holder)
    w = (w + delta(site, a, b, cfg.scale)).astype(site.weight.dtype)
    for name in names:
      out.remove_param((*mpath, name))
    out.set_leaf(site.param_path, w)
  rules = _formats(adapters_lib.base_rules_of(lspec), requantize)
  out.model.__class__ = type(model).aqtr_base
  served = out.result()
  return _solved(served, rules, bases, report, solver, args, kwargs)


def _formats(rules: list, requantize) -> list:
  """The merged ops' rules: their bases' formats, or `requantize`'s."""
  if isinstance(requantize, str) and requantize == 'base':
    return rules
  fmt = base_config(requantize, 'aqtr.lora.merge: requantize')
  return [dataclasses.replace(r, config=fmt) for r in rules]


def _quantized(rules: list) -> list:
  return [r for r in rules if r.config is not None]


def _solved(served, rules, bases, report, solver, args, kwargs):
  """The float merged model `served` quantized by `rules` (if any)."""
  if not _quantized(rules):
    return (served, None) if report else served
  model, fvars = served if isinstance(served, tuple) else (served, None)
  out, rep = requantized(
    model,
    _quantized(rules),
    *args,
    variables=fvars,
    base_weights=bases,
    **solver,
    **kwargs,
  )
  return (out, rep) if report else out


def sizes(model, *args, variables=None, **kwargs) -> Bytes:
  """Training bytes of a LoRA model vs full fine-tuning (AdamW)."""
  host = hosts.of(model, variables, who='aqtr.lora.sizes')
  if host.by_injection:  # A Pax template.
    return pax_merge.sizes(model, *args, variables=variables, **kwargs)
  found = adapters_lib.sites(
    model, *args, variables=variables, caller='aqtr.lora.sizes', **kwargs
  )
  bases = {s.param_path for s in found}
  ad = base = base_float = other = 0
  for path, v in host.leaves():
    if str(path[-1]).startswith((adapters_lib.A_PREFIX, adapters_lib.B_PREFIX)):
      ad += lifecycle.nbytes(v)
      continue
    entries = holder_entries(v)
    if entries is not None:
      stored = v.stored()
      base += lifecycle.nbytes(stored)
      base_float += kernel_bytes(v)
      continue
    n = lifecycle.nbytes(v)
    if tuple(path) in bases:
      base += n
      base_float += n
    else:
      other += n
  full = 3 * (base_float + other)
  return Bytes(ad, 2 * ad, base, other, full, base_float)
