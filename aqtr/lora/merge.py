"""Serving merged adapters, and the bytes of LoRA vs full fine-tuning.

`merge(model, *sample_inputs)` folds each adapter into its weight and
re-quantizes it with the base's format: `W' = Q(W_deq + A B alpha / r)`
(`W_deq`: the frozen base dequantized, `aqtr.QTensor.dequant`), giving an
ordinary serving model (`aqtr.flax.convert`'s; float base: the float
model with `W + A B alpha / r`) with no adapter matmul left.

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
import math
import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

import aqtr.ptq as ptq
from aqtr.flax import serving
from aqtr.flax.frozen import FrozenBox, FrozenKernel, kernel_bytes
from aqtr.flax.quantized import quantize
from aqtr.freezers import configure, lifecycle
from aqtr.lora import adapters as adapters_lib
from aqtr.lora.config import base_config
from aqtr.ptq import gptq, methods
from aqtr.ptq.grid import Grid

__all__ = [
  'BaseGrid',
  'Bytes',
  'delta',
  'dequantized',
  'merge',
  'requantized',
  'sizes',
]


def dequantized(holder, site: adapters_lib.Site, cfg) -> jax.Array:
  """The frozen base of `site` in float, shaped like its kernel."""
  entries = holder.entries()[f'{site.op_id}_{site.side}']
  (entry,) = entries.values()
  parts = entry['rhs']
  wcfg = configure(cfg, rhs='weights')
  ref = parts['qvalue']
  lead = ref.ndim - (
    holder.ref_ndim
    if isinstance(holder, FrozenBox)
    else holder.get_metadata('ref_ndim')
  )

  def one(parts):
    call = lifecycle.DotCall(
      jnp.zeros(site.other.shape, site.other.dtype),
      jnp.zeros(site.weight.shape, site.weight.dtype),
      site.dn,
      wcfg,
    )
    qt = call.operand('rhs').qtensor(
      parts['qvalue'], parts['scale'], parts.get('zero_point')
    )
    return qt.dequant(site.weight.dtype)

  fn = one
  for _ in range(lead):
    fn = jax.vmap(fn)
  return fn(parts)


def delta(site: adapters_lib.Site, a, b, scale: float) -> jax.Array:
  """A B * scale in the layout of the op's weight operand (lead kept)."""
  lead = a.shape[: a.ndim - len(site.a_shape)]
  cin, cout = site.a_shape[:-1], site.b_shape[1:]
  a2 = a.reshape(*lead, math.prod(cin), site.a_shape[-1])
  b2 = b.reshape(*lead, site.b_shape[0], math.prod(cout))
  d = jnp.einsum('...ir,...rj->...ij', a2, b2) * scale
  d = d.reshape(*lead, *cin, *cout)
  (_, rc), _ = site.dn
  free = [i for i in range(len(site.weight.shape)) if i not in rc]
  perm = np.argsort([*rc, *free])
  n = len(lead)
  return d.transpose(*range(n), *(n + int(p) for p in perm))


def _weight(value):
  return value.unbox() if isinstance(value, FrozenBox) else value


def _given(adapters, site: adapters_lib.Site, names):
  """The (A, B) `adapters` holds for `site`, checked against it."""
  flat = {
    tuple(map(str, k)): v
    for k, v in traverse_util.flatten_dict(adapters).items()
  }
  got = []
  for name, shape in zip(names, (site.a_shape, site.b_shape), strict=True):
    key = tuple(map(str, (*site.module_path, name)))
    if key not in flat:
      raise ValueError(
        f'aqtr.lora.merge: the adapters have no {"/".join(key)!r}; merge '
        'adapters trained on this model (same rules).'
      )
    v = jnp.asarray(flat[key])
    if tuple(v.shape[v.ndim - len(shape) :]) != tuple(shape):
      raise ValueError(
        f'aqtr.lora.merge: adapter {"/".join(key)!r} has shape {v.shape} '
        f'but the model needs {shape} (rank {site.a_shape[-1]}); merge '
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
    model: a LoRA model (`aqtr.lora.attach`), trained.
    *args, **kwargs: sample inputs.
    variables: linen: the LoRA variables.
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
  _check_method(method, batches, requantize, grid, report)
  lspec = adapters_lib.spec(model)
  found = adapters_lib.sites(model, *args, variables=variables, **kwargs)
  linen = isinstance(model, nn.Module)
  if adapters is not None and not isinstance(adapters, dict):
    adapters = nnx.to_pure_dict(adapters)
  if linen:
    params = flax.core.unfreeze(variables['params'])
  else:
    out = nnx.clone(model)
    modules = dict(nnx.iter_modules(out))
  bases = {}
  for site in found:
    cfg = lspec.configs[site.rule]
    if linen:
      parent = params
      for k in site.module_path:
        parent = parent[k]
      get = parent.get
    else:
      parent = modules[site.module_path]

      def get(name, parent=parent):
        v = getattr(parent, name)
        return v if isinstance(v, FrozenKernel) else v.get_value()

    names = site.names
    a, b = (
      (get(names[0]), get(names[1]))
      if adapters is None
      else _given(adapters, site, names)
    )
    holder = get(site.param)
    if isinstance(holder, FrozenKernel | FrozenBox):
      w = dequantized(holder, site, base_config(cfg.base))
      bases['/'.join(map(str, (*site.module_path, site.op_id)))] = w
    else:
      w = _weight(nn.meta.unbox(holder))
    w = (w + delta(site, a, b, cfg.scale)).astype(site.weight.dtype)
    for name in names:
      if linen:
        parent.pop(name)
      else:
        delattr(parent, name)
    if linen:
      parent[site.param] = w
    else:
      setattr(parent, site.param, nnx.Param(w))
  rules = adapters_lib.base_rules_of(lspec)
  if not (isinstance(requantize, str) and requantize == 'base'):
    fmt = base_config(requantize)
    rules = [dataclasses.replace(r, config=fmt) for r in rules]
  base = type(model).aqtr_base
  if linen:
    merged = model.copy()
    merged.__class__ = base
    fvars = dict(variables, params=params)
  else:
    out.__class__ = base
    merged, fvars = out, None
  if not any(r.config is not None for r in rules):
    served = (merged, fvars) if linen else merged
    return (served, None) if report else served
  served, rep = requantized(
    merged,
    rules,
    *args,
    variables=fvars,
    method=method,
    batches=batches,
    base_weights=bases if grid == 'base' else None,
    **kwargs,
  )
  return (served, rep) if report else served


def requantized(
  merged,
  rules,
  *args,
  variables=None,
  method='rtn',
  batches=None,
  base_weights=None,
  **kwargs,
):
  """A float merged model quantized by `rules`: (served, PtqReport | None).

  The composition `merge` ends with, for any model `aqtr.ptq.quantize`
  takes (nnx, linen, a Pax template with `variables`): method 'rtn' with
  no `batches` and no `base_weights` is `aqtr.flax.convert` of
  `aqtr.flax.quantize(merged, rules)` (no report); otherwise
  `aqtr.ptq.quantize(merged, rules, batches, method=...)`, on the grids
  of `base_weights` when given (`BaseGrid`).

  Args:
    merged: the float model with `W + A B alpha / r` in its weights.
    rules: the `aqtr.rules.Rule`s of the serving format.
    *args, **kwargs: sample inputs (and RTN's calibration batch when
      `batches` is None).
    variables: linen / Pax: the merged float variables.
    method: as `merge`'s.
    batches: calibration inputs (see `merge`).
    base_weights: None, or {op path: the base weight dequantized, in the
      weight's layout} whose grids to keep (ops not in it: fresh grids).

  Returns:
    (served, report): served as the model kind's convert returns it.
  """
  if batches is None and _is_rtn(method) and base_weights is None:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', UserWarning)
      return serving.convert(
        quantize(merged, rules),
        *args,
        variables=variables,
        check=False,
        **kwargs,
      ), None
  if batches is None:
    if kwargs or not _is_rtn(method):
      raise ValueError(
        f'aqtr.lora.merge: method={_name(method)!r} needs batches= of '
        'positional model inputs.'
      )
    batches = [args if len(args) != 1 else args[0]]
  meth = methods.get(method)
  if base_weights is not None:
    meth = BaseGrid(then=meth, weights=base_weights)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)
    return ptq.quantize(
      merged, rules, batches, variables=variables, method=meth
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseGrid(methods.Method):
  """A solver on the base weight's grid instead of the merged weight's.

  The grid (scales, zero points) of op `p` is the one the rule's
  calibration gives `weights[p]`, the base dequantized: for absmax
  formats that is the base's own grid (`W_deq` is exact on it), so the
  merged `W_deq + D` only moves the codes D carries across a boundary.
  `then` (RTN or GPTQ, arXiv 2210.17323) solves the merged weight on
  it; ops missing from `weights` keep the fresh grid.

  Attributes:
    then: the solver: `aqtr.ptq.Rtn()` or `aqtr.ptq.Gptq(...)`
      (static groups: the grid is given).
    weights: {op path: base weight dequantized, in the weight's layout}.
  """

  then: methods.Method = dataclasses.field(default_factory=ptq.Rtn)
  weights: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    t = self.then
    ok = isinstance(t, ptq.Rtn) or (isinstance(t, ptq.Gptq) and t.static_groups)
    if not ok:
      raise ValueError(
        "BaseGrid.then must solve on a given grid: 'rtn' or 'gptq' with "
        f'static_groups=True, got {t!r}.'
      )

  def check(self, site) -> None:
    self.then.check(site)

  def solve(self, site, grid: Grid, stats) -> gptq.Solution:
    w = self.weights.get(site.path)
    if w is not None:
      base = Grid.of(site, w)
      grid = dataclasses.replace(grid, scale2=base.scale2, zero2=base.zero2)
    sol = self.then.solve(site, grid, stats)
    return sol._replace(scale=grid.scale2, zero=grid.zero2)


def _is_rtn(method) -> bool:
  return isinstance(method, ptq.Rtn) or (
    isinstance(method, str) and method == 'rtn'
  )


def _check_method(method, batches, requantize, grid, report) -> None:
  """One line for each bad combination of merge's solver arguments."""
  if not isinstance(method, ptq.Method) and method not in methods.names():
    raise ValueError(
      f'aqtr.lora.merge: method must be one of {methods.names()} or an '
      f'aqtr.ptq.Method, got {method!r}.'
    )
  if grid not in ('fresh', 'base'):
    raise ValueError(
      f"aqtr.lora.merge: grid must be 'fresh' or 'base', got {grid!r}."
    )
  if requantize is None and not (_is_rtn(method) and grid == 'fresh'):
    raise ValueError(
      f'aqtr.lora.merge: requantize=None merges into float weights: there '
      f'is nothing for method={_name(method)!r} / grid={grid!r} to solve; '
      "drop them or set requantize='base'."
    )
  if grid == 'base' and not (
    isinstance(requantize, str) and requantize == 'base'
  ):
    raise ValueError(
      "aqtr.lora.merge: grid='base' keeps the base's scales, so it needs "
      f"requantize='base', got requantize={requantize!r}."
    )
  if batches is None and (not _is_rtn(method) or report):
    raise ValueError(
      f'aqtr.lora.merge: method={_name(method)!r}'
      f'{" with report=True" if report else ""} needs batches= (calibration '
      "inputs of the fine-tuning domain); only method='rtn' needs none."
    )


def _name(method) -> str:
  return method if isinstance(method, str) else type(method).name


@dataclasses.dataclass(frozen=True)
class Bytes:
  """Bytes of LoRA training vs full fine-tuning with AdamW.

  Attributes:
    adapters: trainable A, B. optimizer: AdamW's two moments of them.
    base: the frozen adapted weights as stored. other: the other params.
    full: full fine-tuning: every weight float + two AdamW moments.
    base_float: the adapted weights in float (their full-FT share).
  """

  adapters: int
  optimizer: int
  base: int
  other: int
  full: int
  base_float: int

  @property
  def total(self) -> int:
    return self.adapters + self.optimizer + self.base + self.other

  @property
  def ratio(self) -> float:
    """LoRA training bytes / full fine-tuning bytes."""
    return self.total / self.full

  @property
  def base_bits(self) -> float:
    """Bits per adapted weight as stored (32: float)."""
    return 32.0 * self.base / self.base_float


def sizes(model, *args, variables=None, **kwargs) -> Bytes:
  """Training bytes of a LoRA model vs full fine-tuning (AdamW)."""
  found = adapters_lib.sites(model, *args, variables=variables, **kwargs)
  bases = {(*s.module_path, s.param) for s in found}
  ad = base = base_float = other = 0
  if isinstance(model, nn.Module):
    flat = traverse_util.flatten_dict(flax.core.unfreeze(variables['params']))
    items = [(k, v, v) for k, v in flat.items()]
  else:
    items = [
      (tuple(p), v, v)
      for p, v in nnx.to_flat_state(
        nnx.state(model, nnx.Any(nnx.Param, FrozenKernel))
      )
    ]
  for path, v, _ in items:
    if str(path[-1]).startswith((adapters_lib.A_PREFIX, adapters_lib.B_PREFIX)):
      ad += lifecycle.nbytes(
        nn.meta.unbox(v) if not isinstance(v, nnx.Variable) else v.get_value()
      )
      continue
    if isinstance(v, FrozenKernel | FrozenBox):
      stored = (
        v.stored()
        if hasattr(v, 'stored')
        else (v.get_raw_value() if isinstance(v, FrozenKernel) else v.frozen)
      )
      base += lifecycle.nbytes(stored)
      base_float += kernel_bytes(v)
      continue
    arr = v.get_value() if isinstance(v, nnx.Variable) else nn.meta.unbox(v)
    n = lifecycle.nbytes(arr)
    if tuple(path) in bases:
      base += n
      base_float += n
    else:
      other += n
  full = 3 * (base_float + other)
  return Bytes(ad, 2 * ad, base, other, full, base_float)
