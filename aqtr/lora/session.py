"""One call of a LoRA model: each intercepted op, plus its adapter.

`LoraSession` is the interception handler (`aqtr.flax.intercept`) of a
model made by `aqtr.lora.attach`: it runs the op as
`aqtr.flax.quantized.Session` does (the frozen base in SERVE through the
engine, or float) and adds the low-rank term

  dropout(x) A B * alpha / r

reading A and B from the module running the op (linen params / nnx
`Adapter` variables `lora_a_<op>`, `lora_b_<op>`). The weight operand's
contracted axes meet A's leading axes, its output axes follow B's first
(`adapter_shapes`). Recording (`LoraSpec.recording`) notes each op's
`aqtr.flax.sites.WeightSite` instead.

Example:
  >>> site = WeightSite(op_path='dot_general0', op_id='dot_general0',
  ...                   dimension_numbers=(((1,), (0,)), ((), ())),
  ...                   weight=jax.ShapeDtypeStruct((4, 3), jnp.float32))
  >>> adapter_names(site), adapter_shapes(site, 2)
  (('lora_a_dot_general0', 'lora_b_dot_general0'), ((4, 2), (2, 3)))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from aqtr.core.dot_general import dot_general as aqtr_dot_general
from aqtr.core.dot_general import fenced_cotangent
from aqtr.flax import intercept
from aqtr.flax.frozen import is_holder
from aqtr.flax.hosts import own_params, path_of
from aqtr.flax.session import OpSite, Session, swapped
from aqtr.flax.sites import WeightSite
from aqtr.lora.config import LoraConfig, adapter_config
from aqtr.rules import Rule

__all__ = [
  'A_PREFIX',
  'B_PREFIX',
  'Adapter',
  'LoraSession',
  'LoraSpec',
  'Site',
  'adapter_names',
  'adapter_shapes',
  'dropout',
  'low_rank',
  'raw_entries',
]

A_PREFIX, B_PREFIX = 'lora_a_', 'lora_b_'


class Adapter(nnx.Param):
  """nnx: a LoRA adapter matrix (the only trainable variables)."""


@contextlib.contextmanager
def dropout(key: jax.Array):
  """Within: adapters apply their `LoraConfig.dropout` with PRNG `key`.

  Each adapter op folds its index into `key` (inside a scan over layers
  every layer draws the same mask). Outside this block: no dropout.
  """
  ctx = intercept.context()
  before = ctx.lora_key
  ctx.lora_key = key
  try:
    yield
  finally:
    ctx.lora_key = before


# An adapter's site is the common weight site: `op_module` (where A and B
# live), `op_id` (their names), `param_path` (the base weight), `side`,
# `rule` (linen / nnx: the LoRA rule that set it; Pax: `index` and `lora`),
# `dimension_numbers` (weight on the rhs), `weight` and `other` (one
# layer's shapes).
Site = WeightSite


def adapter_names(site: WeightSite) -> tuple[str, str]:
  """The adapter parameters' names (A, B) of a weight site."""
  return A_PREFIX + site.op_id, B_PREFIX + site.op_id


def adapter_shapes(site: WeightSite, rank: int) -> tuple[tuple, tuple]:
  """One layer's (A, B) shapes: [contracted weight axes..., rank] and
  [rank, the weight's other axes...] (the contracted axes in the dot's
  order, the others in the weight's)."""
  (_, rc), _ = site.dimension_numbers
  shape = tuple(site.weight.shape)
  free = [d for d in range(len(shape)) if d not in rc]
  return (*(shape[d] for d in rc), rank), (rank, *(shape[d] for d in free))


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """What a LoRA model carries: selectors, configs, recording or not."""

  selectors: tuple[Rule, ...]
  configs: tuple[LoraConfig, ...]
  recording: bool = False


def raw_entries(holder) -> dict:
  """A frozen holder's stored entries (not decoded)."""
  return holder.stored()


class LoraSession(Session):
  """One call of a LoRA model: the base op, plus its adapter."""

  def __init__(self, spec_, lspec: LoraSpec, weights=None, stored=None):
    super().__init__(spec_, weights, stored=stored)
    self.lspec = lspec
    self.sites: list[WeightSite] = []
    self.activation_hits: set[int] = set()
    self.conv_hits: set[int] = set()
    self.n = 0

  def __call__(self, op: intercept.OpCall):
    stack = intercept.modules()
    module = stack[0] if stack else None
    out = super().__call__(op)
    e = self.entries[-1]
    if e.rule is None or module is None:
      if module is not None and (e.weight is None or op.kind == 'conv'):
        hits = self.activation_hits if e.weight is None else self.conv_hits
        self._note_unadapted(op, stack, module, hits)
      return out
    return self._adapt(op, module, e, out)

  def _note_unadapted(self, op, stack, module, hits: set[int]) -> None:
    """Adds to `hits` the rules that select this op (it takes no adapter)."""
    mpath = path_of(module)
    where = OpSite(
      '/'.join(map(str, mpath)),
      tuple('/'.join(map(str, mpath[:i])) for i in range(1, len(mpath))),
      tuple(type(m) for m in stack),
      type(module),
      op.kind,
      None,
    )
    for i, sel in enumerate(self.lspec.selectors):
      if sel.matches(where):
        hits.add(i)

  def _adapt(self, op, module, e, out):
    side, op_id = e.weight, e.path.rsplit('/', 1)[-1]
    label = f'aqtr.lora: {e.path} ({op.name} of shapes {e.shapes})'
    if op.kind not in ('dot_general', 'einsum'):
      raise ValueError(
        f'{label}: adapters go on dot_general / einsum weight ops, not '
        f'{op.kind}; exclude it from the LoRA rules.'
      )
    if op.run is None:
      raise ValueError(f'{label}: cannot take an adapter ({op.why}).')
    own = own_params(module)
    key = f'{op_id}_{side}'
    # The weight's parameter, as the jaxpr analysis found it (the same
    # under every transform), or the frozen holder of this op (SERVE).
    weight = self.weights.get(e.path)
    param = next(
      (k for k, v in own.items() if is_holder(v) and key in raw_entries(v)),
      None,
    )
    if param is None and weight is not None and weight.direct:
      name = weight.param
      if weight.module_path == tuple(path_of(module)) and name in own:
        param = name
    if param is None:
      raise ValueError(
        f'{label}: its weight operand is derived from a parameter (e.g. a '
        'transpose), not the parameter itself; adapters need the '
        'parameter: exclude this op from the LoRA rules.'
      )
    cfg = self.lspec.configs[e.rule]
    names = A_PREFIX + op_id, B_PREFIX + op_id
    ab = None if self.lspec.recording else _adapters(module, names, label)
    mpath = path_of(module)

    def adapter_dot(lhs, rhs, dn, precision, preferred):
      (lc, rc), (_, rb) = dn
      if rb:
        raise ValueError(
          f'{label}: the weight has batch axes {rb}; adapters need a weight '
          'of contracted and output axes only.'
        )
      site = WeightSite(
        op_path='/'.join(map(str, (*mpath, op_id))),
        op_id=op_id,
        op_module=mpath,
        module_path=mpath,
        param=param,
        side=side,
        kind=op.kind,
        dimension_numbers=dn,
        weight=jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
        other=jax.ShapeDtypeStruct(jnp.shape(lhs), jnp.result_type(lhs)),
        rule=e.rule,
      )
      a_shape, b_shape = adapter_shapes(site, cfg.rank)
      d_in, d_out = math.prod(a_shape[:-1]), math.prod(b_shape[1:])
      if cfg.rank > min(d_in, d_out):
        raise ValueError(
          f'{label}: LoraConfig.rank {cfg.rank} exceeds min(d_in, d_out) = '
          f'min({d_in}, {d_out}); use rank <= {min(d_in, d_out)}.'
        )
      if ab is None:
        self.sites.append(site)
        nl = jnp.ndim(lhs) - len(lc)
        shape = (
          *(jnp.shape(lhs)[d] for d in range(nl + len(lc)) if d not in lc),
        )
        return jnp.zeros((*shape, *b_shape[1:]), jnp.result_type(lhs))
      a, b = ab
      if tuple(a.shape) != a_shape or tuple(b.shape) != b_shape:
        raise ValueError(
          f'{label}: adapters of shapes {a.shape}, {b.shape} but the op '
          f'needs {a_shape}, {b_shape} (rank {cfg.rank}).'
        )
      self.n += 1
      return low_rank(lhs, a, b, lc, cfg, precision, self.n - 1)

    run = swapped(adapter_dot) if side == 'lhs' else adapter_dot
    delta = op.run(run, op.lhs, op.rhs)
    return out + delta.astype(out.dtype)


def low_rank(x, a, b, lc, cfg: LoraConfig, precision, index: int):
  """dropout(x) A B * alpha / r, x's contracted axes `lc` against A's.

  Inside `dropout(key)`, the mask's key is `fold_in(key, index)`.
  """
  key = intercept.context().lora_key
  if cfg.dropout and key is not None:
    k = jax.random.fold_in(key, index)
    keep = jax.random.bernoulli(k, 1.0 - cfg.dropout, jnp.shape(x))
    x = jnp.where(keep, x / (1.0 - cfg.dropout), 0).astype(x.dtype)
  qc = adapter_config(cfg)
  dot = (
    jax.lax.dot_general
    if qc is None
    else functools.partial(aqtr_dot_general, config=qc)
  )
  x = x.astype(a.dtype)
  dn_a = ((tuple(lc), tuple(range(len(lc)))), ((), ()))
  xa = dot(x, a, dn_a, precision=precision)
  dn_b = (((xa.ndim - 1,), (0,)), ((), ()))
  out = dot(xa, b, dn_b, precision=precision) * cfg.scale
  # B's gradient contracts the tokens: XLA:CPU copies the cotangent
  # transposed and, unfenced, recomputes the chain that made it (a GELU's
  # backward) inside that copy, a quarter of a LoRA step's time.
  return fenced_cotangent(out) if qc is None else out


def _adapters(module, names, label):
  """The module's (A, B) arrays; a clear error when they are missing."""
  got = []
  for name in names:
    v = own_params(module).get(name)
    if v is None:
      raise ValueError(
        f'{label}: no adapter {name!r} in the module; build the model with '
        'aqtr.lora.attach(model, rules, *sample_inputs).'
      )
    got.append(nn.meta.unbox(v))
  return tuple(got)
