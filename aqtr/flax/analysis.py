"""Which operand of each op of a quantized model call is a weight.

`analyze(model, method, args, kwargs)` traces the call once with the
model's parameters as explicit jaxpr inputs (`aqtr.flax.hosts`), every
intercepted op's operands marked (`aqtr.flax.provenance.mark`), and
returns {op path: `WeightSite`}: the weight side, the parameter it comes
from, whether it is that parameter itself, whether it runs in a loop body
and whether the parameter is also read outside weight operands. Results
are cached per call signature (the model's structure, the shapes and
dtypes of its variables and inputs, the static inputs).

Because the decision is made on the jaxpr, it does not depend on how the
model is run: eager, under `jit`, `grad` / `vjp` / `value_and_grad`,
`vmap`, `scan`, `remat`, with parameters closed over. Weights are what
is computed from parameters alone: the parameter, its transpose, a
reshape, an `astype`, a slice, a weight norm; a parameter of another
module passed in as an argument is a weight too.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from aqtr.flax.quantized import quantize
  >>> from aqtr.rules import Rule
  >>> class Tied(nnx.Module):
  ...   def __init__(self):
  ...     self.table = nnx.Param(jnp.ones((8, 4)))
  ...   def __call__(self, x):
  ...     return x @ self.table[...].T
  >>> q = quantize(Tied(), [Rule('int8')])
  >>> w = analyze(q, type(q).aqtr_base.__call__, (jnp.ones((2, 4)),), {})
  >>> w['jnp.matmul0'] if False else w['dot_general0'].side
  'rhs'
"""

from __future__ import annotations

import collections

from aqtr.flax import hosts, intercept, provenance
from aqtr.flax.session import Session
from aqtr.flax.sites import WeightSite

__all__ = ['analyze']

_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 128


class _Probe(Session):
  """The analysis trace's handler: names each op, marks its operands."""

  def __init__(self, prefix: tuple):
    super().__init__(None, prefix=prefix, observed=False)
    self.wheres: list[str] = []

  def __call__(self, op: intercept.OpCall):
    _, _, _, where = self.locate(op, intercept.modules())
    n = len(self.wheres)
    self.wheres.append(where)
    if op.why:
      return op.float()
    lhs = provenance.mark(op.lhs, op=n, side=0)
    rhs = provenance.mark(op.rhs, op=n, side=1)
    return _call_with(op, lhs, rhs)


def _call_with(op: intercept.OpCall, lhs, rhs):
  """The op's own JAX function called with its operands replaced."""
  if op.kind == 'ragged_dot':
    return op.original(**dict(op.extra, lhs=lhs, rhs=rhs))
  args, kwargs = list(op.args), dict(op.kwargs)
  first = 1 if op.kind == 'einsum' else 0
  names = ('a', 'b') if op.name in ('jnp.matmul', 'jnp.dot') else ('lhs', 'rhs')
  for i, (name, value) in enumerate(zip(names, (lhs, rhs), strict=True)):
    if len(args) > first + i:
      args[first + i] = value
    else:
      kwargs[name] = value
  return op.original(*args, **kwargs)


def analyze(model, method, args, kwargs) -> dict[str, WeightSite]:
  """{op path: WeightSite} of the weight ops of `method(model, *args, **kw)`.

  Args:
    model: the quantized model (linen bound to its variables, or nnx).
    method: the plain function of the call (not intercepted again).
    args, kwargs: the call's inputs (arrays are abstracted).

  Returns:
    The weight operand of every op that has one, by op path.
  """
  host = hosts.of(model, need_variables=False)
  key = host.signature(method, args, kwargs)
  if key is not None and key in _CACHE:
    _CACHE.move_to_end(key)
    return _CACHE[key]
  prefix = hosts.call_prefix(model)
  probe = _Probe(prefix)
  with intercept.active(probe):
    paths, closed = host.trace_params(method, args, kwargs)
  found = provenance.walk(closed, len(paths))
  out = {}
  for n, where in enumerate(probe.wheres):
    lhs = found.operands.get((n, 0), provenance.DATA)
    rhs = found.operands.get((n, 1), provenance.DATA)
    if isinstance(rhs, provenance.Param):
      side, state = 'rhs', rhs
    elif isinstance(lhs, provenance.Param):
      side, state = 'lhs', lhs
    else:
      continue
    path = prefix + paths[min(state.leaves)]
    out[where] = WeightSite(
      op_path=where,
      module_path=path[:-1],
      param=path[-1],
      side=side,
      direct=state.direct,
      in_loop=state.in_loop,
      elsewhere=bool(state.leaves & found.elsewhere),
    )
  if key is not None:
    _CACHE[key] = out
    while len(_CACHE) > _CACHE_SIZE:
      _CACHE.popitem(last=False)
  return out
