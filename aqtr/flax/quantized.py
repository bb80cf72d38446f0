"""Quantize a stock Flax model by rules, without editing its code.

`quantize(model, rules)` returns a copy of a linen or nnx model whose
matched ops run through aqtr: every `lax.dot_general`, `jnp.einsum`,
`jnp.matmul` / `@`, `jnp.dot`, `lax.conv_general_dilated` and
`lax.ragged_dot` executed inside a module whose path (or an ancestor's) a
rule matches (`aqtr.rules.Rule`, first match wins) becomes `aqtr`'s op with
the rule's config (`aqtr.flax.intercept` catches the calls). An operand
that is a parameter of the module running the op is the weight; the
config's `rhs` quantizes it (operands are swapped when the weight is the
lhs). The parameter tree is the float model's: a float checkpoint loads.

Modes (`aqtr.Mode`): TRAIN quantizes on the fly (QAT: forward and both
gradients); `convert(model, ...)` runs CONVERT once (`aqtr.freezers`'
'weights' freezer: int8 / int4 / fp8 values + scales, exactly TRAIN's
quantization) and puts the frozen values in place of each matched float
kernel (`aqtr.flax.frozen`); the returned model serves (SERVE) bit for bit
equal to TRAIN. `lax.ragged_dot` weights are quantized on the fly in SERVE
too (not frozen). Unsupported here: stochastic rounding (no PRNG keys are
passed), stateful calibrations and CALIBRATE (use the `aqtr.flax.linen` /
`nnx` ops for those).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> q = quantize(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), [Rule('int8')])
  >>> q(jnp.ones((2, 4))).shape
  (2, 8)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import threading
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from aqtr import rules as rules_lib
from aqtr.core.config import DotGeneralConfig
from aqtr.core.ragged_dot import ragged_dot
from aqtr.flax import common, intercept
from aqtr.flax.frozen import FrozenKernel, holder_entries
from aqtr.freezers import Mode, configure, lifecycle
from aqtr.rules import OpEntry, Rule

_HOW = 'Run aqtr.flax.convert(model, ...) on the trained model first.'


def engine_dot(call: lifecycle.DotCall, mode, frozen, where: str):
  """THE call into aqtr's freezers: one dot in `mode`, (out, frozen).

  Errors about an operand get the op's name (`where`) here, at the
  boundary.
  """
  try:
    r = lifecycle.run(call, mode, frozen=frozen)
  except lifecycle.FreezerError as e:
    raise lifecycle.in_op(e, where) from None
  return r.out, r.frozen


def _weight_config(config: DotGeneralConfig) -> DotGeneralConfig:
  """The op's config when its rhs is a weight: frozen by 'weights'."""
  if not config.fwd.rhs.quantized:
    return config
  return configure(config, rhs='weights')


def _served(entries: dict, config, where: str) -> dict:
  """SERVE: the op's frozen entry for `config` (a clear error otherwise)."""
  return lifecycle.find_frozen(
    entries, config, where, 'the frozen kernel', _HOW
  )


def frozen_entry(config, frozen) -> dict:
  """CONVERT: the holder's entry of one op."""
  return {lifecycle.entry_name(config): frozen}


@dataclasses.dataclass
class OpSite:
  """What a rule sees of one intercepted op (`aqtr.rules.Rule.matches`)."""

  path: str
  prefixes: tuple[str, ...]
  layers: tuple[type, ...]
  op_cls: type
  kind: str
  weight: bool | None
  tags: frozenset = frozenset()


@dataclasses.dataclass
class WeightUse:
  """A weight operand met while recording: what convert must freeze."""

  module_path: tuple
  param: str
  key: str
  call: intercept.OpCall
  side: str
  config: DotGeneralConfig
  weight: jax.ShapeDtypeStruct
  other: jax.ShapeDtypeStruct


def path_of(module) -> tuple:
  """The module's path (linen: its scope path; nnx: set by `quantize`)."""
  if isinstance(module, nn.Module):
    return tuple(module.path)
  return tuple(getattr(module, 'aqtr_path', ()))


def own_params(module) -> dict:
  """{name: value} of the module's own parameters (arrays or holders)."""
  if isinstance(module, nn.Module):
    params = module.variables.get('params', {})
    return {
      k: module.get_variable('params', k)
      for k, v in params.items()
      if not isinstance(v, dict)
    }
  out = {}
  for k, v in vars(module).items():
    if isinstance(v, FrozenKernel):
      out[k] = v
    elif isinstance(v, nnx.Param):
      out[k] = v.get_value()
  return out


def _find(params: dict, x) -> str | None:
  """The name of the parameter `x` is (or a unary op's result of), or None.

  A derived operand (e.g. `embedding.T`) names its parameter too, but
  `direct` below tells `convert` not to freeze it from the parameter.
  """
  by_id = {
    id(nn.meta.unbox(v)): k
    for k, v in params.items()
    if holder_entries(v) is None
  }
  seen = 0
  while x is not None and seen < 8:
    if id(x) in by_id:
      return by_id[id(x)]
    parent = getattr(x, 'parent', None)
    ins = getattr(parent, 'in_tracers', ())
    x = ins[0] if len(ins) == 1 else None
    seen += 1
  return None


def swapped(dot):
  """`dot` with its operands swapped (the weight moved to the rhs)."""

  def run(lhs, rhs, dn, precision, preferred):
    (lc, rc), (lb, rb) = dn
    out = dot(rhs, lhs, ((rc, lc), (rb, lb)), precision, preferred)
    nb, nr = len(lb), jnp.ndim(rhs) - len(rc) - len(rb)
    nl = jnp.ndim(lhs) - len(lc) - len(lb)
    perm = (
      *range(nb),
      *range(nb + nr, nb + nr + nl),
      *range(nb, nb + nr),
    )
    return out.transpose(perm)

  return run


class Session:
  """One call of a quantized model: decides and runs each intercepted op."""

  def __init__(self, spec: _Spec):
    self.spec = spec
    self.entries: list[OpEntry] = []
    self.uses: list[WeightUse] = []
    self.matched: list[tuple[int, ...]] = []
    self.count: dict[Any, collections.Counter] = {}
    self.alive: list[Any] = []
    # Set by an observer (`aqtr.ptq`'s calibration pass): called with each
    # WeightUse in TRAIN instead of the quantized dot; returns its output.
    self.tap = None
    for observer in getattr(observers, 'stack', ()):
      observer.append(self)

  def _op_id(self, module, kind: str) -> str:
    owner = module.scope if isinstance(module, nn.Module) else module
    self.alive.append(owner)
    counter = self.count.setdefault(id(owner), collections.Counter())
    n = counter[kind]
    counter[kind] += 1
    return f'{kind}{n}'

  def __call__(self, op: intercept.OpCall):
    stack = intercept.modules()
    module = stack[0] if stack else None
    mpath = path_of(module) if module is not None else ()
    text = '/'.join(map(str, mpath))
    op_id = self._op_id(module, op.kind)
    where = f'{text}/{op_id}' if text else op_id
    params = own_params(module) if module is not None else {}
    side, param, frozen = self._weight(op, op_id, params)
    site = OpSite(
      text,
      tuple('/'.join(map(str, mpath[:i])) for i in range(1, len(mpath))),
      tuple(type(m) for m in stack),
      type(module),
      op.kind,
      side is not None,
    )
    matched = tuple(
      i for i, rule in enumerate(self.spec.rules) if rule.matches(site)
    )
    chosen = matched[0] if matched else None
    config = None if chosen is None else self.spec.configs[chosen]
    self.matched.append(matched)
    quantize = not common.is_float(config) and op.why == ''
    name = op.name if op.why == '' else f'{op.name} ({op.why}: float)'
    self.entries.append(
      OpEntry(
        where,
        name,
        config if quantize else None,
        chosen,
        op.kind,
        side,
        op.shapes(),
      )
    )
    if not quantize:
      return op.float()
    label = f'{where} ({op.name} of shapes {op.shapes()})'
    if getattr(config, 'needs_key', False):
      raise ValueError(
        f'{label}: the config rounds stochastically and interception passes '
        'no PRNG key; use a round-to-nearest config for this rule.'
      )
    try:
      direct = side is not None and any(
        getattr(op, side) is nn.meta.unbox(v) for v in params.values()
      )
      origin = (mpath, op_id, direct)
      return self._run(op, config, side, param, frozen, origin, label)
    except (ValueError, TypeError) as e:
      if str(e).startswith(where):
        raise
      raise type(e)(f'{label}: {e}') from e

  def _weight(self, op, op_id, params):
    """(weight side, parameter name, frozen entries) of the op."""
    for name, value in params.items():
      entries = holder_entries(value) or {}
      for side in ('lhs', 'rhs'):
        if f'{op_id}_{side}' in entries:
          return side, name, entries[f'{op_id}_{side}']
    sides = [s for s in ('rhs', 'lhs') if _find(params, getattr(op, s))]
    if not sides or (op.kind in ('conv', 'ragged_dot') and sides[0] != 'rhs'):
      return None, None, None
    return sides[0], _find(params, getattr(op, sides[0])), None

  def _run(self, op, config, side, param, frozen, origin, label):
    """The op in the session's mode; `origin`: (module path, op id, whether
    the weight operand is the parameter itself)."""
    mpath, op_id, direct = origin
    mode = self.spec.mode
    if op.kind == 'ragged_dot':
      return _ragged(op, config)
    if side is not None:
      config = _weight_config(config)
    if mode is Mode.SERVE and frozen is not None:
      frozen = _served(frozen, config, label)
    elif mode is Mode.SERVE and side is not None and config.fwd.rhs.quantized:
      if self.spec.converted:
        mode = Mode.TRAIN  # kept float by convert(keep=...): on the fly
      else:
        raise ValueError(
          f'{label}: mode SERVE reads frozen weights but the model holds '
          f'float parameter {param!r}. {_HOW}'
        )
    elif frozen is not None:
      raise ValueError(
        f'{label}: parameter {param!r} holds frozen serving values; mode '
        f'{mode.name} needs the float parameter. Train the quantized float '
        'model (aqtr.flax.quantize), serve the converted one.'
      )
    else:
      mode = Mode.TRAIN

    def dot(lhs, rhs, dn, precision, preferred):
      call = lifecycle.DotCall(lhs, rhs, dn, config, None, precision, preferred)
      return engine_dot(call, mode, frozen, label)[0]

    run = swapped(dot) if side == 'lhs' else dot
    if direct and mode is Mode.TRAIN and config.fwd.rhs.quantized:
      w = getattr(op, side)
      other = op.rhs if side == 'lhs' else op.lhs
      use = WeightUse(
        mpath,
        param,
        f'{op_id}_{side}',
        op,
        side,
        config,
        jax.ShapeDtypeStruct(jnp.shape(w), jnp.result_type(w)),
        jax.ShapeDtypeStruct(jnp.shape(other), jnp.result_type(other)),
      )
      self.uses.append(use)
      if self.tap is not None:
        return self.tap(use)
    return op.run(run, op.lhs, op.rhs)


def _ragged(op, config):
  a = op.extra
  return ragged_dot(
    a['lhs'],
    a['rhs'],
    a['group_sizes'],
    config,
    precision=a['precision'],
    preferred_element_type=a['preferred_element_type'],
    out_sharding=a['out_sharding'],
  )


observers = threading.local()


@dataclasses.dataclass(frozen=True)
class _Spec:
  """What a quantized model class carries: rules, built configs, mode."""

  rules: tuple[Rule, ...]
  configs: tuple[Any, ...]
  mode: Mode
  methods: tuple[str, ...] = ('__call__',)
  converted: bool = False


def intercepting(method, session, who: str, hint: str):
  """`method` with `session(cls)`'s interception active for its duration.

  Args:
    method: the model class's method (a plain function, maybe wrapped by
      flax's method handler).
    session: the model class -> the handler of its intercepted ops.
    who: the caller, for the error ('aqtr.flax.quantize').
    hint: the error's remedy.
  """
  raw = method
  while hasattr(raw, 'method_handler_wrapped'):
    raw = raw.__wrapped__
  if not inspect.isfunction(raw):
    raise TypeError(
      f'{who}: {getattr(raw, "__qualname__", raw)!r} is not a plain Python '
      f'function ({type(raw).__name__}, e.g. already jitted): its float ops '
      f'are captured and interception cannot run. {hint}'
    )

  @functools.wraps(raw)
  def call(self, *args, **kwargs):
    if intercept.is_active():
      return raw(self, *args, **kwargs)
    with intercept.active(session(type(self))):
      return raw(self, *args, **kwargs)

  return call


def _intercepting(method):
  return intercepting(
    method,
    lambda cls: Session(cls.aqtr_spec),
    'aqtr.flax.quantize',
    'Quantize the module before wrapping it in jax.jit / nnx.jit.',
  )


def _subclass(base: type, spec: _Spec) -> type:
  ns = {'aqtr_spec': spec, 'aqtr_base': base}
  for name in spec.methods:
    ns[name] = _intercepting(getattr(base, name))
  return type(base.__name__, (base,), ns)


def _spec(rules, methods) -> _Spec:
  rules = rules_lib.as_rules(rules, 'aqtr.flax.quantize')
  configs = []
  for i, r in enumerate(rules):
    c = rules_lib.built(rules_lib.resolve(r.config), f'rule {i} {r.label()}')
    if c is not None:
      lifecycle.validate(c)
    configs.append(c)
  return _Spec(rules, tuple(configs), Mode.TRAIN, tuple(methods))


def quantize(model, rules, *, methods=('__call__',)):
  """A copy of `model` (linen or nnx) whose matched ops run quantized.

  Args:
    model: a linen Module (unbound) or an nnx Module, built from stock
      layers and raw JAX ops; it is not changed.
    rules: `aqtr.rules.Rule`s in priority order (or one, or {path regex:
      config}); the first that matches an op sets its config.
    methods: the methods that start a model call (interception is active
      for their duration, covering every submodule they run).

  Returns:
    The quantized model in Mode.TRAIN: the same class name and parameter
    tree; train it as the float model.

  Raises:
    ValueError: a rule's config does not build or is invalid, or `model`
      is already quantized.
    TypeError: `model` is no Flax module, or a method cannot be
      intercepted (already jitted).
  """
  intercept.check_targets()
  if hasattr(type(model), 'aqtr_spec'):
    raise ValueError(
      f'aqtr.flax.quantize: {type(model).__name__} is already quantized; '
      'quantize the float model again, or use aqtr.flax.set_mode.'
    )
  spec = _spec(rules, methods)
  if isinstance(model, nnx.Module):
    model = nnx.clone(model)
    intercept.retarget(model)
    for path, m in nnx.iter_modules(model):
      m.aqtr_path = tuple(path)
  elif isinstance(model, nn.Module):
    if model.scope is not None:
      raise TypeError('aqtr.flax.quantize: pass an unbound linen Module.')
    model = model.copy()
  else:
    raise TypeError(
      f'aqtr.flax.quantize: model must be a flax.linen or flax.nnx Module, '
      f'got {type(model).__name__}.'
    )
  model.__class__ = _subclass(type(model), spec)
  return model


def spec_of(model):
  spec = getattr(type(model), 'aqtr_spec', None)
  if spec is None:
    raise ValueError(
      f'{type(model).__name__} is not quantized: call aqtr.flax.quantize.'
    )
  return spec


def set_mode(model, mode: Mode, *, converted_=None):
  """`model` (quantized) in `mode` (nnx: in place; returns the model)."""
  common.check_mode(mode)
  if mode not in (Mode.TRAIN, Mode.SERVE):
    raise ValueError(
      f'mode: interception runs Mode.TRAIN and Mode.SERVE, got {mode}; '
      'CONVERT is aqtr.flax.convert(model, ...).'
    )
  spec = spec_of(model)
  converted = spec.converted if converted_ is None else converted_
  spec = dataclasses.replace(spec, mode=mode, converted=converted)
  if isinstance(model, nn.Module):
    model = model.copy()
  model.__class__ = _subclass(type(model).aqtr_base, spec)
  return model


__all__ = [
  'OpSite',
  'intercepting',
  'own_params',
  'path_of',
  'quantize',
  'set_mode',
  'spec_of',
]
