"""LoRA and QLoRA on `aqtr.pax` templates: adapters injected by rules.

`aqtr.lora.attach(template, rules, *sample_inputs, variables=float_vars)`
(a Fiddle template of an `aqtr.pax` model) puts a `LoraEinsum` in the slot
of every weight einsum the rules select, as `aqtr.pax.inject` sets configs
(the rules match Pax op paths, layers, tags). The op computes

  y = base(x W) + dropout(x) A B * alpha / r

(LoRA, Hu et al. 2021, arXiv 2106.09685; QLoRA, Dettmers et al. 2023,
arXiv 2305.14314). The base weight `W` is frozen by the model's own
serving conversion (`aqtr.flax.linen.convert` of the op in CONVERT with
`LoraConfig.base`: the layer's float kernel becomes a `Removed`
placeholder and the op reads its frozen entries from the collection
'aqtr' in SERVE, stored compactly by `aqtr.lora.storage` — nf4 as 4-bit
codes, double-quantized scales); a float base keeps the kernel. `A`
[contracted weight axes..., r] and `B` [r, output axes...] are params of
the op (`.../q_proj/einsum/lora_a_einsum`), so `aqtr.lora.partition` and
`optimizer` train them alone. The same forward trains and serves.

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
import dataclasses
import math
import re
import threading
import warnings
from typing import Any, NamedTuple

import fiddle as fdl
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from fiddle import selectors
from flax import traverse_util

import aqtr.flax.linen as aqtr_linen
from aqtr.core import einsum as einsum_lib
from aqtr.freezers import Mode, configure, lifecycle
from aqtr.lora import adapters as adapters_lib
from aqtr.lora import storage
from aqtr.lora.config import LoraConfig, base_config
from aqtr.lora.merge import Bytes, delta, dequantized
from aqtr.lora.requant import check_solver, requantized
from aqtr.lora.session import A_PREFIX, B_PREFIX, Site, low_rank
from aqtr.pax import ops, paths
from aqtr.rules import Rule

__all__ = [
  'LoraEinsum',
  'Merged',
  'PaxSite',
  'attach',
  'float_merged',
  'merge',
  'sites',
  'sizes',
]

_local = threading.local()
_OP = 'einsum'  # The adapters' op id: params lora_a_einsum, lora_b_einsum.
_KEY = f'{_OP}_rhs'  # The stored entries' op key (`aqtr.lora.storage`).


class _Plan(NamedTuple):
  lc: tuple[int, ...]  # lhs axes met by A's leading axes (rhs order).
  a_shape: tuple[int, ...]
  b_shape: tuple[int, ...]
  dn: Any  # The dot with the weight as rhs (no batch axes).
  perm: tuple[int, ...] | None  # x A B's axes -> the einsum's output.


def _plan(eqn: str, lhs_ndim: int, rhs_shape, rank: int, where: str) -> _Plan:
  """The adapter's shapes and axes for a weight einsum `eqn`."""
  ls, rs, os = einsum_lib.parse(eqn, lhs_ndim, len(rhs_shape))
  if any(c in ls and c in os for c in rs):
    raise ValueError(
      f'aqtr.lora: {where} ({eqn}): the weight has batch axes; adapters '
      'need a weight of contracted and output axes only.'
    )
  summed = [c for c in ls + rs if c not in os and not (c in ls and c in rs)]
  if summed:
    raise ValueError(
      f'aqtr.lora: {where} ({eqn}): letters {"".join(summed)} are summed '
      'out of one operand; adapters need one dot_general.'
    )
  con = [c for c in rs if c in ls]
  free = [c for c in rs if c not in ls]
  a_shape = (*(rhs_shape[rs.index(c)] for c in con), rank)
  b_shape = (rank, *(rhs_shape[rs.index(c)] for c in free))
  d_in, d_out = math.prod(a_shape[:-1]), math.prod(b_shape[1:])
  if rank > min(d_in, d_out):
    raise ValueError(
      f'aqtr.lora: {where}: LoraConfig.rank {rank} exceeds min(d_in, d_out)'
      f' = min({d_in}, {d_out}); use rank <= {min(d_in, d_out)}.'
    )
  lc = tuple(ls.index(c) for c in con)
  rc = tuple(rs.index(c) for c in con)
  got = ''.join(c for c in ls if c not in con) + ''.join(free)
  perm = None if got == os else tuple(got.index(c) for c in os)
  return _Plan(lc, a_shape, b_shape, ((lc, rc), ((), ())), perm)


class _Decoding(aqtr_linen.LinenHost):
  """The op's host, reading its compactly stored base (decoded)."""

  table: tuple[float, ...] | None
  shapes: dict

  @classmethod
  def wrap(cls, host, table, shapes) -> _Decoding:
    new = object.__new__(cls)
    new.__dict__.update(host.__dict__)
    new.table, new.shapes = table, shapes
    return new

  def frozen_entries(self):
    raw = super().frozen_entries()
    if raw is None:
      return None
    return storage.decode({_KEY: raw}, self.table, self.shapes)[_KEY]


class LoraEinsum(ops.EinsumOp):
  """A Pax weight einsum plus its low-rank adapter (`attach` sets it).

  Attributes (besides `EinsumOp`'s; `config`: the base's frozen config, or
  None for a float base; `mode`: SERVE):
    lora: the adapter's LoraConfig.
    index: the adapter's number in the model (dropout folds it in).
    table: the codebook values when the base is stored as 4-bit codes.
    scale_shapes: (entry key, shape) of each double-quantized scale.
  """

  lora: LoraConfig = LoraConfig()
  index: int = 0
  table: tuple[float, ...] | None = None
  scale_shapes: tuple = ()

  def _host(self):
    host = super()._host()
    if self.table is None and not self.scale_shapes:
      return host
    return _Decoding.wrap(host, self.table, dict(self.scale_shapes))

  @nn.compact
  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    where = '/'.join(map(str, self.path)) or type(self).__name__
    plan = _plan(eqn, jnp.ndim(lhs), jnp.shape(rhs), self.lora.rank, where)
    base = self.contract(eqn, lhs, rhs)
    a = self._adapter(A_PREFIX + _OP, plan.a_shape, where)
    b = self._adapter(B_PREFIX + _OP, plan.b_shape, where)
    rec = getattr(_local, 'sites', None)
    if rec is not None:
      rec.append(self._site(plan, lhs, rhs, where))
    delta = low_rank(lhs, a, b, plan.lc, self.lora, None, self.index)
    if plan.perm is not None:
      delta = delta.transpose(plan.perm)
    return base + delta.astype(base.dtype)

  def _adapter(self, name: str, shape, where: str) -> jax.Array:
    if self.has_variable('params', name):
      got = jnp.shape(nn.meta.unbox(self.get_variable('params', name)))
      if tuple(got) != tuple(shape):
        raise ValueError(
          f'aqtr.lora: {where}: adapter {name} has shape {got} but the op '
          f'needs {tuple(shape)} (rank {self.lora.rank}); use adapters '
          'trained with the same rules and rank.'
        )
    if name.startswith(A_PREFIX):
      bound = 1.0 / math.sqrt(math.prod(shape[:-1]))

      def init(key, shape):
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound)

      return self.param(name, init, shape)
    return self.param(name, nn.initializers.zeros_init(), shape)

  def _site(self, plan: _Plan, lhs, rhs, where: str) -> PaxSite:
    """This call's site (recording): the weight's name in the layer."""
    own = self.parent.variables.get('params', {}) if self.parent else {}
    leaves = {k: v for k, v in own.items() if not isinstance(v, dict)}
    name = next((k for k, v in leaves.items() if nn.meta.unbox(v) is rhs), None)
    if name is None:
      same = [
        k
        for k, v in leaves.items()
        if jnp.shape(nn.meta.unbox(v)) == jnp.shape(rhs)
      ]
      name = same[0] if len(same) == 1 else None
    if name is None:
      raise ValueError(
        f'aqtr.lora: {where}: its weight operand is not a parameter of the '
        'layer that calls it; adapters need a parameter: exclude this op '
        'from the LoRA rules.'
      )
    site = Site(
      tuple(self.path),
      _OP,
      'rhs',
      name,
      -1,  # Pax sites carry their LoraConfig itself (PaxSite.lora).
      plan.a_shape,
      plan.b_shape,
      plan.dn,
      jax.ShapeDtypeStruct(jnp.shape(rhs), jnp.result_type(rhs)),
      jax.ShapeDtypeStruct(jnp.shape(lhs), jnp.result_type(lhs)),
    )
    return PaxSite(site, self.index, self.lora)


@dataclasses.dataclass(frozen=True)
class PaxSite:
  """One adapter of a Pax model.

  Attributes:
    site: its `Site` (`module_path`: the op's path, where A and B live;
      `param`: the weight's name in the op's parent layer).
    index: the op's `LoraEinsum.index`.
    lora: its LoraConfig.
  """

  site: Site
  index: int
  lora: LoraConfig

  @property
  def layer(self) -> tuple:
    """The path of the layer holding the weight."""
    return self.site.module_path[:-1]


def _nodes(template) -> list:
  """The `LoraEinsum` nodes of a template, by index."""
  got = sorted(selectors.select(template, LoraEinsum), key=lambda n: n.index)
  return list(got)


def sites(template, *args, **kwargs) -> list[PaxSite]:
  """The adapters of one call of a LoRA template (traced abstractly)."""
  model = fdl.build(template)
  _local.sites = []
  try:
    jax.eval_shape(lambda k: model.init(k, *args, **kwargs), jax.random.key(0))
    found = _local.sites
  finally:
    _local.sites = None
  out: dict[int, PaxSite] = {}
  for s in found:
    out.setdefault(s.index, s)
  return [out[i] for i in sorted(out)]


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
  adapters_lib.check_used([sel for sel, _ in pairs], used, hits)


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _put(tree, path, value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _qvalue_ndim(entries) -> int:
  """The rank of an op's frozen qvalue (the engine's tiled view)."""
  (entry,) = entries.values()
  return jnp.ndim(entry['rhs']['qvalue'])


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
    `Removed`), adapters in 'params'.

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
  pairs = adapters_lib.lora_rules(rules)
  t = copy.deepcopy(template)
  paths.unshare(t)
  _swap(t, pairs)
  found = sites(t, *args, **kwargs)
  out = _convert(t, variables, args, kwargs)
  nodes = _nodes(t)
  key = jax.random.key(seed)
  for ps in found:
    node, cfg = nodes[ps.index], ps.lora
    table = adapters_lib.codebook_table(cfg)
    if node.config is not None and (table is not None or cfg.double_quant):
      raw = _get(out[aqtr_linen.FROZEN], ps.site.module_path)
      stored, shapes = storage.encode(
        {_KEY: raw}, table, cfg.double_quant, _qvalue_ndim(raw)
      )
      _put(out[aqtr_linen.FROZEN], ps.site.module_path, stored[_KEY])
      node.table, node.scale_shapes = table, tuple(sorted(shapes.items()))
    a, b = adapters_lib.initial(jax.random.fold_in(key, ps.index), ps.site)
    names = ps.site.names
    _put(out['params'], (*ps.site.module_path, names[0]), a)
    _put(out['params'], (*ps.site.module_path, names[1]), b)
  return t, out


def _dotted(template) -> dict[int, str]:
  """{LoraEinsum index: the op's dotted Fiddle path}."""
  return {
    s.op.index: s.path
    for s in paths.find_ops(template)
    if s.op is not None and fdl.get_callable(s.op) is LoraEinsum
  }


def _pair(tree, ps: PaxSite, given: bool):
  """(A, B) of `ps` in `tree` (params or given adapters), shape-checked."""
  s, got = ps.site, []
  for name, shape in zip(s.names, (s.a_shape, s.b_shape), strict=True):
    where = '/'.join(map(str, (*s.module_path, name)))
    try:
      v = jnp.asarray(nn.meta.unbox(_get(tree, (*s.module_path, name))))
    except (KeyError, TypeError):
      raise ValueError(
        f'aqtr.lora.merge: the adapters have no {where!r}; merge adapters '
        'trained on this model (same rules).'
      ) from None
    if given and tuple(v.shape) != tuple(shape):
      raise ValueError(
        f'aqtr.lora.merge: adapter {where!r} has shape {v.shape} but the '
        f'model needs {shape} (rank {s.a_shape[-1]}); merge adapters of '
        'the same rank and shapes.'
      )
    got.append(v)
  return tuple(got)


class Merged(NamedTuple):
  """`float_merged`'s result."""

  template: Any  # Float: plain `aqtr.pax.EinsumOp`s.
  variables: dict  # With W_deq + A B alpha / r in the weights.
  rules: list  # Per merged op: its base format (None: float).
  bases: dict  # {op path: the base dequantized} (`requant.BaseGrid`).


def float_merged(template, *args, variables, adapters=None, **kwargs):
  """The adapters folded into float weights: `W_deq + A B alpha / r`.

  Args:
    template, variables: a LoRA template and its (trained) variables.
    *args, **kwargs: sample inputs.
    adapters: other adapters to fold in instead of the variables' (a
      nested dict shaped like 'params', e.g. `aqtr.lora.partition`'s).

  Returns:
    A `Merged`: the float template with plain `aqtr.pax.EinsumOp`s, its
    variables, the `Rule`s that re-quantize each merged op with its base
    format (float bases: config None), and the dequantized bases.
  """
  found = sites(template, *args, **kwargs)
  nodes = _nodes(template)
  dotted = _dotted(template)
  params = flax.core.unfreeze(variables['params'])
  frozen = flax.core.unfreeze(variables.get(aqtr_linen.FROZEN, {}))
  rules, bases = [], {}
  for ps in found:
    s, node = ps.site, nodes[ps.index]
    src = params if adapters is None else flax.core.unfreeze(adapters)
    a, b = _pair(src, ps, adapters is not None)
    base = base_config(ps.lora.base)
    if node.config is not None:
      holder = storage.LoraBox(
        {_KEY: _get(frozen, s.module_path)},
        shape=s.weight.shape,
        dtype=s.weight.dtype,
        ref_ndim=_qvalue_ndim(_get(frozen, s.module_path)),
        table=node.table,
        scale_shapes=node.scale_shapes,
      )
      w = dequantized(holder, s, base)
      bases['/'.join(map(str, s.module_path))] = w
      _get(frozen, s.module_path[:-1]).pop(s.module_path[-1])
    else:
      w = nn.meta.unbox(_get(params, (*ps.layer, s.param)))
    w = (w + delta(s, a, b, ps.lora.scale)).astype(s.weight.dtype)
    _put(params, (*ps.layer, s.param), w)
    op_params = _get(params, s.module_path)
    for name in s.names:
      op_params.pop(name, None)
    if not op_params:
      _get(params, ps.layer).pop(s.module_path[-1])
    rules.append(Rule(base, path=re.escape(dotted[ps.index]), weight=True))
  out = copy.deepcopy(template)
  for node in selectors.select(out, LoraEinsum):
    fdl.update_callable(node, ops.EinsumOp, drop_invalid_args=True)
    node.config, node.mode = None, Mode.TRAIN
  fv = {
    k: v
    for k, v in flax.core.unfreeze(variables).items()
    if k != aqtr_linen.FROZEN
  }
  fv['params'] = params
  if any(jax.tree.leaves(frozen)):
    fv[aqtr_linen.FROZEN] = frozen
  return Merged(out, fv, rules, bases)


def merge(
  template,
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
  """A LoRA template's adapters merged into re-quantized weights.

  As `aqtr.lora.merge` (its arguments, the same solvers): the float merge
  `float_merged`, then `requant.requantized` on the base formats.

  Returns:
    (serving template in Mode.SERVE, variables), or with `report=True`
    ((template, variables), PtqReport); float formats: the float
    template and variables.
  """
  if variables is None:
    raise TypeError('aqtr.lora.merge: a Pax template needs variables=.')
  m = float_merged(
    template, *args, variables=variables, adapters=adapters, **kwargs
  )
  rules = m.rules
  if not (isinstance(requantize, str) and requantize == 'base'):
    fmt = base_config(requantize)
    rules = [dataclasses.replace(r, config=fmt) for r in rules]
  rules = [r for r in rules if r.config is not None]
  check_solver(method, batches, grid, report, requantize, not rules)
  if not rules:
    served = (m.template, m.variables)
    return (served, None) if report else served
  served, rep = requantized(
    m.template,
    rules,
    *args,
    variables=m.variables,
    method=method,
    batches=batches,
    grid=grid,
    base_weights=m.bases,
    **kwargs,
  )
  return (served, rep) if report else served


def sizes(template, *args, variables=None, **kwargs) -> Bytes:
  """Training bytes of a LoRA template vs full fine-tuning (AdamW)."""
  params = flax.core.unfreeze(variables['params'])
  frozen = variables.get(aqtr_linen.FROZEN, {})
  floats, base, base_float = set(), 0, 0
  for ps in sites(template, *args, **kwargs):
    key = (*ps.layer, ps.site.param)
    if not isinstance(_get(params, key), aqtr_linen.Removed):
      floats.add(key)
      continue
    w = ps.site.weight
    base += lifecycle.nbytes(_get(frozen, ps.site.module_path))
    base_float += math.prod(w.shape) * jnp.dtype(w.dtype).itemsize
  ad = other = 0
  for path, v in traverse_util.flatten_dict(params).items():
    if isinstance(v, aqtr_linen.Removed):
      continue
    n = lifecycle.nbytes(nn.meta.unbox(v))
    if str(path[-1]).startswith((A_PREFIX, B_PREFIX)):
      ad += n
    elif path in floats:
      base, base_float = base + n, base_float + n
    else:
      other += n
  return Bytes(ad, 2 * ad, base, other, 3 * (base_float + other), base_float)
