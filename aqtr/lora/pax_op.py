"""The Pax op of LoRA: a weight einsum plus its low-rank adapter.

`LoraEinsum` is an `aqtr.pax.EinsumOp` (so rules, `aqtr.pax.inject` and
the Pax paths see it as one) that computes

  y = base(x W) + dropout(x) A B * alpha / r

(LoRA, Hu et al. 2021, arXiv 2106.09685; QLoRA, Dettmers et al. 2023,
arXiv 2305.14314): the base through the op's own contraction (SERVE reads
the frozen base from the collection 'aqtr', decoded from
`aqtr.lora.storage`'s compact form), `A` [contracted weight axes..., r]
and `B` [r, output axes...] params of the op (`lora_a_einsum`,
`lora_b_einsum`). `aqtr.lora.pax.attach` puts it in a template's slots;
`sites` records, by tracing a LoRA template abstractly, where each adapter
sits (an `aqtr.flax.sites.WeightSite`: `op_module` the op's path, where A
and B live; `module_path` the layer holding the weight; `index`, `lora`).

Example:
  >>> import jax.numpy as jnp
  >>> op = LoraEinsum(lora=LoraConfig(rank=2))
  >>> x, w = jnp.ones((3, 8)), jnp.ones((8, 4))
  >>> v = op.init(jax.random.key(0), 'md,df->mf', x, w)
  >>> v['params']['lora_a_einsum'].shape, v['params']['lora_b_einsum'].shape
  ((8, 2), (2, 4))
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
from fiddle import selectors

import aqtr.flax.linen as aqtr_linen
from aqtr.core import einsum as einsum_lib
from aqtr.flax import intercept
from aqtr.flax.sites import WeightSite
from aqtr.lora import storage
from aqtr.lora.config import LoraConfig
from aqtr.lora.session import A_PREFIX, B_PREFIX, low_rank
from aqtr.pax import ops

__all__ = ['KEY', 'LoraEinsum', 'nodes', 'sites']

_OP = 'einsum'  # The adapters' op id: params lora_a_einsum, lora_b_einsum.
KEY = f'{_OP}_rhs'  # The stored entries' op key (`aqtr.lora.storage`).


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


class _Decoding(aqtr_linen.LinenOpHost):
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
    return storage.decode({KEY: raw}, self.shapes)[KEY]


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
    rec = intercept.context().lora_sites
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

  def _site(self, plan: _Plan, lhs, rhs, where: str) -> WeightSite:
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
    return WeightSite(
      op_path=where,
      op_id=_OP,
      op_module=tuple(self.path),
      module_path=tuple(self.path)[:-1],
      param=name,
      kind='einsum',
      dimension_numbers=plan.dn,
      weight=jax.ShapeDtypeStruct(jnp.shape(rhs), jnp.result_type(rhs)),
      other=jax.ShapeDtypeStruct(jnp.shape(lhs), jnp.result_type(lhs)),
      index=self.index,
      lora=self.lora,
    )


def nodes(template) -> list:
  """The `LoraEinsum` nodes of a template, by index."""
  got = sorted(selectors.select(template, LoraEinsum), key=lambda n: n.index)
  return list(got)


def sites(template, *args, **kwargs) -> list[WeightSite]:
  """The adapters of one call of a LoRA template (traced abstractly)."""
  model = fdl.build(template)
  intercept.context().lora_sites = []
  try:
    jax.eval_shape(lambda k: model.init(k, *args, **kwargs), jax.random.key(0))
    found = intercept.context().lora_sites
  finally:
    intercept.context().lora_sites = None
  out: dict[int, WeightSite] = {}
  for s in found:
    out.setdefault(s.index, s)
  return [out[i] for i in sorted(out)]
