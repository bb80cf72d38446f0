"""Interception: the float ops a stock Flax model runs, seen one by one.

While a handler is active (`active(handler)`, thread-local), the public
JAX functions a model calls are replaced by thin wrappers:
`jax.lax.dot_general`, `jax.numpy.einsum`, `jax.numpy.matmul` (also the
`@` operator, which JAX routes through the same function), `jax.numpy.dot`,
`jax.lax.conv_general_dilated` and `jax.lax.ragged_dot`. Each wrapper turns
the call into an `OpCall` (operands, kind, and how to compute it as one
`dot(lhs, rhs, dimension_numbers, precision, preferred)`) and hands it to
the handler. Calls the handler makes itself, calls from other threads and
calls with no active handler go straight to JAX. The engine's own
contractions never reach the wrappers: it calls the functions
`aqtr.core.prims` captured at import. Modules that captured a
function at construction (`nnx.Einsum(einsum_op=jnp.einsum)`) are pointed
at the wrappers by `retarget`.

The module running an op is found on the Python stack (the innermost frame
whose `self` is a bound linen Module or an nnx Module): this is trace-time
work only, nothing of it reaches the compiled program.

Example:
  >>> import jax.numpy as jnp
  >>> seen = []
  >>> def handler(op):
  ...   seen.append((op.name, op.kind))
  ...   return op.float()
  >>> with active(handler):
  ...   y = jnp.ones((2, 3)) @ jnp.ones((3, 4))
  >>> seen, y.shape
  ([('jnp.matmul', 'dot_general')], (2, 4))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from aqtr.core import conv as conv_lib
from aqtr.core.dimension_numbers import RAGGED
from aqtr.flax import common, kinds

# name -> (kind, the original function).
ORIGINALS = {
  'lax.dot_general': ('dot_general', jax.lax.dot_general),
  'jnp.einsum': ('einsum', jnp.einsum),
  'jnp.matmul': ('dot_general', jnp.matmul),
  'jnp.dot': ('dot_general', jnp.dot),
  'lax.conv_general_dilated': ('conv', jax.lax.conv_general_dilated),
  'lax.ragged_dot': ('ragged_dot', jax.lax.ragged_dot),
}
# (module name, attribute, name in ORIGINALS): what `active` patches. JAX's
# `@` calls `tensor_contractions.matmul` (a module attribute at call time).
_TARGETS = (
  ('jax.lax', 'dot_general', 'lax.dot_general'),
  ('jax.numpy', 'einsum', 'jnp.einsum'),
  ('jax.numpy', 'matmul', 'jnp.matmul'),
  ('jax._src.numpy.tensor_contractions', 'matmul', 'jnp.matmul'),
  ('jax.numpy', 'dot', 'jnp.dot'),
  ('jax.lax', 'conv_general_dilated', 'lax.conv_general_dilated'),
  ('jax.lax', 'ragged_dot', 'lax.ragged_dot'),
)


@dataclasses.dataclass
class Context:
  """All interception state of one thread, in one explicit object.

  Attributes:
    handler: the active handler of intercepted calls (None: none).
    quiet: the wrappers call JAX directly (the handler's own ops).
    observers: lists that each new `aqtr.flax.session.Session` is
      appended to (`report` / `convert` tracing, PTQ calibration); an
      observer with a `record_op` method also hears every weight op of
      injected `aqtr.pax` ops (`recorder`).
    lora_key: the PRNG key of LoRA adapters' dropout (`aqtr.lora`).
    lora_sites: Pax LoRA recording: the sites met, or None.
  """

  handler: Callable | None = None
  quiet: bool = False
  observers: list = dataclasses.field(default_factory=list)
  lora_key: Any = None
  lora_sites: list | None = None


_local = threading.local()  # the one thread-local: holds the Context


def context() -> Context:
  """This thread's interception Context."""
  c = getattr(_local, 'context', None)
  if c is None:
    c = _local.context = Context()
  return c


def recorder() -> Any:
  """The innermost observer that records weight ops (`record_op`), or
  None: what an injected op reports its weight contraction to."""
  for obs in reversed(context().observers):
    if hasattr(obs, 'record_op'):
      return obs
  return None


_lock = threading.Lock()
_installed = [0]  # how many `active` blocks are open, all threads


@dataclasses.dataclass
class OpCall:
  """One intercepted call.

  Attributes:
    name: the function called ('jnp.einsum', ...).
    kind: its op kind ('dot_general', 'einsum', 'conv', 'ragged_dot').
    lhs, rhs: the two operands.
    original, args, kwargs: the JAX function and its arguments.
    run: `run(dot, lhs, rhs)` computes the op with `dot(lhs, rhs,
      dimension_numbers, precision, preferred_element_type)` standing for
      its one contraction (None: the call has no such form and stays
      float; `why` says why).
    why: the reason it cannot be quantized, or ''.
  """

  name: str
  kind: str
  lhs: Any
  rhs: Any
  original: Callable
  args: tuple
  kwargs: dict
  run: Callable | None = None
  why: str = ''
  extra: dict = dataclasses.field(default_factory=dict)

  def float(self):
    """The call as JAX computes it (not intercepted again)."""
    with quiet():
      return self.original(*self.args, **self.kwargs)

  def shapes(self) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(jnp.shape(x)) for x in (self.lhs, self.rhs))


def _dn_of_dot(a, b):
  """`jnp.dot`'s contraction as dimension numbers (None: not a plain dot)."""
  if a.ndim < 1 or b.ndim < 1:
    return None
  return (((a.ndim - 1,), (max(b.ndim - 2, 0),)), ((), ()))


def _dn_of_matmul(a, b):
  """`jnp.matmul`'s contraction as dimension numbers (None: broadcasts
  across ranks). Batch axes of size 1 against any size broadcast (the
  engine's dot broadcasts them, as for a multi-query einsum)."""
  if a.ndim < 2 or b.ndim < 1:
    return None
  if b.ndim <= 2:
    return (((a.ndim - 1,), (0,)), ((), ()))
  if a.ndim != b.ndim or any(
    x != y and 1 not in (x, y)
    for x, y in zip(a.shape[:-2], b.shape[:-2], strict=True)
  ):
    return None
  batch = tuple(range(a.ndim - 2))
  return (((a.ndim - 1,), (b.ndim - 2,)), (batch, batch))


def _dot_like(name, kind, original, args, kwargs) -> OpCall:
  """dot_general / matmul / dot as one dot with dimension numbers."""
  if name == 'lax.dot_general':
    b = inspect.signature(original).bind(*args, **kwargs)
    b.apply_defaults()
    a = b.arguments
    lhs, rhs, dn = a['lhs'], a['rhs'], a['dimension_numbers']
    prec, pref = a['precision'], a['preferred_element_type']
    sharding = a['out_sharding']
  else:
    lhs, rhs = args[0], args[1]
    prec = kwargs.get('precision')
    pref = kwargs.get('preferred_element_type')
    sharding = kwargs.get('out_sharding')
    if len(args) != 2 or set(kwargs) - {
      'precision',
      'preferred_element_type',
      'out_sharding',
    }:
      return OpCall(name, kind, lhs, rhs, original, args, kwargs, why='args')
    x, y = jnp.asarray(lhs), jnp.asarray(rhs)
    dn = (_dn_of_dot if name == 'jnp.dot' else _dn_of_matmul)(x, y)
    if dn is None:
      why = f'{name} of shapes {x.shape}, {y.shape} broadcasts'
      return OpCall(name, kind, lhs, rhs, original, args, kwargs, why=why)

  def run(dot, lhs, rhs):
    return common.constrain(dot(lhs, rhs, dn, prec, pref), sharding)

  extra = {'out_sharding': sharding}
  return OpCall(name, kind, lhs, rhs, original, args, kwargs, run, '', extra)


def _einsum(name, kind, original, args, kwargs) -> OpCall:
  operands = args[1:]
  known = {'precision', 'preferred_element_type', 'out_sharding', 'optimize'}
  lhs = operands[0] if operands else None
  rhs = operands[1] if len(operands) > 1 else None
  # Flax's attention passes `_dot_general=lax.dot_general` (the default).
  inner = kwargs.get('_dot_general', jax.lax.dot_general)
  if inner not in (
    ORIGINALS['lax.dot_general'][1],
    WRAPPERS['lax.dot_general'],
  ):
    why = 'einsum with a custom _dot_general'
    return OpCall(name, kind, lhs, rhs, original, args, kwargs, why=why)
  known = known | {'_dot_general'}
  if len(operands) != 2 or not isinstance(args[0], str) or set(kwargs) - known:
    why = 'einsum of other than two operands'
    return OpCall(name, kind, lhs, rhs, original, args, kwargs, why=why)
  try:
    dn, perm = common.einsum_plan(args[0], jnp.ndim(lhs), jnp.ndim(rhs))
  except ValueError as e:
    return OpCall(name, kind, lhs, rhs, original, args, kwargs, why=str(e))
  prec = kwargs.get('precision')
  pref = kwargs.get('preferred_element_type')

  def run(dot, lhs, rhs):
    out = dot(lhs, rhs, dn, prec, pref)
    out = out if perm is None else out.transpose(perm)
    return common.constrain(out, kwargs.get('out_sharding'))

  return OpCall(name, kind, lhs, rhs, original, args, kwargs, run)


def _conv(name, kind, original, args, kwargs) -> OpCall:
  lhs, rhs = args[0], args[1]
  cargs = conv_lib.ConvArgs.bind(*args[2:], **kwargs)
  if cargs.batch_group_count != 1:
    why = 'batch_group_count > 1'
    return OpCall(name, kind, lhs, rhs, original, args, kwargs, why=why)

  def run(dot, lhs, rhs):
    return conv_lib.conv_via(dot, False, lhs, rhs, cargs)

  return OpCall(name, kind, lhs, rhs, original, args, kwargs, run)


def _ragged(name, kind, original, args, kwargs) -> OpCall:
  b = inspect.signature(original).bind(*args, **kwargs)
  b.apply_defaults()
  a = b.arguments
  call = OpCall(name, kind, a['lhs'], a['rhs'], original, args, kwargs)
  if a['group_offset'] is not None:
    call.why = 'ragged_dot with group_offset'
  call.extra = a

  def run(dot, lhs, rhs):
    out = dot(lhs, rhs, RAGGED, a['precision'], a['preferred_element_type'])
    return common.constrain(out, a['out_sharding'])

  call.run = run
  return call


_MAKERS = {
  'dot_general': _dot_like,
  'einsum': _einsum,
  'conv': _conv,
  'ragged_dot': _ragged,
}


def _wrapper(name: str) -> Callable:
  kind, original = ORIGINALS[name]

  @functools.wraps(original)
  def call(*args, **kwargs):
    ctx = context()
    handler = ctx.handler
    if handler is None or ctx.quiet:
      return original(*args, **kwargs)
    op = _MAKERS[kind](name, kind, original, args, kwargs)
    with quiet():
      return handler(op)

  call.aqtr_intercepts = name
  return call


WRAPPERS = {name: _wrapper(name) for name in ORIGINALS}


@contextlib.contextmanager
def quiet():
  """Within: the wrappers call JAX directly (the handler's own ops)."""
  ctx = context()
  before = ctx.quiet
  ctx.quiet = True
  try:
    yield
  finally:
    ctx.quiet = before


def _install(on: bool) -> None:
  with _lock:
    _installed[0] += 1 if on else -1
    if (on and _installed[0] != 1) or (not on and _installed[0] != 0):
      return
    for module_name, attr, name in _TARGETS:
      module = sys.modules.get(module_name) or importlib.import_module(
        module_name
      )
      want = WRAPPERS[name] if on else ORIGINALS[name][1]
      setattr(module, attr, want)


def check_targets() -> None:
  """Raises a RuntimeError when a function to intercept is not where JAX
  kept it (a JAX version this interception does not know)."""
  for module_name, attr, name in _TARGETS:
    module = importlib.import_module(module_name)
    got = getattr(module, attr, None)
    if got is not ORIGINALS[name][1] and got is not WRAPPERS[name]:
      raise RuntimeError(
        f'aqtr.flax.quantize cannot intercept {name}: {module_name}.{attr} '
        f'is {got!r}, not the function this JAX version exported; '
        'interception cannot run with this JAX.'
      )


@contextlib.contextmanager
def active(handler: Callable[[OpCall], Any]):
  """Within: every intercepted call of this thread goes to `handler`."""
  ctx = context()
  before = ctx.handler, ctx.quiet
  _install(True)
  ctx.handler, ctx.quiet = handler, False
  try:
    yield
  finally:
    ctx.handler, ctx.quiet = before
    _install(False)


def is_active() -> bool:
  """Whether a handler is active in this thread."""
  return context().handler is not None


def modules() -> list[Any]:
  """The Flax modules running now, innermost first (from the stack)."""
  found, seen = [], set()
  frame = inspect.currentframe().f_back
  while frame is not None:
    m = frame.f_locals.get('self')
    if id(m) not in seen and kinds.is_module(m):
      seen.add(id(m))
      found.append(m)
    frame = frame.f_back
  return found


def retarget(model: nnx.Module) -> None:
  """Points functions nnx modules captured at construction (e.g.
  `nnx.Einsum.einsum_op`) at the wrappers, so they are intercepted too."""
  by_id = {id(fn): WRAPPERS[name] for name, (_, fn) in ORIGINALS.items()}
  for _, m in nnx.iter_modules(model):
    for k, v in list(vars(m).items()):
      if callable(v) and id(v) in by_id:
        setattr(m, k, by_id[id(v)])
