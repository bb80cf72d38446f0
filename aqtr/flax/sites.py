"""The one weight-site record: an op that reads a weight, and from where.

Every feature that meets a weight op describes it with a `WeightSite`:
the provenance analysis (`aqtr.flax.analysis`: which operand is a
weight, from which parameter, derived or not), the interception session
(`aqtr.flax.session`: what `aqtr.flax.convert` freezes), the PTQ
calibration pass (`aqtr.ptq.collect`: what the solvers solve) and LoRA
(`aqtr.lora`: where an adapter sits, linen / nnx and Pax). Each fills
the fields it knows (a frozen record: a later stage adds to it with
`dataclasses.replace`); features keep at most functions that read it.

Example:
  >>> import jax, jax.numpy as jnp
  >>> s = WeightSite(
  ...   op_path='dense/dot_general0', op_id='dot_general0',
  ...   module_path=('dense',), param='kernel',
  ...   dimension_numbers=(((1,), (0,)), ((), ())),
  ...   weight=jax.ShapeDtypeStruct((4, 3), jnp.float32))
  >>> s.param_path, s.key, s.contracting, s.holder
  (('dense', 'kernel'), 'dot_general0_rhs', (0,), (('dense',), 'kernel', \
'dot_general0_rhs'))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ['WeightSite']


def _tuples(dn) -> Any:
  """Dimension numbers as nested tuples (hashable)."""
  if dn is None:
    return None
  (lc, rc), (lb, rb) = dn
  return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightSite:
  """One op reading a weight: the op, the parameter, the op's geometry.

  Hashable (a static argument of `jax.jit`); `op` takes no part in
  equality or hashing; `config` and `op` stay out of its repr.

  Attributes:
    op_path: the op's path, by which features index it
      ('dense/dot_general0'; an injected Pax op: its module path).
    op_id: '<kind><n>', the op within the module running it (a Pax LoRA
      op: 'einsum').
    op_module: the path of the module running the op (where LoRA's
      adapters live; linen / nnx: the module holding the parameter).
    module_path: the path of the module holding the parameter (a weight
      computed from several parameters: the first one's).
    param: the parameter's name ('' when unknown: an injected Pax op).
    side: which operand of the op is the weight ('lhs' / 'rhs').
    kind: the op kind ('dot_general', 'einsum', 'conv', 'ragged_dot').
    dimension_numbers: of the op's one dot_general, weight as rhs (None
      before the op ran).
    config: the op's DotGeneralConfig (None: none chosen, LoRA).
    weight, other: shape and dtype of the weight and of the other
      operand (one layer) as the op reads them; the PTQ calibration pass
      records them as its dot reads them (a convolution: its kernel
      matrix and patches).
    direct: the operand is the parameter itself (one layer's slice of it
      in a scan over layers), not derived from it (a transpose, ...).
    in_loop: the op runs inside a loop body (scan / while / cond).
    elsewhere: the parameter is also read outside weight operands.
    state_at: stateful configs: (module path, op id) of the op's state
      (`aqtr.flax.rule_state.read`); None when the config keeps none.
    rule: the index of the rule that chose the op (LoRA's rules).
    index: a Pax LoRA op's number in the model (`LoraEinsum.index`).
    lora: a Pax LoRA op's own LoraConfig.
    op: the intercepted call (`aqtr.flax.intercept.OpCall`), which
      replays the op's contraction with another dot (`convert`).
  """

  op_path: str
  op_id: str = ''
  op_module: tuple = ()
  module_path: tuple = ()
  param: str = ''
  side: str = 'rhs'
  kind: str = ''
  dimension_numbers: Any = None
  config: Any = dataclasses.field(default=None, repr=False)
  weight: jax.ShapeDtypeStruct | None = None
  other: jax.ShapeDtypeStruct | None = None
  direct: bool = True
  in_loop: bool = False
  elsewhere: bool = False
  state_at: tuple | None = None
  rule: int | None = None
  index: int | None = None
  lora: Any = None
  op: Any = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    dn = _tuples(self.dimension_numbers)
    object.__setattr__(self, 'dimension_numbers', dn)
    object.__setattr__(self, 'module_path', tuple(self.module_path))
    object.__setattr__(self, 'op_module', tuple(self.op_module))

  @property
  def param_path(self) -> tuple:
    """The parameter's path: module path, then its name."""
    return (*self.module_path, self.param)

  @property
  def key(self) -> str:
    """The op's key in its frozen holder: '<op id>_<side>'."""
    return f'{self.op_id}_{self.side}'

  @property
  def contracting(self) -> tuple[int, ...]:
    """The weight's contraction dims (as the dot's rhs)."""
    return tuple(self.dimension_numbers[0][1])

  @property
  def holder(self) -> tuple:
    """(module path, parameter, op key) of the frozen entry
    `aqtr.flax.convert` writes; () when the parameter is unknown (an
    injected Pax op's entry sits in its own module)."""
    if not self.param:
      return ()
    return (self.module_path, self.param, self.key)
