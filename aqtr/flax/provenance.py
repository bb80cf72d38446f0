"""Which operand of each intercepted op is a weight: decided on the jaxpr.

An operand is a *weight* when it is computed from the model's parameters
alone (no input data): the parameter itself, or a transpose, reshape,
`astype`, slice, weight norm ... of parameters. The decision is made once
per call signature on a jaxpr of the model traced with its parameters as
explicit inputs (`analyze`): each intercepted op's operands are marked
(`mark`, an identity primitive that only this trace emits) and a forward
pass over the jaxpr labels every variable DATA (depends on an input),
PARAM (parameters and constants only; which leaves, whether it is a leaf
itself) or CONST. Nothing here looks at tracers, so the answer is the
same whatever transforms run the model (`jit`, `grad` / `vjp`, `vmap`,
`scan`, `remat`, closed-over parameters): the op is looked up by its path
(`'<module path>/<kind><n>'`) at run time.

The same pass tells, per parameter, whether anything but a marked operand
reads it (an embedding table also looked up by a gather): `convert` must
keep such a parameter in place.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def f(params, x):
  ...   w = mark(params['w'].T, op=0, side=1)
  ...   return mark(x, op=0, side=0) @ w
  >>> a = walk(jax.make_jaxpr(f)({'w': jnp.ones((3, 2))}, jnp.ones((4, 2))),
  ...          n_params=1)
  >>> a.operands[(0, 1)], a.operands[(0, 0)] is DATA
  (Param(leaves=frozenset({0}), direct=False, in_loop=False), True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

__all__ = ['DATA', 'Analysis', 'Param', 'mark', 'walk']


class _Data:
  def __repr__(self) -> str:
    return 'DATA'


DATA = _Data()  # depends on an input (or on a marked operand)


@dataclasses.dataclass(frozen=True)
class Param:
  """A value computed from parameters (and constants) only.

  Attributes:
    leaves: indices of the parameter leaves it is computed from.
    direct: it is one leaf itself (or a per-iteration slice of a stacked
      leaf in a scan over layers).
    in_loop: computed inside a loop body (scan / while / cond branch).
  """

  leaves: frozenset
  direct: bool
  in_loop: bool = False


_mark_p = jcore.Primitive('aqtr_operand')
_mark_p.def_impl(lambda x, **_: x)
_mark_p.def_abstract_eval(lambda x, **_: x)
batching.primitive_batchers[_mark_p] = lambda a, d, **p: (
  _mark_p.bind(*a, **p),
  d[0],
)
ad.primitive_jvps[_mark_p] = lambda p, t, **kw: (_mark_p.bind(*p, **kw), t[0])
mlir.register_lowering(
  _mark_p, mlir.lower_fun(lambda x, **_: x, multiple_results=False)
)


def mark(x, *, op: int, side: int):
  """Identity that names `x` operand `side` (0 lhs, 1 rhs) of op `op`."""
  return _mark_p.bind(x, op=op, side=side)


@dataclasses.dataclass
class Analysis:
  """What `walk` found.

  Attributes:
    operands: (op, side) -> DATA, None (a constant) or Param.
    elsewhere: parameter leaves read by something other than a marked
      operand.
  """

  operands: dict = dataclasses.field(default_factory=dict)
  elsewhere: set = dataclasses.field(default_factory=set)


def _combine(states) -> Any:
  leaves, any_param = set(), False
  in_loop = False
  for s in states:
    if s is DATA:
      return DATA
    if isinstance(s, Param):
      leaves |= s.leaves
      in_loop |= s.in_loop
      any_param = True
  if not any_param:
    return None
  return Param(frozenset(leaves), False, in_loop)


def _jaxpr(j):
  """(jaxpr, consts count) of a Jaxpr or ClosedJaxpr."""
  if isinstance(j, jcore.ClosedJaxpr):
    return j.jaxpr
  return j


def _subjaxprs(params) -> list:
  out = []
  for v in params.values():
    if isinstance(v, jcore.ClosedJaxpr | jcore.Jaxpr):
      out.append(v)
    elif isinstance(v, tuple | list):
      out.extend(x for x in v if isinstance(x, jcore.ClosedJaxpr | jcore.Jaxpr))
  return out


def _loop(s, sliced: bool = False):
  if isinstance(s, Param):
    return Param(s.leaves, s.direct and sliced, True)
  return s


class _Walker:
  def __init__(self):
    self.result = Analysis()

  def read(self, env, v):
    if isinstance(v, jcore.Literal):
      return None
    return env.get(v, None)

  def run(self, jaxpr, ins) -> list:
    """States of `jaxpr`'s outputs given its inputs' states."""
    env = {}
    for v, s in zip(jaxpr.invars, ins, strict=True):
      env[v] = s
    for v in jaxpr.constvars:
      env[v] = None
    for eqn in jaxpr.eqns:
      states = [self.read(env, v) for v in eqn.invars]
      outs = self.eqn(eqn, states)
      for v, s in zip(eqn.outvars, outs, strict=True):
        env[v] = s
    return [self.read(env, v) for v in jaxpr.outvars]

  def flag(self, states) -> None:
    """Parameters meeting data outside a marked operand: read elsewhere."""
    if any(s is DATA for s in states):
      for s in states:
        if isinstance(s, Param):
          self.result.elsewhere |= set(s.leaves)

  def eqn(self, eqn, states) -> list:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if eqn.primitive is _mark_p:
      key = (eqn.params['op'], eqn.params['side'])
      self.result.operands[key] = states[0]
      return [DATA]
    subs = _subjaxprs(eqn.params)
    if not subs:
      self.flag(states)
      return [_combine(states)] * n_out
    if name == 'scan':
      nc, nk = eqn.params['num_consts'], eqn.params['num_carry']
      body = _jaxpr(eqn.params['jaxpr'])
      ins = (
        [_loop(s) for s in states[:nc]]
        + [DATA] * nk
        + [_loop(s, sliced=True) for s in states[nc + nk :]]
      )
      self.flag(states[nc : nc + nk] + [DATA])
      self.run(body, ins)
      return [DATA] * n_out
    if name == 'while':
      cn, bn = eqn.params['cond_nconsts'], eqn.params['body_nconsts']
      body = _jaxpr(eqn.params['body_jaxpr'])
      carry = states[cn + bn :]
      self.flag(carry + [DATA])
      consts = [_loop(s) for s in states[cn : cn + bn]]
      self.run(body, consts + [DATA] * len(carry))
      return [DATA] * n_out
    if name == 'cond':
      outs = []
      for b in eqn.params['branches']:
        outs.append(self.run(_jaxpr(b), [_loop(s) for s in states[1:]]))
      if states[0] is DATA:
        return [DATA] * n_out
      return [_combine(col) for col in zip(*outs, strict=True)]
    # Calls (jit, remat, custom_jvp / vjp, shard_map, closed calls): the
    # first sub-jaxpr whose inputs line up with the equation's.
    for sub in subs:
      j = _jaxpr(sub)
      if len(j.invars) == len(states) and len(j.outvars) == n_out:
        return self.run(j, list(states))
    self.flag(states + [DATA])
    return [DATA if any(s is DATA for s in states) else _combine(states)] * (
      n_out
    )


def walk(closed, n_params: int) -> Analysis:
  """Labels the marked operands of `closed` (a ClosedJaxpr).

  Args:
    closed: the model's jaxpr; its first `n_params` inputs are the
      parameter leaves (in order), the rest are data.
    n_params: how many leading inputs are parameters.

  Returns:
    The Analysis: each marked operand's state and the parameters read
    outside marked operands.
  """
  jaxpr = closed.jaxpr
  ins = [
    Param(frozenset({i}), True) if i < n_params else DATA
    for i in range(len(jaxpr.invars))
  ]
  w = _Walker()
  outs = w.run(jaxpr, ins)
  w.flag(outs + [DATA])
  return w.result
